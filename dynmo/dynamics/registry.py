"""Every dynamic-model case, in the order the trainer runs them on every rank."""

from __future__ import annotations

from dynmo.dynamics.blockstats import BlockStats
from dynmo.dynamics.case import Case
from dynmo.dynamics.earlyexit import EarlyExit
from dynmo.dynamics.freeze import Freeze
from dynmo.dynamics.noise import Noise
from dynmo.dynamics.prune import Prune
from dynmo.dynamics.skew import Skew

CASES: tuple[type[Case], ...] = (BlockStats, Skew, Noise, EarlyExit, Freeze, Prune)
