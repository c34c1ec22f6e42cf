"""Checks of single values in a trace: each raises TraceError naming the field and what it got."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dynmo.jsonio import is_int, is_number
from dynmo.sim.trace import limits
from dynmo.sim.trace.limits import TraceError


def show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def finite(x: Any) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def length(name: str, v: Any, where: str) -> int:
    if not isinstance(v, list) or not v:
        raise TraceError(f"{where}: {name} must be a non-empty list, got {show(v)}")
    if len(v) > limits.MAX_LAYERS:
        raise TraceError(f"{where}: {len(v)} layers is over the limit MAX_LAYERS = {limits.MAX_LAYERS}")
    return len(v)


def int_field(name: str, v: Any, lo: int, hi: int, where: str) -> int:
    if not is_int(v):
        raise TraceError(f"{where}: {name} must be an integer, got {show(v)}")
    if v < lo:
        raise TraceError(f"{where}: {name} must be >= {lo}, got {v}")
    if v > hi:
        raise TraceError(f"{where}: {name} = {v} is over the limit {hi}")
    return int(v)


def ints(name: str, v: Any, n: int, where: str) -> list:
    """A list of n integers in [0, MAX_COUNT]."""
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} entries" if isinstance(v, list) else show(v)
        raise TraceError(f"{where}: {name} must be a list of {n} integers (one per layer), got {got}")
    for i, x in enumerate(v):
        if not is_int(x) or not 0 <= x <= limits.MAX_COUNT:
            raise TraceError(f"{where}: {name}[{i}] = {show(x)}; give integers from 0 to 2^53")
    return v


def times(name: str, v: Any, n: int, where: str) -> None:
    """A list of n finite numbers >= 0 (not booleans)."""
    if not isinstance(v, list):
        raise TraceError(f"{where}: {name} must be a list of {n} numbers (one per layer), got {show(v)}")
    if len(v) != n:
        raise TraceError(f"{where}: {name} has {len(v)} values for {n} layers")
    if all(type(x) is float for x in v):
        a = np.asarray(v, dtype=float)
        if bool(np.isfinite(a).all()) and bool((a >= 0).all()):
            return
    for i, x in enumerate(v):
        if not is_number(x):
            raise TraceError(f"{where}: {name}[{i}] = {show(x)} is not a number")
        if not (finite(x) and x >= 0):
            raise TraceError(f"{where}: {name} times must be finite and >= 0; {name}[{i}] = {show(x)}")
