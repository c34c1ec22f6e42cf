"""What changing expert placements ships, and the renaming of ranks that ships least. Pure (numpy).

Moving between placements (`move_cost`): every (expert, rank) pair of the new placement that
the old one lacks ships the expert's weights and optimizer state to that rank (the caller
gives the bytes per expert: `MOVE_BYTES_PER_PARAM`, 12 B a parameter for fp32 weights and
AdamW's two moments, what a move between steps ships: gradients are freed by then). `align` renames the new placement's ranks (rank loads do not depend on the names)
so that the fewest bytes move, an assignment problem solved exactly (Hungarian method).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dynmo.balance.expert_model import Placement

MOVE_BYTES_PER_PARAM = 12  # what moving an expert ships: fp32 weights, AdamW exp_avg and exp_avg_sq


@dataclass(frozen=True)
class ExpertMoves:
    """What changing placements ships: (expert, receiving rank) pairs and their bytes."""

    moves: tuple[tuple[int, int], ...]
    bytes: float
    bytes_per_rank: tuple[float, ...]  # received by each rank

    @property
    def count(self) -> int:
        return len(self.moves)


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
