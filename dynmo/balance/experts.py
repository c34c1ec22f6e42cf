"""Expert placement for expert parallelism: which rank holds which expert of one MoE layer. Pure.

    from dynmo.balance.experts import place_experts, static_placement, move_cost
    r = place_experts(loads=[900, 120, 300, 310, 80, 95, 400, 410], ranks=4)
    r.placement.ranks, r.rank_loads, r.busiest, r.lower_bound, r.exact, r.gap
    move_cost(static_placement(8, 4), r.placement, expert_bytes=2.1e6).bytes

The problem. A MoE layer has N experts and measured (or forecast) loads L_e, the tokens routed
to expert e. Its experts are spread over E expert-parallel ranks; a rank computes the real
tokens of the experts it holds, so the layer waits for the busiest rank:

    minimise  max_r  sum over the copies on rank r of  L_e / c_e

Each rank has `N / E + extra_slots` slots (N must be a multiple of E). With `copies` > 0 a hot
expert may be held by up to min(E, 1 + copies) ranks (at most one copy per rank; the copies of
all experts together at most `copies` beyond one each); its tokens are split evenly between
its copies (share 1 / c_e each; the optimal uneven split is not modelled). Using a copy is
allowed, never required.

How. `place_experts` first runs a greedy: the copy counts come from repeatedly copying the
expert with the largest per-copy load (each count from 0 to the budget is tried), the pieces
then go largest first to the least-loaded rank with a free slot that does not hold that expert
yet (LPT with slots), and a local search moves or swaps pieces off the busiest rank while that
lowers it. Small instances (N <= EXACT_EXPERTS and E <= EXACT_RANKS) are then solved exactly by
branch and bound (experts largest first, each to a set of ranks; ranks in the same state are
interchangeable, so only one of them is tried; pruned by the lower bound below), starting from
the greedy's answer; if the search needs more than `max_nodes` nodes it stops and the greedy's
(or the best found) answer is returned with `exact = False`. `tests/test_expert_placement.py`
checks the exact answers against brute force.

Lower bound (`lower_bound`), reported beside every answer so that the gap to the optimum is
visible where the answer is not proven exact: the largest of

  - the mean rank load, sum(L) / E;
  - the largest expert over the most copies it may have, max(L) / min(E, 1 + copies);
  - without copies: the (E+1)-th largest expert shares a rank with one of the E larger ones,
    so L_(E) + L_(E+1) (sorted descending, 1-based);
  - without copies: every rank holds at least N - (E-1) x slots experts, so the rank of the
    largest expert carries it plus the smallest that many minus one others.

Moving between placements (`move_cost`): every (expert, rank) pair of the new placement that
the old one lacks ships the expert's weights and optimizer state to that rank (the caller
gives the bytes per expert: `MOVE_BYTES_PER_PARAM`, 12 B a parameter for fp32 weights and
AdamW's two moments, what a move between steps ships: gradients are freed by then). `align` renames the new placement's ranks (rank loads do not depend on the names)
so that the fewest bytes move, an assignment problem solved exactly (Hungarian method).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

import numpy as np

EXACT_EXPERTS = 12  # exact branch and bound up to this many experts ...
EXACT_RANKS = 4  # ... and this many ranks
MAX_NODES = 200_000  # nodes the branch and bound may visit before it settles for what it has
EPS = 1e-12
MOVE_BYTES_PER_PARAM = 12  # what moving an expert ships: fp32 weights, AdamW exp_avg and exp_avg_sq


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


@dataclass(frozen=True)
class ExpertMoves:
    """What changing placements ships: (expert, receiving rank) pairs and their bytes."""

    moves: tuple[tuple[int, int], ...]
    bytes: float
    bytes_per_rank: tuple[float, ...]  # received by each rank

    @property
    def count(self) -> int:
        return len(self.moves)


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


def static_placement(num_experts: int, ranks: int) -> Placement:
    """Experts in index order, num_experts / ranks per rank (expert e on rank e // slots)."""
    num_experts = _check_count("num_experts", num_experts, 1)
    ranks = _check_count("ranks", ranks, 1)
    if num_experts % ranks:
        raise ValueError(f"{num_experts} experts do not divide evenly over {ranks} ranks")
    slots = num_experts // ranks
    return Placement(tuple((e // slots,) for e in range(num_experts)), tuple((1.0,) for _ in range(num_experts)),
                     ranks)


def start_order(num_experts: int, ranks: int, extra_slots: int = 0) -> tuple[int, ...]:
    """The placement a run starts from, as an order (rank by rank, slot by slot; `order_placement`):
    rank q holds experts q*L .. (q+1)*L - 1 (L = num_experts / ranks) and, in its `extra_slots`
    slots, copies of the experts that follow them, (q+1)*L, (q+1)*L + 1, ... (modulo
    num_experts). Under even routing every rank then computes the same tokens."""
    num_experts, ranks = _check_count("num_experts", num_experts, 1), _check_count("ranks", ranks, 1)
    extra_slots = _check_count("extra_slots", extra_slots, 0)
    if num_experts % ranks:
        raise ValueError(f"{num_experts} experts do not divide evenly over {ranks} ranks")
    L = num_experts // ranks
    if extra_slots > num_experts - L:
        raise ValueError(f"extra_slots = {extra_slots}: a rank holds each expert at most once, so at most "
                         f"{num_experts - L} beyond its {L}")
    return tuple(e for q in range(ranks)
                 for e in [*range(q * L, (q + 1) * L), *(((q + 1) * L + j) % num_experts for j in range(extra_slots))])


def check_order(order, num_experts: int, ranks: int) -> tuple[int, ...]:
    """`order` as a placement of `num_experts` experts over `ranks` ranks (rank by rank, slot by
    slot, the same number of slots on every rank), or ValueError saying what is wrong: every
    expert held somewhere, none twice on one rank."""
    try:
        order = tuple(int(e) for e in order)
    except (TypeError, ValueError):
        raise ValueError(f"placement {order!r} is not a list of expert indices") from None
    if num_experts % ranks:
        raise ValueError(f"{num_experts} experts do not divide over {ranks} ranks")
    if len(order) % ranks or len(order) < num_experts:
        raise ValueError(f"placement {list(order)} lists {len(order)} experts: give {ranks} ranks the same number of "
                         f"slots, at least {num_experts // ranks} each")
    if any(not 0 <= e < num_experts for e in order) or set(order) != set(range(num_experts)):
        raise ValueError(f"placement {list(order)} must hold every expert 0..{num_experts - 1}, and no other")
    k = len(order) // ranks
    for q in range(ranks):
        mine = order[q * k:(q + 1) * k]
        if len(set(mine)) != k:
            raise ValueError(f"placement {list(order)} puts an expert twice on rank {q} ({list(mine)})")
    return order


def order_placement(order: Sequence[int], ranks: int) -> Placement:
    """An order (rank by rank, slot by slot; an expert on several ranks is copied) as a
    `Placement`, each copy taking an even share of its expert's tokens."""
    k = len(order) // ranks
    holders: dict[int, list[int]] = {}
    for p, e in enumerate(order):
        holders.setdefault(int(e), []).append(p // k)
    rs = tuple(tuple(sorted(holders[e])) for e in range(len(holders)))
    return Placement(rs, tuple(tuple(1.0 / len(r) for _ in r) for r in rs), ranks)


def placement_order(p: Placement) -> tuple[int, ...]:
    """A placement whose ranks hold the same number of experts as an order, rank by rank (each
    rank's experts in index order)."""
    per = p.rank_experts()
    if len({len(r) for r in per}) > 1:
        raise ValueError(f"ranks hold {[len(r) for r in per]} experts: an order needs the same number on each "
                         "(fill_slots)")
    return tuple(e for rank in per for e in rank)


def fill_slots(p: Placement, loads: Sequence[float], extra_slots: int) -> Placement:
    """`p` with every rank's free slots (N / ranks + extra_slots each) filled by copies, each the
    (rank, expert) pair that leaves the busiest rank lightest (ties: the lightest rank, then the
    lowest expert): the runtime holds a full set of rows on every rank, and every copy takes its
    share of its expert's tokens. A fill can cost: loads 300, 30, 20, 10 on 2 ranks of 3 slots
    are best 0 1 | 0 2 3 (180 | 180) with a slot left free, 0 1 3 | 0 2 3 (185 | 175) filled.
    Pure and deterministic."""
    arr = np.asarray(loads, dtype=float)
    cap = p.num_experts // p.num_ranks + extra_slots
    assign = [list(r) for r in p.ranks]
    used = [0] * p.num_ranks
    for rs in assign:
        for r in rs:
            used[r] += 1
    if max(used) > cap:
        raise ValueError(f"a rank holds {max(used)} experts, more than its {cap} slots")
    while min(used) < cap:
        best = None
        for r in range(p.num_ranks):
            if used[r] == cap:
                continue
            for e in range(p.num_experts):
                if r in assign[e]:
                    continue
                assign[e].append(r)
                key = (_busiest_of(arr, assign, p.num_ranks), used[r], e, r)
                assign[e].pop()
                if best is None or key < best:
                    best = key
        _, _, e, r = best
        assign[e].append(r)
        used[r] += 1
    return _to_placement(assign, p.num_ranks)


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


def _busiest_of(arr: np.ndarray, assign: list[list[int]], ranks: int) -> float:
    load = np.zeros(ranks)
    for e, rs in enumerate(assign):
        for r in rs:
            load[r] += arr[e] / len(rs)
    return float(load.max())


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


def _hungarian(cost: np.ndarray) -> list[int]:
    """Column of every row in a least-cost perfect matching of a square cost matrix (O(n^3))."""
    n = cost.shape[0]
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    p = np.zeros(n + 1, dtype=int)
    way = np.zeros(n + 1, dtype=int)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[j0] = True
            i0, delta, j1 = p[j0], np.inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = cost[i0 - 1, j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while True:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
            if j0 == 0:
                break
    col = [0] * n
    for j in range(1, n + 1):
        col[p[j] - 1] = j - 1
    return col


def _expert_bytes(expert_bytes, n: int) -> np.ndarray:
    b = np.broadcast_to(np.asarray(expert_bytes, dtype=float), (n,)) if np.ndim(expert_bytes) == 0 else \
        np.asarray(expert_bytes, dtype=float)
    if b.shape != (n,) or not np.all(np.isfinite(b)) or np.any(b < 0):
        raise ValueError(f"expert_bytes must be one number >= 0 or one per expert ({n}), got {expert_bytes!r}")
    return b


def _check_pair(old: Placement, new: Placement) -> None:
    if old.num_experts != new.num_experts or old.num_ranks != new.num_ranks:
        raise ValueError(f"placements differ in shape: {old.num_experts} experts on {old.num_ranks} ranks against "
                         f"{new.num_experts} on {new.num_ranks}")


def align(old: Placement, new: Placement, expert_bytes: float | Sequence[float] = 1.0) -> Placement:
    """`new` with its ranks renamed so that the fewest bytes move from `old` (the rank loads are the same)."""
    _check_pair(old, new)
    b = _expert_bytes(expert_bytes, new.num_experts)
    E = new.num_ranks
    old_sets = [set(x) for x in old.rank_experts()]
    new_sets = [set(x) for x in new.rank_experts()]
    # cost[i][j]: bytes rank j receives if new rank i is renamed j
    cost = np.array([[sum(b[e] for e in new_sets[i] - old_sets[j]) for j in range(E)] for i in range(E)])
    col = _hungarian(cost)
    ranks = tuple(tuple(sorted(col[r] for r in rs)) for rs in new.ranks)
    shares = tuple(tuple(s[list(rs).index(r)] for r in sorted(rs, key=lambda r: col[r]))
                   for rs, s in zip(new.ranks, new.shares))
    return Placement(ranks, shares, E)


def move_cost(old: Placement, new: Placement, expert_bytes: float | Sequence[float]) -> ExpertMoves:
    """The (expert, rank) copies `new` holds that `old` does not, and the bytes they ship (each its expert's
    weights and optimizer state, `expert_bytes` per expert or one number for all)."""
    _check_pair(old, new)
    b = _expert_bytes(expert_bytes, new.num_experts)
    moves = []
    per_rank = [0.0] * new.num_ranks
    for e, (ro, rn) in enumerate(zip(old.ranks, new.ranks)):
        for r in rn:
            if r not in ro:
                moves.append((e, r))
                per_rank[r] += float(b[e])
    return ExpertMoves(tuple(moves), float(sum(per_rank)), tuple(per_rank))
