"""The policies a replay compares: static layouts, the oracle bounds (per step, per window), and the DynMo loop on
traced costs."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import numpy as np

from dynmo.balance import Problem, balance
from dynmo.controller import candidates
from dynmo.engine import SimInputError
from dynmo.flops import block_halves_macs, head_macs
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.plan import named_layout
from dynmo.record import StepRecord
from dynmo.sim.replay.options import ReplayOptions, start_layout_name
from dynmo.sim.replay.result import PolicyResult
from dynmo.sim.replay.runner import Runner
from dynmo.sim.trace import Trace, block_map
from dynmo.sim.trace.format import traced_model
from dynmo.sim.trace.kinds import block_groups


def static_layout(name: str, trace: Trace, stages: int, runner: Runner) -> Layout:
    if name == "uniform":
        return Layout.uniform(trace.num_layers, stages)
    if name == "profile-once":
        links = runner.link_times(stages)
        return profile_once_layout(profile_costs(runner.observed, runner.opts.profile_steps), stages, links, links,
                                   runner.cut_factor)
    if name == "flops":
        return named_layout("flops", trace.num_layers, stages, flops=trace_flops(trace))
    return Layout(tuple(balance(Problem(costs=trace.header.params, stages=stages), "deepspeed").boundaries))


def trace_flops(trace: Trace) -> list[float]:
    """Each traced unit's nominal multiply-adds per token (`dynmo.flops`), from the model config in
    the trace's header; a scaled trace's new blocks take their source blocks' (`block_map`)."""
    model = traced_model(trace.header)
    if model is None:
        raise SimInputError("this trace's header records no model config, so its layers' FLOPs are unknown: "
                            "start from uniform, params or profile-once, or trace the run with this dynmo")
    groups = block_groups(trace.header.kinds, "the flops layout")
    per_block = [block_halves_macs(model, b) for b in range(model.n_layers)]
    src = block_map(model.n_layers, len(groups[0]))
    macs = [0.0] * trace.num_layers
    for part, positions in enumerate(groups):
        for j, pos in enumerate(positions):
            a, f = per_block[src[j]]
            macs[pos] = (a + f) if len(groups) == 1 else (a, f)[part]
    macs[-1] = head_macs(model)
    return macs


def profile_costs(observed, profile_steps: int) -> np.ndarray:
    """profile-once's per-layer costs: the median over steps 1 .. profile_steps of what the
    runtime's profiler measured, one row per step (step 0, the warm-up, left out unless it is the
    only one)."""
    observed = np.asarray(observed, dtype=float)
    n = len(observed)
    lo = 1 if n > 1 else 0
    return np.median(observed[lo:min(n, 1 + profile_steps)], axis=0)


def profile_once_layout(costs, stages: int, transfer: Sequence[float] | None = None,
                        transfer_back: Sequence[float] | None = None,
                        cut_factor: Sequence[float] | None = None) -> Layout:
    """The optimal contiguous layout (min-max stage load, `dynmo.balance` optimal) of per-layer
    `costs`, with per-link `transfer` seconds charged to the stage sending the activations and
    `transfer_back` to the stage sending the gradients, each times the `cut_factor` of the cut
    on the link (the bytes crossing it, relative to a cut between blocks)."""
    r = balance(Problem(costs=[float(c) for c in costs], stages=stages, transfer=transfer,
                        transfer_back=transfer_back, cut_factor=cut_factor), "optimal")
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


def oracle_picks(trace: Trace, runner: Runner, stages: int,
                 others: Sequence[PolicyResult] = ()) -> list[tuple[Layout, float]]:
    """The per-step oracle's choice at every step: (the layout of least simulated step time, that
    time), among the controller's candidates for the step's own costs (`dynmo.controller.candidates`,
    scored by the replay's own simulation of the step) and every layout a policy of `others` ran at
    that step with the replay's microbatches."""
    transfer = runner.link_times(stages)
    picks = []
    for k in range(len(trace.steps)):
        problem = Problem(costs=runner.costs[k].tolist(), stages=stages, transfer=transfer, transfer_back=transfer,
                          cut_factor=runner.cut_factor)
        best, t_best = candidates.best_layout(problem, "optimal", None,
                                              lambda _p, lays: [runner.iteration_s(k, lay) for lay in lays])
        best, t_best = _fastest_of_others(runner, k, best, t_best, others)
        picks.append((best, t_best))
    return picks


def _fastest_of_others(runner: Runner, k: int, best: Layout, t_best: float,
                       others: Sequence[PolicyResult]) -> tuple[Layout, float]:
    """`best` or a layout a policy of `others` ran at step k (with the replay's microbatches),
    whichever step k runs faster on (ties keep `best`)."""
    for r in others:
        if k < len(r.layouts) and r.microbatches[k] == runner.m and r.layouts[k] != list(best.boundaries):
            lay = Layout(tuple(r.layouts[k]))
            t = runner.iteration_s(k, lay)
            if t < t_best:
                best, t_best = lay, t
    return best, t_best


