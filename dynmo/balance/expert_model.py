"""Expert placement's model: the problem, a placement and its rank loads, the arguments' checks and
the lower bound every answer is reported beside. Pure (numpy).

The problem. A MoE layer has N experts and measured (or forecast) loads L_e, the tokens routed
to expert e. Its experts are spread over E expert-parallel ranks; a rank computes the real
tokens of the experts it holds, so the layer waits for the busiest rank:

    minimise  max_r  sum over the copies on rank r of  L_e / c_e

Each rank has `N / E + extra_slots` slots (N must be a multiple of E). With `copies` > 0 a hot
expert may be held by up to min(E, 1 + copies) ranks (at most one copy per rank; the copies of
all experts together at most `copies` beyond one each); its tokens are split evenly between
its copies (share 1 / c_e each; the optimal uneven split is not modelled). Using a copy is
allowed, never required.

Lower bound (`lower_bound`), reported beside every answer so that the gap to the optimum is
visible where the answer is not proven exact: the largest of

  - the mean rank load, sum(L) / E;
  - the largest expert over the most copies it may have, max(L) / min(E, 1 + copies);
  - without copies: the (E+1)-th largest expert shares a rank with one of the E larger ones,
    so L_(E) + L_(E+1) (sorted descending, 1-based);
  - without copies: every rank holds at least N - (E-1) x slots experts, so the rank of the
    largest expert carries it plus the smallest that many minus one others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

EPS = 1e-12


@dataclass(frozen=True)
class Placement:
    """Per expert: the ranks that hold a copy of it (sorted) and each copy's share of its tokens."""

    ranks: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[float, ...], ...]
    num_ranks: int

    @property
    def num_experts(self) -> int:
        return len(self.ranks)

    def rank_experts(self) -> list[list[int]]:
        """Per rank: the experts it holds a copy of."""
        out: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for e, rs in enumerate(self.ranks):
            for r in rs:
                out[r].append(e)
        return out

    def rank_loads(self, loads: Sequence[float]) -> np.ndarray:
        """Per rank: the tokens it computes for the given per-expert loads."""
        out = np.zeros(self.num_ranks)
        for e, (rs, sh) in enumerate(zip(self.ranks, self.shares)):
            for r, s in zip(rs, sh):
                out[r] += loads[e] * s
        return out

    def busiest(self, loads: Sequence[float]) -> float:
        return float(self.rank_loads(loads).max()) if self.num_ranks else 0.0

    def as_dict(self) -> dict:
        return {"ranks": [list(r) for r in self.ranks], "shares": [list(s) for s in self.shares],
                "num_ranks": self.num_ranks}


@dataclass(frozen=True)
class PlacementResult:
    placement: Placement
    rank_loads: list[float]
    busiest: float
    lower_bound: float
    exact: bool  # proven optimal (branch and bound completed)
    method: str  # "exact", "greedy"
    nodes: int = 0  # branch-and-bound nodes visited

    @property
    def gap(self) -> float:
        """busiest / lower_bound - 1: how far above the proven bound the answer may be (0 when equal)."""
        if self.lower_bound <= EPS:
            return 0.0
        return self.busiest / self.lower_bound - 1.0

    def as_dict(self) -> dict:
        return {"placement": self.placement.as_dict(), "rank_loads": self.rank_loads, "busiest": self.busiest,
                "lower_bound": self.lower_bound, "gap": self.gap, "exact": self.exact, "method": self.method,
                "nodes": self.nodes}


def _check_count(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def check_loads(loads: Sequence[float], ranks: int, extra_slots: int = 0, copies: int = 0) -> np.ndarray:
    """The loads as floats; ValueError naming what is wrong with any argument."""
    ranks = _check_count("ranks", ranks, 1)
    extra_slots = _check_count("extra_slots", extra_slots, 0)
    copies = _check_count("copies", copies, 0)
    try:
        arr = np.asarray(loads, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"loads must be a list of numbers, one per expert, got {loads!r}") from None
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"loads must be a non-empty list of numbers, one per expert, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        bad = int(np.flatnonzero(~np.isfinite(arr) | (arr < 0))[0])
        raise ValueError(f"loads must be finite and >= 0; expert {bad} has {arr[bad]!r}")
    if arr.size % ranks:
        raise ValueError(f"{arr.size} experts do not divide evenly over {ranks} ranks; "
                         "choose a number of ranks that divides the expert count")
    if copies and not extra_slots:
        raise ValueError(f"copies = {copies} need room: give extra_slots >= 1 (slots per rank beyond "
                         f"{arr.size // ranks})")
    return arr


def _budget(n: int, ranks: int, extra_slots: int, copies: int) -> int:
    """Extra copies that can actually be placed: the free slots and one copy per rank per expert bound them."""
    return min(copies, ranks * extra_slots, n * (ranks - 1))


def lower_bound(loads: Sequence[float], ranks: int, extra_slots: int = 0, copies: int = 0) -> float:
    """A bound no placement's busiest rank can beat (module doc)."""
    arr = check_loads(loads, ranks, extra_slots, copies)
    n = arr.size
    budget = _budget(n, ranks, extra_slots, copies)
    srt = np.sort(arr)[::-1]
    lb = max(float(arr.sum()) / ranks, float(srt[0]) / min(ranks, 1 + budget))
    if budget == 0:
        if n > ranks:
            lb = max(lb, float(srt[ranks - 1] + srt[ranks]))
        cap = n // ranks + extra_slots
        least = max(1, n - (ranks - 1) * cap)  # experts every rank holds at least
        if least > 1:
            lb = max(lb, float(srt[0] + np.sort(srt[1:])[: least - 1].sum()))
    return lb


def _to_placement(assign: list[list[int]], ranks: int) -> Placement:
    rs = tuple(tuple(sorted(a)) for a in assign)
    return Placement(rs, tuple(tuple(1.0 / len(r) for _ in r) for r in rs), ranks)


def _busiest_of(arr: np.ndarray, assign: list[list[int]], ranks: int) -> float:
    load = np.zeros(ranks)
    for e, rs in enumerate(assign):
        for r in rs:
            load[r] += arr[e] / len(rs)
    return float(load.max())
