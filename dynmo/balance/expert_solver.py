"""Expert placement's solver: `place_experts`, the greedy with local search and the exact branch
and bound (the problem and the bound: `dynmo.balance.expert_model`). Pure (numpy).

How. `place_experts` first runs a greedy: the copy counts come from repeatedly copying the
expert with the largest per-copy load (each count from 0 to the budget is tried), the pieces
then go largest first to the least-loaded rank with a free slot that does not hold that expert
yet (LPT with slots), and a local search moves or swaps pieces off the busiest rank while that
lowers it. Small instances (N <= EXACT_EXPERTS and E <= EXACT_RANKS) are then solved exactly by
branch and bound (experts largest first, each to a set of ranks; ranks in the same state are
interchangeable, so only one of them is tried; pruned by the lower bound, `lower_bound`), starting from
the greedy's answer; if the search needs more than `max_nodes` nodes it stops and the greedy's
(or the best found) answer is returned with `exact = False`. `tests/test_expert_placement.py`
checks the exact answers against brute force.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Sequence

import numpy as np

from dynmo.balance.expert_model import (EPS, PlacementResult, _budget, _busiest_of, _check_count, _to_placement,
                                        check_loads, lower_bound)

EXACT_EXPERTS = 12  # exact branch and bound up to this many experts ...
EXACT_RANKS = 4  # ... and this many ranks
MAX_NODES = 200_000  # nodes the branch and bound may visit before it settles for what it has


def _lpt(arr: np.ndarray, counts: list[int], ranks: int, cap: int) -> list[list[int]] | None:
    """Pieces largest first to the least-loaded rank with a free slot not holding that expert; None if stuck."""
    pieces = sorted(((arr[e] / c, e) for e, c in enumerate(counts) for _ in range(c)), key=lambda x: (-x[0], x[1]))
    load = np.zeros(ranks)
    used = np.zeros(ranks, dtype=int)
    assign: list[list[int]] = [[] for _ in counts]
    for size, e in pieces:
        best = None
        for r in range(ranks):
            if used[r] < cap and r not in assign[e] and (best is None or (load[r], used[r]) < (load[best], used[best])):
                best = r
        if best is None:
            return None
        assign[e].append(best)
        load[best] += size
        used[best] += 1
    return assign


def _improve(arr: np.ndarray, assign: list[list[int]], ranks: int, cap: int, max_rounds: int = 10_000) -> list[list[int]]:
    """Move or swap pieces off the busiest rank while that lowers it (the sorted rank loads fall each round)."""
    assign = [list(a) for a in assign]
    for _ in range(max_rounds):
        load = np.zeros(ranks)
        used = np.zeros(ranks, dtype=int)
        held: list[set[int]] = [set() for _ in range(ranks)]
        for e, rs in enumerate(assign):
            for r in rs:
                load[r] += arr[e] / len(rs)
                used[r] += 1
                held[r].add(e)
        b = int(np.argmax(load))
        top = load[b]
        best = None  # (resulting max of the two ranks, action)
        for e in held[b]:
            pe = arr[e] / len(assign[e])
            for r in range(ranks):
                if r == b or e in held[r]:
                    continue
                if used[r] < cap:  # move
                    m = max(top - pe, load[r] + pe)
                    if m < top - EPS and (best is None or m < best[0]):
                        best = (m, ("move", e, r, None))
                for f in held[r]:  # swap e (on b) with f (on r)
                    if f in held[b]:
                        continue
                    pf = arr[f] / len(assign[f])
                    if pf >= pe:
                        continue
                    m = max(top - pe + pf, load[r] - pf + pe)
                    if m < top - EPS and (best is None or m < best[0]):
                        best = (m, ("swap", e, r, f))
        if best is None:
            break
        _, (kind, e, r, f) = best
        assign[e][assign[e].index(b)] = r
        if kind == "swap":
            assign[f][assign[f].index(r)] = b
    return assign


def _copy_sequence(arr: np.ndarray, ranks: int, budget: int) -> list[list[int]]:
    """Copy counts after 0, 1, ..., budget extra copies, each given to the expert with the largest per-copy load."""
    counts = [1] * arr.size
    out = [list(counts)]
    for _ in range(budget):
        cand = [e for e in range(arr.size) if counts[e] < ranks]
        if not cand:
            break
        e = max(cand, key=lambda i: (arr[i] / counts[i], -i))
        counts[e] += 1
        out.append(list(counts))
    return out


def greedy(arr: np.ndarray, ranks: int, extra_slots: int, copies: int) -> list[list[int]]:
    cap = arr.size // ranks + extra_slots
    best, best_v = None, math.inf
    for counts in _copy_sequence(arr, ranks, _budget(arr.size, ranks, extra_slots, copies)):
        a = _lpt(arr, counts, ranks, cap)
        if a is None:
            continue
        a = _improve(arr, a, ranks, cap)
        v = _busiest_of(arr, a, ranks)
        if v < best_v - EPS:
            best, best_v = a, v
    assert best is not None  # no copies: N pieces in N + E x extra slots always fit
    return best


def _branch_and_bound(arr: np.ndarray, ranks: int, extra_slots: int, copies: int, start: list[list[int]],
                      max_nodes: int) -> tuple[list[list[int]], bool, int]:
    """(best assignment, search completed, nodes visited)."""
    n = arr.size
    cap = n // ranks + extra_slots
    order = sorted(range(n), key=lambda e: (-arr[e], e))
    best = [list(a) for a in start]
    best_v = _busiest_of(arr, best, ranks)
    lb_all = float(arr.sum()) / ranks
    load = [0.0] * ranks
    used = [0] * ranks
    assign: list[list[int]] = [[] for _ in range(n)]
    nodes = 0
    done = True

    def rec(i: int, left: int, cur: float) -> None:
        nonlocal best, best_v, nodes, done
        if not done:
            return
        if i == n:
            if cur < best_v - EPS:
                best, best_v = [list(a) for a in assign], cur
            return
        nodes += 1
        if nodes > max_nodes:
            done = False
            return
        e = order[i]
        most = min(ranks, 1 + left)
        # the remaining experts' tokens still have to go somewhere, and this expert's per-copy piece too
        if max(cur, lb_all, arr[e] / most) >= best_v - EPS:
            return
        free = [r for r in range(ranks) if used[r] < cap]
        options = []
        for k in range(1, min(most, len(free)) + 1):
            seen = set()
            for sub in combinations(free, k):
                key = tuple(sorted((load[r], used[r]) for r in sub))
                if key in seen:  # ranks in the same state are interchangeable
                    continue
                seen.add(key)
                piece = arr[e] / k
                options.append((max(cur, max(load[r] + piece for r in sub)), k, sub))
        options.sort(key=lambda o: (o[0], o[1]))
        for new_cur, k, sub in options:
            if new_cur >= best_v - EPS:
                break
            piece = arr[e] / k
            for r in sub:
                load[r] += piece
                used[r] += 1
            assign[e] = list(sub)
            rec(i + 1, left - (k - 1), new_cur)
            for r in sub:
                load[r] -= piece
                used[r] -= 1
            assign[e] = []
            if not done:
                return

    rec(0, _budget(n, ranks, extra_slots, copies), 0.0)
    return best, done, nodes


def place_experts(loads: Sequence[float], ranks: int, *, extra_slots: int = 0, copies: int = 0,
                  exact: bool | None = None, max_nodes: int = MAX_NODES) -> PlacementResult:
    """The placement of one MoE layer's experts on `ranks` ranks that minimises the busiest rank's load.

    `exact`: None (default) solves exactly when N <= EXACT_EXPERTS and ranks <= EXACT_RANKS, True always tries
    (up to `max_nodes` branch-and-bound nodes), False runs the greedy and local search only. The result's
    `lower_bound` is never above the optimum; `exact` says whether the answer is proven optimal.
    """
    arr = check_loads(loads, ranks, extra_slots, copies)
    _check_count("max_nodes", max_nodes, 1)
    lb = lower_bound(arr, ranks, extra_slots, copies)
    assign = greedy(arr, ranks, extra_slots, copies)
    v = _busiest_of(arr, assign, ranks)
    proven = v <= lb * (1 + 1e-12) + EPS
    method, nodes = "greedy", 0
    want = exact if exact is not None else (arr.size <= EXACT_EXPERTS and ranks <= EXACT_RANKS)
    if want and not proven:
        assign, proven, nodes = _branch_and_bound(arr, ranks, extra_slots, copies, assign, max_nodes)
        if proven:
            method = "exact"
    elif proven:
        method = "exact" if want else "greedy"
    p = _to_placement(assign, ranks)
    rl = p.rank_loads(arr)
    return PlacementResult(p, rl.tolist(), float(rl.max()), lb, bool(proven), method, nodes)
