"""What a balancer decided: the layout, its stage loads, and the move plan to get there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dynmo.layout import Layout, Move, imbalance

from .problem import EPS, BalanceError, Problem


@dataclass
class Result:
    balancer: str
    # stage j runs on worker workers[j]; boundaries is None when the assignment is not
    # contiguous (the paper's diffusion and first-fit re-packing can produce that)
    boundaries: list[int] | None
    assignment: list[int]  # worker of every layer
    workers: list[int]
    stage_loads: list[float]
    stage_memory: list[float]
    bottleneck: float
    imbalance: float
    moves: list[Move]
    released: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def contiguous(self) -> bool:
        return self.boundaries is not None

    @property
    def layout(self) -> Layout:
        if self.boundaries is None:
            raise BalanceError(f"{self.balancer} produced a non-contiguous assignment; it has no layout")
        return Layout(tuple(self.boundaries))

    def as_dict(self) -> dict:
        return {
            "balancer": self.balancer,
            "boundaries": self.boundaries,
            "stage_loads": self.stage_loads,
            "bottleneck": self.bottleneck,
            "imbalance": self.imbalance,
            "moves": [mv.as_dict() for mv in self.moves],
            "released": self.released,
            "workers": self.workers,
            "stage_memory": self.stage_memory,
            "contiguous": self.contiguous,
            **({} if self.contiguous else {"assignment": self.assignment}),
            "seconds": self.seconds,
        }


def make_result(
    problem: Problem,
    balancer: str,
    *,
    boundaries: Sequence[int] | None = None,
    owner: Sequence[int] | None = None,
    workers: Sequence[int] | None = None,
    current_owner: Sequence[int] | None = None,
    check_memory: bool = True,
) -> Result:
    """Build a Result for `problem` from boundaries (contiguous) or a stage per layer.

    `workers` maps the problem's stages to worker indices (re-packing); `current_owner` is
    the worker of every layer today (default: the problem's current layout). A layout that
    over-fills a stage's memory is an error, never a silent result.
    """
    p = problem.stages
    if boundaries is not None:
        lay = Layout(tuple(int(b) for b in boundaries))
        if lay.num_stages != p or lay.num_layers != problem.num_layers:
            raise AssertionError(f"{balancer} returned {list(lay.boundaries)} for {p} stages")
        owner_arr = np.repeat(np.arange(p), np.diff(lay.boundaries))
        bnd: list[int] | None = list(lay.boundaries)
    else:
        assert owner is not None
        owner_arr = np.asarray(owner, dtype=np.int64)
        counts = np.bincount(owner_arr, minlength=p)
        if len(owner_arr) != problem.num_layers or (counts == 0).any():
            raise AssertionError(f"{balancer} left a stage empty: layers per stage {counts.tolist()}")
        # contiguous iff stage numbers never decrease along the layers
        bnd = None
        if (np.diff(owner_arr) >= 0).all():
            bnd = [0] + np.cumsum(counts).tolist()
    loads = problem.loads_of_assignment(owner_arr)
    mem = problem.memory_of_assignment(owner_arr)
    if check_memory:
        slack = EPS * max(float(problem.m.sum()), 1.0)
        for j in range(p):
            if mem[j] > problem.cap[j] + slack:
                raise BalanceError(
                    f"balancer {balancer!r} puts {mem[j]:g} of memory on stage {j}, over its capacity "
                    f"{problem.cap[j]:g}; this balancer ignores memory, use balancer 'optimal'"
                )
    w = list(range(p)) if workers is None else [int(x) for x in workers]
    new_owner = np.asarray(w)[owner_arr]
    if current_owner is None:
        cur = problem.current_layout
        current_owner = np.repeat(np.arange(p), np.diff(cur.boundaries))
    cur_arr = np.asarray(current_owner)
    changed = np.flatnonzero(cur_arr != new_owner)
    moves = [Move(int(i), int(cur_arr[i]), int(new_owner[i])) for i in changed]
    return Result(
        balancer=balancer,
        boundaries=bnd,
        assignment=new_owner.tolist(),
        workers=w,
        stage_loads=loads,
        stage_memory=mem,
        bottleneck=max(loads),
        imbalance=imbalance(loads),
        moves=moves,
    )
