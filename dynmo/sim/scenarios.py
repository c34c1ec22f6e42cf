"""Unseen dynamics over a committed trace: seeded families of cost changes no shipped case produces. Pure.

    sc = generate(seed=7, steps=len(trace.steps), blocks=48)
    drifting = apply(scale_trace(trace, 48), sc)          # the same run, its blocks' costs changed

The committed traces hold the dynamics the shipped cases produce (pruning, freezing, routing...);
a controller tuned on them could still fail on a model whose costs move another way. A
`Scenario` multiplies each block's traced cost at each step by a factor (`Scenario.factors`),
so the trace's own step-to-step noise, measured on a real machine, stays underneath. Families
(`KINDS`, one per scenario, drawn with the seed):

  steps     one to three step changes, each on its own block group from its own step on; groups
            may overlap, so a later change can compound an earlier one;
  reversal  one group changes, and changes back after 5 steps to a third of the run;
  ramp      one group's cost moves linearly to its full change over 10 steps to half the run
            (reached by the last step at the latest);
  hot       a hot region (a run of blocks made costlier) that moves by up to its width every
            5 to 20 steps, bouncing at the model's ends.

Every change multiplies its group by 1 + size or 1 - size with size uniform in SIZES (30 % to
80 %); a group is a contiguous run of blocks (a region: the early layers, a frozen prefix) or,
one time in four, blocks drawn anywhere. Changes start after the first steps profile-once
measures (`PROFILE_STEPS` + 1) and before the last eighth of the run, so the static layouts a
user could have picked are fixed before any change and every change has steps to be followed
on. The same seed gives the same scenario; `apply` touches nothing but the blocks' costs
(forward, backward, weight gradient, the controller's cost), so E, L, parameters and bytes stay
as traced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from dynmo.sim.trace import Trace
from dynmo.sim.trace.kinds import block_groups

KINDS = ("steps", "reversal", "ramp", "hot")
SIZES = (0.3, 0.8)  # a change multiplies its group by 1 +- size, size uniform in this range
SCATTERED = 0.25  # the share of groups drawn anywhere rather than as one run of blocks
FIRST = 6  # changes start from this step on: profile-once measures steps 1..5
MIN_STEPS = 24  # the shortest run a scenario is drawn for


@dataclass(frozen=True)
class Change:
    """One change: `blocks` (indices among the blocks) times `factor` from step `start` on.
    reversal: back to 1 from `end`; ramp: reaches `factor` at `end`, linearly from 1 at `start`;
    hot: the group is the region at `start`, moving by `shift` blocks every `period` steps."""
    kind: str
    blocks: tuple[int, ...]
    factor: float
    start: int
    end: int = 0
    period: int = 0
    shift: int = 0

    @property
    def size(self) -> float:
        return abs(self.factor - 1.0)


@dataclass(frozen=True)
class Scenario:
    seed: int
    kind: str
    changes: tuple[Change, ...]

    def factors(self, steps: int, blocks: int) -> np.ndarray:
        """Per step and block, the factor its traced cost is multiplied by, shape (steps, blocks)."""
        f = np.ones((steps, blocks))
        k = np.arange(steps)
        for c in self.changes:
            g = np.asarray(c.blocks)
            if c.kind == "steps":
                f[c.start:, g] *= c.factor
            elif c.kind == "reversal":
                f[c.start:c.end, g] *= c.factor
            elif c.kind == "ramp":
                ramp = 1 + (c.factor - 1) * np.clip((k - c.start) / (c.end - c.start), 0.0, 1.0)
                f[:, g] *= ramp[:, None]
            else:
                for s in range(c.start, steps):
                    f[s, _region(c, s, blocks)] *= c.factor
        return f

    def describe(self) -> str:
        """One line: the family and each change's group, factor and steps."""
        parts = []
        for c in self.changes:
            g = f"blocks {c.blocks[0]}-{c.blocks[-1]}" if _contiguous(c.blocks) else f"{len(c.blocks)} blocks"
            when = {"steps": f"from {c.start}", "reversal": f"{c.start}-{c.end - 1}", "ramp": f"ramp {c.start}-{c.end}",
                    "hot": f"from {c.start}, moves {c.shift} every {c.period}"}[c.kind]
            parts.append(f"{g} x{c.factor:.2f} {when}")
        return f"{self.kind}: " + "; ".join(parts)


