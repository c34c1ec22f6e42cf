"""The policies a replay compares: static layouts, the oracle bound, and the DynMo loop on traced costs."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import numpy as np

from dynmo.balance import Problem, balance
from dynmo.controller import candidates
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.record import StepRecord
from dynmo.sim.replay.options import ReplayOptions
from dynmo.sim.replay.result import PolicyResult
from dynmo.sim.replay.runner import Runner
from dynmo.sim.trace import Trace


def static_layout(name: str, trace: Trace, stages: int, runner: Runner) -> Layout:
    if name == "uniform":
        return Layout.uniform(trace.num_layers, stages)
    if name == "profile-once":
        links = runner.link_times(stages)
        return profile_once_layout(profile_costs(runner.observed, runner.opts.profile_steps), stages, links, links)
    return Layout(tuple(balance(Problem(costs=trace.header.params, stages=stages), "deepspeed").boundaries))


def profile_costs(observed, profile_steps: int) -> np.ndarray:
    """profile-once's per-layer costs: the median over steps 1 .. profile_steps of what the
    runtime's profiler measured, one row per step (step 0, the warm-up, left out unless it is the
    only one)."""
    observed = np.asarray(observed, dtype=float)
    n = len(observed)
    lo = 1 if n > 1 else 0
    return np.median(observed[lo:min(n, 1 + profile_steps)], axis=0)


def profile_once_layout(costs, stages: int, transfer: Sequence[float] | None = None,
                        transfer_back: Sequence[float] | None = None) -> Layout:
    """The optimal contiguous layout (min-max stage load, `dynmo.balance` optimal) of per-layer
    `costs`, with per-link `transfer` seconds charged to the stage sending the activations and
    `transfer_back` to the stage sending the gradients."""
    r = balance(Problem(costs=[float(c) for c in costs], stages=stages, transfer=transfer,
                        transfer_back=transfer_back), "optimal")
    return Layout(tuple(r.boundaries))


def moved_bytes(old: Layout, new: Layout, workers: Sequence[int], layer_bytes: Sequence[int]) -> tuple[int, int]:
    """Layers whose worker changes (new stage j runs on old worker workers[j]) and their bytes."""
    a = old.owner()
    b = [workers[j] for j in new.owner()]
    moved = [i for i in range(len(a)) if a[i] != b[i]]
    return len(moved), int(sum(layer_bytes[i] for i in moved))


def run_static(trace: Trace, runner: Runner, layout: Layout, res: PolicyResult) -> None:
    for k in range(len(trace.steps)):
        res.overhead_s.append(0.0)
        runner.step(k, layout, res)


def run_oracle(trace: Trace, runner: Runner, stages: int, res: PolicyResult,
               others: Sequence[PolicyResult] = ()) -> None:
    """The oracle bound: at every step the layout of least simulated step time, free to change
    with no migration or decide cost. Its candidates are the controller's for that step's own
    costs (`dynmo.controller.candidates`, scored by the replay's own simulation of the step)
    and every layout another replayed policy (`others`) ran at that step, so no policy that runs
    the same microbatches can beat it."""
    transfer = runner.link_times(stages)
    for k in range(len(trace.steps)):
        problem = Problem(costs=runner.costs[k].tolist(), stages=stages, transfer=transfer, transfer_back=transfer)
        best, t_best = candidates.best_layout(problem, "optimal", None,
                                              lambda _p, lays: [runner.iteration_s(k, lay) for lay in lays])
        for r in others:
            if k < len(r.layouts) and r.microbatches[k] == runner.m and r.layouts[k] != list(best.boundaries):
                lay = Layout(tuple(r.layouts[k]))
                t = runner.iteration_s(k, lay)
                if t < t_best:
                    best, t_best = lay, t
        res.overhead_s.append(0.0)
        runner.step(k, best, res)


def run_dynamic(trace: Trace, runner: Runner, stages: int, balancer: str, do_repack: bool,
                 opts: ReplayOptions, res: PolicyResult) -> None:
    """The trainer's loop, on traced costs: decide before each step, observe after it."""
    h = trace.header
    links = runner.link_times(stages)  # the same each way: the engine's transfers are symmetric
    loop = DynmoLoop(replace(opts.balance, balancer=balancer, repack=do_repack), microbatches=runner.m,
                     schedule=runner.schedule, stages_per_rank=runner.v, layer_params=h.params,
                     layer_bytes=runner.prior_bytes,
                     transfer=links, transfer_back=links,
                     migration_fixed_s=opts.migration_fixed_s, migration_bandwidth=opts.migration_bandwidth)
    layout = static_layout(opts.initial, trace, stages, runner)
    m = runner.m
    n_steps = len(trace.steps)
    for k, st in enumerate(trace.steps):
        lbytes = runner.layer_bytes(k)  # what this step's migration ships
        t0 = time.perf_counter()
        decision = loop.decide(k, layout, n_steps - k)
        decide_s = time.perf_counter() - t0 if opts.charge_decide else 0.0
        overhead = decide_s
        events = [e for e in st.events if e.get("type") == "dynamism"]  # the traced run's own migrations do not apply
        if decision is not None and decision.layout != layout:
            new = decision.layout
            # a re-pack keeps pipeline positions 0..k-1 (as the runtime), so compare owners directly
            moved, nbytes = moved_bytes(layout, new, list(range(new.num_stages)), lbytes)
            seconds = opts.migration_fixed_s + nbytes / opts.migration_bandwidth if moved else 0.0
            if moved:
                res.migrations += 1
                res.layers_moved += moved
                res.migration_s += seconds
                overhead += seconds
                events.append({"type": "migration", "bytes": nbytes, "seconds": seconds})
            m = loop.retuned_microbatches(runner.local_batch, m, layout.num_stages, new.num_stages) or m
            layout = new
            loop.applied(m)
        res.decide_s += decide_s
        res.overhead_s.append(overhead)
        runner.step(k, layout, res, m)
        loop.observe(StepRecord(step=k, layout=list(layout.boundaries), microbatches=m,
                                layer_cost_s=runner.observed[k].tolist(), layer_state_bytes=list(lbytes),
                                layer_fwd_s=runner.fwd[k].tolist(), layer_bwd_s=runner.bwd[k].tolist(),
                                layer_wgrad_s=None if runner.wgrad is None else runner.wgrad[k].tolist(),
                                step_s=res.iteration_s[-1], events=events))
