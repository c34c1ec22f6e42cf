"""`replay`: every asked-for policy on one trace, with speedups over uniform and over the best static layout."""

from __future__ import annotations

from typing import Sequence

from dynmo.balance import BalanceError
from dynmo.engine import SimInputError
from dynmo.sim.replay.options import ORACLES, PRIOR, STATIC, ReplayOptions, default_policies, parse_policy
from dynmo.sim.replay.policies import oracle_picks, run_dynamic, run_oracle, run_oracle_window, run_static, static_layout
from dynmo.sim.replay.result import PolicyResult, capture
from dynmo.sim.replay.runner import Runner
from dynmo.sim.trace import Trace


def replay(trace: Trace, stages: int | None = None, dp: int | None = None,
           policies: Sequence[str] | None = None, options: ReplayOptions | None = None) -> list[PolicyResult]:
    """Replay `trace` on `stages` pipeline stages x `dp` replicas under each policy.

    `stages` and `dp` default to the traced run's; `policies` to `default_policies`. `speedup` is relative to static
    uniform, `speedup_vs_best_static` to the fastest of the static policies (uniform, params, profile-once; each
    replayed for the comparison even when not asked for, and then not returned); the `_second_half` ones the same
    over the last half of the steps (against the static layout fastest there). Each dynamic policy's
    `capture_oracle` / `capture_oracle_window` is the share of that bound's gain over the best static layout it
    captures (`dynmo.sim.replay.result.capture`), when that bound was asked for.
    """
    opts = options or ReplayOptions()
    opts.check()
    h = trace.header
    stages = int(stages or h.pp * h.virtual_stages)
    dp = int(dp or h.dp)
    if dp < 1:
        raise SimInputError(f"dp must be >= 1, got {dp}")
    if stages > trace.num_layers:
        raise SimInputError(f"cannot split {trace.num_layers} layers into {stages} stages; "
                            "scale the trace to more blocks (--scale-blocks) or use fewer stages")
    if policies is None:
        policies = default_policies(trace, opts)
    parsed = [(p, *parse_policy(p)) for p in policies]
    runner = Runner(trace, dp, opts, stages)
    if runner.v > 1 and any(rp for _, _, rp in parsed):
        raise SimInputError(f"re-packing needs one stage per rank (GPipe or 1F1B), as in the runtime; "
                            f"{runner.schedule} runs {runner.v}: drop the +repack policies")
    runner.plan(stages)  # fail early on a bad shape
    tokens = None
    if h.tokens_per_microbatch:
        tokens = float(h.tokens_per_microbatch) * runner.m * dp
    out: dict[str, PolicyResult] = {}
    for name, base, rp in parsed:
        if name in out or base in ORACLES:
            continue
        res = PolicyResult(name, tokens_per_step=tokens)
        if base in STATIC or base in PRIOR:
            run_static(trace, runner, static_layout(base, trace, stages, runner), res)
        else:
            run_dynamic(trace, runner, stages, base, rp, opts, res)
        out[name] = res
    # the static references, replayed for the comparison when not asked for
    statics: dict[str, PolicyResult] = {}
    for name in STATIC:
        if name in out:
            statics[name] = out[name]
            continue
        ref = PolicyResult(name, tokens_per_step=tokens)
        try:
            layout = static_layout(name, trace, stages, runner)
        except BalanceError:
            if name == "params":  # DeepSpeed's partition is refused beyond its size limit: not a reference then
                continue
            raise
        run_static(trace, runner, layout, ref)
        statics[name] = ref
    asked = {base for _, base, _ in parsed}
    # the bounds last: their candidates include every other policy's layouts. The per-step oracle
    # chooses first, oracle-window sees its choices too, and the per-step oracle then also takes
    # oracle-window's layout wherever that runs a step faster: it is never slower at any step.
    others = [*out.values(), *statics.values()]
    picks = oracle_picks(trace, runner, stages, others) if "oracle" in asked else None
    if "oracle-window" in asked:
        seen = others
        if picks is not None:
            seen = [*others, PolicyResult("oracle", layouts=[list(lay.boundaries) for lay, _ in picks],
                                          microbatches=[runner.m] * len(picks))]
        out["oracle-window"] = PolicyResult("oracle-window", tokens_per_step=tokens)
        run_oracle_window(trace, runner, stages, opts.window_steps, opts, out["oracle-window"], seen)
    if picks is not None:
        out["oracle"] = PolicyResult("oracle", tokens_per_step=tokens)
        run_oracle(trace, runner, stages, out["oracle"], [out[p] for p in ("oracle-window",) if p in out], picks)
    ref = statics["uniform"]
    best = min(statics.values(), key=lambda r: r.total_s)  # ties: the first in STATIC order
    best_half = min(statics.values(), key=lambda r: r.second_half_s)
    for r in out.values():
        r.speedup = ref.total_s / r.total_s if r.total_s > 0 else None
        r.speedup_per_worker = ref.worker_s / r.worker_s if r.worker_s > 0 else None
        r.speedup_vs_best_static = best.total_s / r.total_s if r.total_s > 0 else None
        r.best_static = best.policy
        half = r.second_half_s
        r.speedup_second_half = ref.second_half_s / half if half > 0 else None
        r.speedup_vs_best_static_second_half = best_half.second_half_s / half if half > 0 else None
        r.best_static_second_half = best_half.policy
    for name, _, _ in parsed:
        r = out[name]
        if name in STATIC or name in PRIOR or name in ORACLES:
            continue
        for bound, attr in (("oracle", "capture_oracle"), ("oracle-window", "capture_oracle_window")):
            if bound in out:
                setattr(r, attr, capture(r.speedup_vs_best_static, out[bound].speedup_vs_best_static))
    return _ordered(out, [p for p, _, _ in parsed])


def _ordered(out: dict[str, PolicyResult], names: list[str]) -> list[PolicyResult]:
    seen, res = set(), []
    for n in names:
        if n not in seen:
            seen.add(n)
            res.append(out[n])
    return res
