"""The step time a layout gives, the balancing problem it is judged on, and the microbatch count a
shorter pipeline needs. Pure."""

from __future__ import annotations

from dynmo.balance import Problem
from dynmo.layout import Layout


def positions_problem(costs: list[float], stages: int, current: Layout | None, speeds: list[float] | None,
                      transfer: list[float] | None, transfer_back: list[float] | None, memory: list[float] | None,
                      capacity: float | None) -> Problem:
    """The balancing problem of per-layer `costs` on the first `stages` pipeline positions (a
    re-pack keeps positions 0..stages-1): their worker speeds and the links between them."""
    return Problem(
        costs=costs,
        stages=stages,
        memory=memory,
        capacity=capacity,
        speeds=speeds[:stages] if speeds else None,
        transfer=transfer[: stages - 1] if transfer and stages > 1 else None,
        transfer_back=transfer_back[: stages - 1] if transfer_back and stages > 1 else None,
        current=list(current.boundaries) if current is not None else None,
    )


def step_time(loads: list[float], microbatches: int) -> float:
    """Seconds of one GPipe/1F1B step whose stages take `loads` per microbatch (link times
    included): one microbatch passes every stage (the fill and the drain), the other m - 1
    follow at the pace of the slowest stage. Exact for equal stages, and what the simulator's
    engine gives within its op overheads for unequal ones; the controller compares layouts,
    and re-packing keeps its tolerance, in this step time rather than in one stage's load."""
    return (microbatches - 1) * max(loads) + sum(loads)


def retune_microbatches(local_batch: int, microbatches: int, stages: int, new_stages: int) -> int:
    """Fewest microbatches for `new_stages` stages that keep the inherent bubble and the
    in-flight activations of `microbatches` on `stages` stages (see `dynmo.controller`)."""
    bubble = (stages - 1) / (microbatches + stages - 1)
    held = min(microbatches, stages) / microbatches
    for m in range(1, local_batch + 1):
        if local_batch % m:
            continue
        if (new_stages - 1) / (m + new_stages - 1) <= bubble + 1e-12 and min(m, new_stages) / m <= held + 1e-12:
            return m
    return microbatches