def run_oracle(trace: Trace, runner: Runner, stages: int, res: PolicyResult,
               others: Sequence[PolicyResult] = (), picks: list[tuple[Layout, float]] | None = None) -> None:
    """The oracle bound: at every step the layout of least simulated step time, free to change
    with no migration or decide cost. Its candidates are the controller's for that step's own
    costs (`dynmo.controller.candidates`, scored by the replay's own simulation of the step)
    and every layout another replayed policy (`others`) ran at that step, so no policy that runs
    the same microbatches can beat it. `picks`: `oracle_picks` already made (then `others` are
    compared with them once more, e.g. oracle-window's layouts, chosen after them)."""
    if picks is None:
        picks = oracle_picks(trace, runner, stages, others)
    else:
        picks = [_fastest_of_others(runner, k, lay, t, others) for k, (lay, t) in enumerate(picks)]
    for k, (best, _) in enumerate(picks):
        res.overhead_s.append(0.0)
        runner.step(k, best, res)


def run_oracle_window(trace: Trace, runner: Runner, stages: int, window: int, opts: ReplayOptions,
                      res: PolicyResult, others: Sequence[PolicyResult] = ()) -> None:
    """The bound of a controller that follows lasting changes: one layout per window of `window`
    consecutive steps (0..W-1, W..2W-1, ...; the last may be shorter), chosen in hindsight, and a
    migration charged wherever the layout changes between windows -- the cost model the dynamic
    policies pay (`opts.migration_fixed_s` + bytes of the layers whose worker changes /
    `opts.migration_bandwidth`, the bytes of the window's first step), no decide time. The first
    window's layout is free, as every static layout's is.

    A window's candidates: the controller's (`dynmo.controller.candidates.best_layout`, the
    balancer's min-max layout and its local search) for the window's per-layer median costs and
    for its mean (summed) costs, each scored by the window's total simulated step time; every
    layout a policy of `others` ran in the window with the replay's microbatches (pass the static
    layouts and the per-step oracle's: see `replay`); and the previous window's candidates, so a
    layout can be held across a change that tilts one window. Over those, the sequence of least
    total time, migrations included, is a shortest path through the windows (`_cheapest_path`):
    with free migrations each window simply runs its fastest candidate.

    What holds, by construction: every static layout in `others` is a candidate of every window,
    and holding it costs no migration, so that path's total is the static layout's, and
    oracle-window's total is never above the best static layout's -- with free migrations, and
    with costly ones too (it then holds a layout rather than pay for a move that does not repay
    itself). It is never below the per-step oracle's when that oracle also sees its layouts
    (`replay` does), since the per-step oracle picks each step's fastest layout among them and
    pays nothing to move. Over the whole space of layout sequences it is a heuristic like the
    per-step oracle: the best of the candidates, not of every contiguous layout."""
    n_steps = len(trace.steps)
    transfer = runner.link_times(stages)
    windows = [list(range(a, min(a + window, n_steps))) for a in range(0, n_steps, window)]
    per_window: list[tuple[list[Layout], list[float]]] = []  # candidates, their window totals
    previous: list[Layout] = []
    for steps in windows:
        memo: dict[tuple[int, ...], float] = {}

        def total(lay: Layout, steps=steps, memo=memo) -> float:
            if lay.boundaries not in memo:
                memo[lay.boundaries] = float(sum(runner.iteration_s(k, lay) for k in steps))
            return memo[lay.boundaries]

        cands: list[Layout] = []
        window_costs = runner.costs[steps]
        for costs in (np.median(window_costs, axis=0), np.mean(window_costs, axis=0)):
            problem = Problem(costs=costs.tolist(), stages=stages, transfer=transfer, transfer_back=transfer,
                              cut_factor=runner.cut_factor)
            best, _ = candidates.best_layout(problem, "optimal", None, lambda _p, lays: [total(lay) for lay in lays])
            cands.append(best)
        for r in others:
            for k in steps:
                if k < len(r.layouts) and r.microbatches[k] == runner.m:
                    cands.append(Layout(tuple(r.layouts[k])))
        own = list(dict.fromkeys(cands))
        cands = list(dict.fromkeys([*own, *previous]))
        per_window.append((cands, [total(lay) for lay in cands]))
        previous = own
    if not windows:
        return
    path = _cheapest_path(per_window, [w[0] for w in windows], runner, opts)
    layout = None
    for steps, lay in zip(windows, path):
        for k in steps:
            overhead = 0.0
            if layout is not None and k == steps[0] and lay != layout:
                moved, nbytes = moved_bytes(layout, lay, list(range(lay.num_stages)), runner.layer_bytes(k))
                if moved:
                    overhead = opts.migration_fixed_s + nbytes / opts.migration_bandwidth
                    res.migrations += 1
                    res.layers_moved += moved
                    res.migration_s += overhead
            res.overhead_s.append(overhead)
            runner.step(k, lay, res)
            layout = lay


