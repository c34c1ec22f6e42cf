"""The one objective: the step time a layout gives under the schedule that runs.

`StepModel.step_s` splits each layer's cost into its forward, backward and weight-gradient
parts, sums them per stage (divided by the stage's worker speed), and runs one iteration of
the running schedule through the simulator's model (`dynmo.engine.batched`: the event-driven
engine's numbers, validated against real runs, for many layouts or steps in one pass). Link times are charged to the stage that sends, as in the
balancers' load model: a send occupies its sender (the activation's on the forward, the
gradient's on the backward), and a cut that ships more than the hidden state and the mask (a
boundary between a block's halves) costs its link its factor times more (`Problem.cut_factor`,
from the runtime's per-cut bytes). The controller's decisions, its
re-packing tolerance, the replay's oracle and the benchmark all compare layouts in it.

Above `MAX_SIM_OPS` ops (stages x microbatches x 2) one simulation costs seconds; there the
closed form `step_time` ((m - 1) x slowest stage + sum of the stages) stands in, which is exact
for GPipe and 1F1B once microbatches far outnumber stages.

Also here: the balancing problem of the first k pipeline positions, and the microbatch count a
shorter pipeline needs. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from dynmo.balance import Problem
from dynmo.engine import Wavefronts, build_plan, canonical_name, default_stages_per_rank
from dynmo.layout import Layout

# how callers hand the objective around: step seconds of each layout under one problem, and of
# each (one step's per-layer costs, layout) pair
StepsOf = Callable[[Problem, list[Layout]], Sequence[float]]
StepTimes = Callable[[list[list[float]], list[Layout]], Sequence[float]]

MAX_SIM_OPS = 400_000  # ops of one simulated iteration beyond which the closed form is used
FWD_SHARE = 1 / 3  # a layer's forward share of its cost before any is measured (backward ~ 2x forward)


@dataclass
class StepModel:
    """Simulated step time of a layout for one schedule and microbatch count.

    `fwd_share[i]` / `wgrad_share[i]`: layer i's forward / weight-gradient part of its cost
    (measured by the profiler; `FWD_SHARE` and half the backward before that)."""

    schedule: str = "1f1b"
    stages_per_rank: int | None = None  # multi-stage schedules; default: the schedule's
    fwd_share: list[float] | None = None
    wgrad_share: list[float] | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.schedule = canonical_name(self.schedule)
        if self.stages_per_rank is None:
            self.stages_per_rank = default_stages_per_rank(self.schedule)

    def observe_shares(self, fwd: list[float] | None, bwd: list[float] | None, wgrad: list[float] | None) -> None:
        """One step's measured per-layer forward, backward and weight-gradient seconds: the
        shares of each layer's cost its ops take from now on (a layer never measured keeps the
        prior)."""
        if not fwd or not bwd or len(fwd) != len(bwd):
            return
        f, b = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
        total = f + b
        ok = total > 0
        prior_f = np.full(len(f), FWD_SHARE) if self.fwd_share is None or len(self.fwd_share) != len(f) \
            else np.asarray(self.fwd_share)
        self.fwd_share = np.where(ok, f / np.where(ok, total, 1.0), prior_f).tolist()
        if wgrad and len(wgrad) == len(f):
            w = np.minimum(np.asarray(wgrad, dtype=float), b)
            self.wgrad_share = np.where(ok, w / np.where(ok, total, 1.0), (1 - prior_f) / 2).tolist()

    def plan(self, stages: int, m: int) -> Wavefronts | None:
        """The schedule's op graph for `stages` stages, or None when the closed form stands in."""
        v = self.stages_per_rank
        if stages % v or 2 * stages * m > MAX_SIM_OPS:
            return None
        if (stages, m) not in self._plans:
            self._plans[(stages, m)] = Wavefronts(build_plan(self.schedule, stages // v, m, stages_per_rank=v))
        return self._plans[(stages, m)]

    def step_s(self, problem: Problem, layout: Layout, microbatches: int) -> float:
        """Seconds of one step of `layout` under `problem`'s per-layer costs, worker speeds and
        link times (forward `transfer`, backward `transfer_back`, per link)."""
        return float(self.steps_s([problem], [layout], microbatches)[0])

    def steps_s(self, problems: Sequence[Problem], layouts: Sequence[Layout], microbatches: int,
                shares: Sequence[tuple | None] | None = None) -> np.ndarray:
        """`step_s` of each (problem, layout) pair, simulated together (`Wavefronts`): a decision
        scores its candidates, and the evidence every observed step, in one pass per stage count.
        `shares[i]`: the (forward, weight-gradient) shares of the layers' costs to split pair i's
        costs with (the ones measured on that pair's step), None for the model's latest."""
        out = np.zeros(len(layouts))
        by_stages: dict[int, list[int]] = {}
        for i, lay in enumerate(layouts):
            by_stages.setdefault(lay.num_stages, []).append(i)
        for S, idx in by_stages.items():
            graph = self.plan(S, microbatches)
            if graph is None:
                for i in idx:
                    out[i] = step_time(problems[i].loads_of_assignment(layouts[i].owner()), microbatches)
                continue
            parts = [self._stage_times(problems[i], layouts[i], shares[i] if shares else None) for i in idx]
            fwd, bwd, wgrad, tf, tb = (np.stack(x) for x in zip(*parts))
            out[idx] = graph.iteration_times(fwd, bwd, wgrad, tf, tb)
        return out

    def _stage_times(self, problem: Problem, layout: Layout, shares: tuple | None = None) -> tuple[np.ndarray, ...]:
        """(forward, backward, weight-gradient, forward link, backward link) seconds per stage of
        one microbatch. A send occupies its sender (gloo, and the runtime's injected link
        delays): the link times are added to the sending stage's op, and the graph's own
        transfers take no time."""
        c = np.asarray(problem.c, dtype=float)
        n = len(c)
        fwd_share, wgrad_share = shares if shares is not None else (self.fwd_share, self.wgrad_share)
        known = fwd_share is not None and len(fwd_share) == n
        f_share = np.asarray(fwd_share, dtype=float) if known else np.full(n, FWD_SHARE)
        w_known = known and wgrad_share is not None and len(wgrad_share) == n
        w_share = np.asarray(wgrad_share, dtype=float) if w_known else (1 - f_share) / 2
        starts = np.asarray(layout.boundaries[:-1])
        speed = np.asarray(problem.s, dtype=float)[: layout.num_stages]
        fwd = np.add.reduceat(c * f_share, starts) / speed
        bwd = np.add.reduceat(c * (1 - f_share), starts) / speed
        wgrad = np.minimum(np.add.reduceat(c * w_share, starts) / speed, bwd)
        S = layout.num_stages
        if S > 1:
            tf = np.asarray(problem.tf, dtype=float)[: S - 1]
            tb = np.asarray(problem.tb, dtype=float)[: S - 1]
            if problem.r is not None:  # each link's time x its cut's factor
                k = problem.r[np.asarray(layout.boundaries[1:-1])]
                tf, tb = tf * k, tb * k
            fwd[:-1] += tf
            bwd[1:] += tb
        none = np.zeros(max(S - 1, 0))
        return fwd, bwd, wgrad, none, none


def positions_problem(costs: list[float], stages: int, current: Layout | None, speeds: list[float] | None,
                      transfer: list[float] | None, transfer_back: list[float] | None, memory: list[float] | None,
                      capacity: float | None, cut_factor: list[float] | None = None) -> Problem:
    """The balancing problem of per-layer `costs` on the first `stages` pipeline positions (a
    re-pack keeps positions 0..stages-1): their worker speeds and the links between them, each
    link's time x the factor of the cut on it (`cut_factor`, per cut after layer i; None: 1)."""
    return Problem(
        costs=costs,
        stages=stages,
        memory=memory,
        capacity=capacity,
        speeds=speeds[:stages] if speeds else None,
        transfer=transfer[: stages - 1] if transfer and stages > 1 else None,
        transfer_back=transfer_back[: stages - 1] if transfer_back and stages > 1 else None,
        current=list(current.boundaries) if current is not None else None,
        cut_factor=cut_factor,
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