def _contiguous(blocks: tuple[int, ...]) -> bool:
    return blocks == tuple(range(blocks[0], blocks[0] + len(blocks)))


def _region(c: Change, step: int, blocks: int) -> np.ndarray:
    """The hot region's blocks at `step`: its start moves `shift` every `period` steps, to and fro."""
    width = len(c.blocks)
    span = blocks - width  # the region's first block runs over 0..span
    if span <= 0:
        return np.asarray(c.blocks)
    pos = c.blocks[0] + c.shift * ((step - c.start) // c.period)
    pos %= 2 * span
    first = pos if pos <= span else 2 * span - pos
    return np.arange(first, first + width)


def _factor(rng: np.random.Generator) -> float:
    size = rng.uniform(*SIZES)
    return 1 + size if rng.random() < 0.5 else 1 - size


def _group(rng: np.random.Generator, blocks: int) -> tuple[int, ...]:
    """A contiguous run of 2 .. blocks / 3 blocks, or (one time in four) as many drawn anywhere."""
    n = int(rng.integers(2, max(3, blocks // 3 + 1)))
    if rng.random() < SCATTERED:
        return tuple(sorted(int(b) for b in rng.choice(blocks, size=n, replace=False)))
    first = int(rng.integers(0, blocks - n + 1))
    return tuple(range(first, first + n))


def generate(seed: int, steps: int, blocks: int, kinds: tuple[str, ...] = KINDS) -> Scenario:
    """The scenario of `seed` for a run of `steps` steps of a model of `blocks` blocks."""
    if steps < MIN_STEPS or blocks < 4:
        raise ValueError(f"a scenario needs at least {MIN_STEPS} steps and 4 blocks, got {steps} and {blocks}")
    rng = np.random.default_rng(seed)
    kind = kinds[int(rng.integers(len(kinds)))]
    last = steps - steps // 8  # a change starts before the last eighth: it has steps to be followed on
    changes: list[Change] = []
    if kind == "steps":
        for _ in range(int(rng.integers(1, 4))):
            changes.append(Change("steps", _group(rng, blocks), _factor(rng), int(rng.integers(FIRST, last))))
        changes.sort(key=lambda c: c.start)
    elif kind == "reversal":
        start = int(rng.integers(FIRST, last - 5))
        end = start + int(rng.integers(5, max(6, steps // 3) + 1))
        changes.append(Change("reversal", _group(rng, blocks), _factor(rng), start, min(end, steps - 1)))
    elif kind == "ramp":
        start = int(rng.integers(FIRST, last - 10))
        end = start + int(rng.integers(10, max(11, steps // 2) + 1))
        changes.append(Change("ramp", _group(rng, blocks), _factor(rng), start, min(end, steps - 1)))
    else:
        width = int(rng.integers(2, max(3, blocks // 4 + 1)))  # up to a quarter of the model
        first = int(rng.integers(0, blocks - width + 1))
        changes.append(Change("hot", tuple(range(first, first + width)), 1 + rng.uniform(*SIZES),
                              int(rng.integers(FIRST, steps // 2)),
                              period=int(rng.integers(5, 21)), shift=int(rng.integers(1, width + 1))))
    return Scenario(seed, kind, tuple(changes))


def apply(trace: Trace, scenario: Scenario) -> Trace:
    """`trace` with each block's costs (all its units') multiplied by the scenario's factors."""
    groups = block_groups(trace.header.kinds, "a scenario")
    blocks = len(groups[0])
    f = scenario.factors(len(trace.steps), blocks)
    unit = np.ones((len(trace.steps), trace.num_layers))
    for g in groups:  # a block's halves (sublayer units) change together
        unit[:, g] = f
    steps = []
    for k, s in enumerate(trace.steps):
        def times(a):
            return None if a is None else (np.asarray(a, dtype=float) * unit[k]).tolist()
        steps.append(replace(s, fwd=times(s.fwd), bwd=times(s.bwd), wgrad=times(s.wgrad), cost=times(s.cost)))
    return Trace(trace.header, steps)
