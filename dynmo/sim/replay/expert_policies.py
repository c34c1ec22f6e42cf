"""The expert-placement policies a replay compares, on `dynmo.sim.replay.experts`' model. Pure.

    from dynmo.sim.replay.expert_policies import replay_experts
    out = replay_experts(trace, stages=16, dp=8, ep=8, options=ExpertOptions(microbatches=64), layouts="dynmo")

Two questions, two modes (`layouts`):

  "fixed"   placement alone: every policy runs one layer layout, the faster under static
            placement of uniform and the optimal contiguous layout of the median per-layer costs;
  "dynmo"   one decision for both: the layer layout is a policy's too, so a placement's gain is
            judged on the layout it runs with and a layout on the placements in force.

Policies (one placement per MoE layer, the same in every EP group):

  static   experts in index order, N / E per rank, never moved; with layouts = "dynmo", on the
           best static layer layout in hindsight: the least total time under static placement
           of uniform, params, the FLOP model's, and the optimal layouts of the median and of
           the mean per-layer costs;
  dynmo    the trainer's own decisions, fed what the trainer would measure (each step's per-layer
           seconds under the placements and layout in force, the mean over the EP groups, and
           the tokens per expert summed over the replicas): placements by
           `dynmo.controller.experts.ExpertBalancer`, which scores a proposal by the simulated
           step time of the layout in force (`DynmoLoop.step_times`, the expert share of a MoE
           unit from `dynmo.flops.expert_share`) and moves experts when the saving is significant
           and repays the move; with layouts = "dynmo", the layer layout by `dynmo.loop.DynmoLoop`
           (`balance.when = "auto"`), starting on the default start (the FLOP model's layout),
           before the placement decision of each step. A layer layout change is charged as the
           layer replay charges it, `mig_fixed` + the moved layers' bytes / `mig_bandwidth`, each
           rank shipping its own experts' share (`_Model.layer_bytes`); an expert move by
           `_Model.move`;
  start    with layouts = "dynmo": dynmo's start placement (static, or with `extra_slots` the
           copies of `start_order`) on the layout dynmo starts from (the FLOP model's), never
           changed: what dynmo must never lose to;
  oracle   per step, each MoE layer's best placement for that step's own loads (summed over the
           replicas), moves free; with layouts = "dynmo", also that step's best layer layout for
           the costs under those placements (the controller's candidates, scored by this
           replay's own step) or any layout and placements static or dynmo ran at that step,
           whichever is fastest: the bound in hindsight. With dp / E > 1 groups it minimises the
           busiest rank of the summed loads, not of the slowest group; its placements are the
           solver's within PLACE_NODES nodes, so proven optimal only where the branch and bound
           ended (else the greedy's answer: near-best, not a bound).

With `extra_slots` (`parallel.expert_slots`) dynmo runs as the runtime does: it starts on
`dynmo.balance.experts.start_order` (the extra slots holding copies of the experts that follow a
rank's own), and its placements may copy hot experts, every slot filled (the copies split an
expert's tokens evenly). With `copies` as well the oracle's placements may copy hot experts, at
most that many copies a layer: what copies could reach. static never copies. With N = E (one expert per rank) and no copies every placement is the same up
to renaming: with the layout held fixed the three policies tie by construction, and with the
layout decided every gain is the layout's.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from dynmo.balance import Problem, balance
from dynmo.balance.experts import Placement, start_order, static_placement
from dynmo.config import BalanceConfig
from dynmo.controller import candidates
from dynmo.controller.experts import ExpertBalancer, order_of, placement_of
from dynmo.engine import SimInputError
from dynmo.flops import expert_share
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.plan import named_layout
from dynmo.record import StepRecord
from dynmo.sim.replay.experts import (
    CAPTURE_MIN_GAIN, POLICIES, ExpertOptions, ExpertPolicyResult, ExpertReplay, _Model, model_config,
)
from dynmo.sim.replay.policies import moved_bytes, trace_flops
from dynmo.sim.trace import Trace

LAYOUTS = ("fixed", "dynmo")
VARIANT_KNOBS = ("every", "window", "min_gain", "horizon", "confidence")


def _static(model: _Model) -> list[Placement]:
    return [static_placement(model.n, model.ep)] * len(model.layers)


def _total(model: _Model, placements: list[Placement], layout: Layout) -> float:
    return sum(model.step_s(k, placements, layout)[0] for k in range(len(model.trace.steps)))


def _median_layouts(model: _Model, stages: int) -> dict[str, Layout]:
    """The optimal layouts of the median and of the mean per-layer costs under static placement."""
    static = _static(model)
    costs = np.asarray([np.add(*model.mean_layer_times(k, static)) for k in range(len(model.trace.steps))])
    out = {}
    for name, c in (("optimal for the median costs", np.median(costs, axis=0)),
                    ("optimal for the mean costs", np.mean(costs, axis=0))):
        out[name] = Layout(tuple(balance(Problem(costs=c.tolist(), stages=stages), "optimal").boundaries))
    return out


def fixed_layout(model: _Model, stages: int) -> tuple[Layout, str]:
    """The faster under static placement of uniform and the optimal layout of the median costs."""
    cands = {"uniform": Layout.uniform(model.trace.num_layers, stages),
             "optimal for the median costs": _median_layouts(model, stages)["optimal for the median costs"]}
    static = _static(model)
    totals = {name: _total(model, static, lay) for name, lay in cands.items()}
    name = min(totals, key=lambda x: totals[x])
    return cands[name], name


def best_static_layout(model: _Model, stages: int) -> tuple[Layout, str]:
    """The static layout of least total time under static placement (module doc)."""
    trace = model.trace
    cands = {"uniform": Layout.uniform(trace.num_layers, stages),
             "params": Layout(tuple(balance(Problem(costs=trace.header.params, stages=stages), "deepspeed").boundaries))}
    try:
        cands["flops"] = named_layout("flops", trace.num_layers, stages, flops=trace_flops(trace))
    except SimInputError:
        pass  # a trace without its model config
    cands |= _median_layouts(model, stages)
    static = _static(model)
    totals = {name: _total(model, static, lay) for name, lay in cands.items()}
    name = min(totals, key=lambda x: totals[x])
    return cands[name], name


def _record(res: ExpertPolicyResult, model: _Model, k: int, placements: list[Placement], layout: Layout,
            overhead: float) -> float:
    t, ratio = model.step_s(k, placements, layout)
    res.iteration_s.append(t)
    res.overhead_s.append(overhead)
    res.busiest_ratio.append(ratio)
    res.layouts.append(list(layout.boundaries))
    res.orders.append(tuple(placements))
    return t


def _start(model: _Model) -> list[Placement]:
    """Where dynmo's placements start: static, or with `extra_slots` the runtime's start, every
    slot full, the extra ones holding copies (`dynmo.balance.experts.start_order`)."""
    if not model.opts.extra_slots:
        return _static(model)
    return [placement_of(start_order(model.n, model.ep, model.opts.extra_slots), model.ep)] * len(model.layers)


def run_static(model: _Model, layout: Layout, res: ExpertPolicyResult, placements: list[Placement] | None = None) -> None:
    static = _static(model) if placements is None else placements
    for k in range(len(model.trace.steps)):
        _record(res, model, k, static, layout, 0.0)


def run_oracle(model: _Model, layout: Layout | None, res: ExpertPolicyResult,
               others: tuple[ExpertPolicyResult, ...] = ()) -> None:
    """Per step the best placements (and, with `layout` None, the best layer layout): module doc."""
    static = _static(model)
    stages = len(others[0].layouts[0]) - 1 if layout is None else layout.num_stages
    for k in range(len(model.trace.steps)):
        placed = [model.place(model.agg[k, j], static[j]) for j in range(len(model.layers))]
        options: list[tuple[list[Placement], Layout]] = []
        for pl in (placed, static):
            if layout is not None:
                options.append((pl, layout))
                continue
            f, bw = model.mean_layer_times(k, pl)
            problem = Problem(costs=(f + bw).tolist(), stages=stages)
            best, _ = candidates.best_layout(problem, "optimal", None,
                                             lambda _p, lays, pl=pl, k=k: [model.step_s(k, pl, lay)[0] for lay in lays])
            options.append((pl, best))
        for r in others:
            if k < len(r.layouts):
                lay = Layout(tuple(r.layouts[k])) if layout is None else layout
                options += [(list(r.orders[k]), lay), (placed, lay)]
        pl, lay = min(options, key=lambda o: model.step_s(k, o[0], o[1])[0])
        _record(res, model, k, pl, lay, 0.0)


def run_dynmo(model: _Model, layout: Layout, decide_layout: bool, res: ExpertPolicyResult) -> None:
    """The trainer's decisions on the replay's steps (module doc): `layout` is where it starts."""
    o = model.opts
    trace = model.trace
    n_layers, steps = trace.num_layers, len(trace.steps)
    names = [f"layer{i}" for i in range(n_layers)]
    cfg = model_config(trace)
    try:
        flops = trace_flops(trace)
    except SimInputError:
        flops = None
    balance_cfg = BalanceConfig(when="auto" if decide_layout else "never", window=o.window, min_gain=o.min_gain,
                                confidence=o.confidence, horizon=o.horizon)
    layer_bytes = model.layer_bytes()  # per rank, under expert parallelism
    loop = DynmoLoop(balance_cfg, microbatches=model.m, schedule=model.schedule, stages_per_rank=model.v,
                     layer_params=trace.header.params, layer_bytes=[int(b) for b in layer_bytes], layer_flops=flops,
                     migration_fixed_s=o.mig_fixed, migration_bandwidth=o.mig_bandwidth)
    share = expert_share(cfg, sublayer=False)  # the expert replay reads whole-block traces
    eb = ExpertBalancer(ranks=model.ep, groups=model.groups, names=names, expert_bytes=model.expert_bytes,
                        every=o.every, window=o.window, min_gain=o.min_gain, confidence=o.confidence,
                        horizon=o.horizon, fixed_s=o.mig_fixed, bandwidth=o.mig_bandwidth,
                        extra_slots=o.extra_slots, expert_share={names[i]: share for i in model.layers})
    orders: dict[str, tuple[int, ...]] = {}
    start = _start(model)

    def placements() -> list[Placement]:
        return [placement_of(orders[names[i]], model.ep) if names[i] in orders else start[j]
                for j, i in enumerate(model.layers)]

    for k in range(steps):
        overhead, events = 0.0, [e for e in trace.steps[k].events if e.get("type") == "dynamism"]
        if decide_layout:
            decision = loop.decide(k, layout, steps - k)
            if decision is not None and decision.layout != layout and decision.layout.num_stages == layout.num_stages:
                moved, nbytes = moved_bytes(layout, decision.layout, list(range(layout.num_stages)), layer_bytes)
                if moved:
                    sec = o.mig_fixed + nbytes / o.mig_bandwidth
                    overhead += sec
                    res.layer_migrations += 1
                    events.append({"type": "migration", "bytes": nbytes, "seconds": sec})
                layout = decision.layout
                loop.applied(model.m)
        new = eb.decide(k, orders, steps - k, step_times=lambda s, lay=layout: loop.step_times(s, lay))
        if new:
            old = placements()
            orders.update(new)
            sec, count, nbytes = model.move(old, placements(), layout)
            overhead += sec
            res.migrations += 1
            res.moved_copies += count
            res.moved_bytes += nbytes
            events.append({"type": "replacement", "placements": {n: list(v) for n, v in new.items()},
                           "bytes": nbytes, "seconds": sec})
        pl = placements()
        t = _record(res, model, k, pl, layout, overhead)
        f, bw = model.mean_layer_times(k, pl)
        tokens = [None] * n_layers
        for j, i in enumerate(model.layers):
            tokens[i] = model.agg[k, j].tolist()
        rec = StepRecord(step=k, layout=list(layout.boundaries), microbatches=model.m,
                         layer_cost_s=(f + bw).tolist(), layer_fwd_s=f.tolist(), layer_bwd_s=bw.tolist(),
                         layer_state_bytes=[int(b) for b in layer_bytes], step_s=t, events=events,
                         stats={"moe_tokens_per_expert": tokens})
        loop.observe(rec)
        eb.observe(rec)


def replay_experts(trace: Trace, stages: int, dp: int, ep: int, options: ExpertOptions | None = None,
                   policies: tuple[str, ...] = POLICIES, variants: dict[str, dict] | None = None,
                   layouts: str = "fixed") -> ExpertReplay:
    """Replay the placement policies on `trace` at `stages` x `dp` with EP degree `ep` (module doc).

    `variants` adds more runs of the dynmo policy under other names, each with some of its decision options
    changed (`every`, `window`, `min_gain`, `horizon`, `confidence`), e.g. {"dynmo every 1": {"every": 1}};
    their `capture` is against the same oracle. SimInputError for a trace without MoE routing stats, an `ep`
    that does not divide the experts or dp, a bad option."""
    opts = options or ExpertOptions()
    opts.check()
    if layouts not in LAYOUTS:
        raise SimInputError(f"layouts must be one of {', '.join(LAYOUTS)}, got {layouts!r}")
    variant_opts = {}
    for name, over in (variants or {}).items():
        bad = set(over) - set(VARIANT_KNOBS)
        if bad or name in POLICIES:
            raise SimInputError(f"variant {name!r}: only {', '.join(VARIANT_KNOBS)} may change, "
                                f"and its name must not be a policy's; got {sorted(over)}")
        vo = ExpertOptions(**{**{f.name: getattr(opts, f.name) for f in fields(ExpertOptions)}, **over})
        vo.check()
        variant_opts[name] = vo
    for p in policies:
        if p not in POLICIES:
            raise SimInputError(f"unknown placement policy {p!r}; choose from {', '.join(POLICIES)}")
    model = _Model(trace, stages, dp, ep, opts)
    joint = layouts == "dynmo"
    layout, layout_name = best_static_layout(model, stages) if joint else fixed_layout(model, stages)
    start = layout
    if joint:
        try:
            start = named_layout("flops", trace.num_layers, stages, flops=trace_flops(trace))
        except SimInputError:
            start = Layout.uniform(trace.num_layers, stages)
    results: dict[str, ExpertPolicyResult] = {"static": ExpertPolicyResult("static")}
    run_static(model, layout, results["static"])
    if joint:  # where dynmo starts, left static: what dynmo must never lose to
        results["start"] = ExpertPolicyResult("start")
        run_static(model, start, results["start"], _start(model))
    dyn_names = [n for n in ("dynmo",) if n in policies] + list(variant_opts)
    for name in dyn_names:
        model.opts = variant_opts.get(name, opts)
        results[name] = ExpertPolicyResult(name)
        run_dynmo(model, start, joint, results[name])
    model.opts = opts
    if "oracle" in policies:
        results["oracle"] = ExpertPolicyResult("oracle")
        run_oracle(model, None if joint else layout, results["oracle"],
                   tuple(results[n] for n in ("static", *(["start"] if joint else []), *dyn_names)))
    ref = results["static"].total_s
    for r in results.values():
        r.speedup = ref / r.total_s if r.total_s > 0 else None
    if "oracle" in results:
        orc = results["oracle"].speedup
        for name in dyn_names:
            dyn = results[name].speedup
            if orc is not None and dyn is not None and orc - 1 >= CAPTURE_MIN_GAIN:
                results[name].capture = (dyn - 1) / (orc - 1)
    if "static" not in policies:
        del results["static"]
    shape = {"stages": stages, "dp": dp, "ep": ep, "groups": model.groups, "microbatches": model.m,
             "experts": model.n, "moe_layers": len(model.layers), "steps": len(trace.steps), "layouts": layouts,
             "extra_slots": opts.extra_slots, "copies": opts.copies, "schedule": model.schedule,
             "a2a_bandwidth": opts.a2a_bandwidth, "expert_bytes": model.expert_bytes, "seed": opts.seed}
    return ExpertReplay(results, list(layout.boundaries), layout_name, model.split, shape)
