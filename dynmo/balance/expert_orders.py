"""Expert placements as the runtime holds them: the start (`static_placement`, `start_order`), an
order (rank by rank, slot by slot) checked and turned into a `Placement` and back, and the free
slots filled with copies (`fill_slots`). Pure (numpy).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dynmo.balance.expert_model import Placement, _busiest_of, _check_count, _to_placement


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