def _cheapest_path(per_window: list[tuple[list[Layout], list[float]]], firsts: list[int], runner: Runner,
                   opts: ReplayOptions) -> list[Layout]:
    """One candidate per window, of least total time: the windows' totals plus a migration's
    seconds wherever consecutive windows' layouts differ (charged with the bytes of the later
    window's first step, `firsts`). Among equal totals the path with fewer moved layers wins, then
    the earlier candidate."""
    cands, times = per_window[0]
    cost = np.asarray(times, dtype=float)
    moves = np.zeros(len(cands), dtype=np.int64)
    back: list[np.ndarray] = []
    prev = cands
    for (cands, times), k in zip(per_window[1:], firsts[1:]):
        lbytes = np.asarray(runner.layer_bytes(k), dtype=float)
        a = np.asarray([lay.owner() for lay in prev])  # (previous candidates, layers): stage of each layer
        b = np.asarray([lay.owner() for lay in cands])
        changed = a[:, None, :] != b[None, :, :]  # worker j of the new layout is old worker j
        n_moved = changed.sum(axis=2)
        seconds = np.where(n_moved > 0, opts.migration_fixed_s + (changed @ lbytes) / opts.migration_bandwidth, 0.0)
        through = cost[:, None] + seconds  # (previous, new)
        through_moves = moves[:, None] + n_moved
        pick = np.lexsort((through_moves, through), axis=0)[0]  # per new candidate: least time, then fewest moves
        cols = np.arange(len(cands))
        cost = through[pick, cols] + np.asarray(times, dtype=float)
        moves = through_moves[pick, cols]
        back.append(pick)
        prev = cands
    j = int(np.lexsort((moves, cost))[0])
    path = [per_window[-1][0][j]]
    for w in range(len(per_window) - 1, 0, -1):
        j = int(back[w - 1][j])
        path.append(per_window[w - 1][0][j])
    return path[::-1]


def run_dynamic(trace: Trace, runner: Runner, stages: int, balancer: str, do_repack: bool,
                 opts: ReplayOptions, res: PolicyResult) -> None:
    """The trainer's loop, on traced costs: decide before each step, observe after it."""
    h = trace.header
    links = runner.link_times(stages)  # the same each way: the engine's transfers are symmetric
    try:
        flops = trace_flops(trace)
    except SimInputError:  # a trace without its model config: no flops candidate, as a run without one
        flops = None

    def new_loop() -> DynmoLoop:
        lp = DynmoLoop(replace(opts.balance, balancer=balancer, repack=do_repack), microbatches=runner.m,
                       schedule=runner.schedule, stages_per_rank=runner.v, layer_params=h.params,
                       layer_bytes=runner.prior_bytes,
                       transfer=links, transfer_back=links, boundary_bytes=h.boundary_bytes, layer_flops=flops,
                       migration_fixed_s=opts.migration_fixed_s, migration_bandwidth=opts.migration_bandwidth)
        lp.controller.restart_s = opts.restart_s
        lp.controller.fallback = opts.fallback
        return lp

    loop = new_loop()
    layout = static_layout(start_layout_name(opts.initial), trace, stages, runner)
    m = runner.m
    n_steps = len(trace.steps)
    for k, st in enumerate(trace.steps):
        lbytes = runner.layer_bytes(k)  # what this step's migration ships
        t0 = time.perf_counter()
        decision = loop.decide(k, layout, n_steps - k)
        decide_s = time.perf_counter() - t0 if opts.charge_decide else 0.0
        overhead = decide_s
        events = [e for e in st.events if e.get("type") == "dynamism"]  # the traced run's own migrations do not apply
        if decision is not None and decision.layout != layout and decision.layout.num_stages > layout.num_stages:
            # growing back: a checkpoint restart onto every worker, the layers read from it
            new = decision.layout
            res.migrations += 1
            res.restarts += 1
            res.migration_s += opts.restart_s
            overhead += opts.restart_s
            events.append({"type": "grow", "restart_s": opts.restart_s})
            layout = new
            # as the run: a new job, whose controller starts from the checkpoint's forecast
            forecast = loop.controller.forecast()
            loop = new_loop()
            if forecast is not None and opts.balance.cost == "time":
                loop.controller.history.append(forecast)
            m = runner.m
        elif decision is not None and decision.layout != layout:
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
