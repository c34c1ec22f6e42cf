"""The output of a trace replay (`dynmo simulate --trace`): the replay's shape, what it leaves out
(said in the output), and the table per policy, or with --json every figure. Pure.
"""

from __future__ import annotations

import argparse

from dynmo.jsonio import write_json


def write_report(args: argparse.Namespace, info: dict, shape: dict, opts, results, notes: list[str],
                 plots: list[str]) -> None:
    """Print the replay's results: JSON with --json, else the header lines, the table and the notes."""
    from dynmo.sim.replay import summary_table

    if args.json:
        doc = {"trace": info, "replay": shape, "not_modelled": notes, "plots": plots,
               "policies": [r.as_dict() for r in results]}
        write_json(doc, indent=args.indent or None)
        return
    print(f"trace: {args.trace} ({info['source']}), case {info['case']}, {info['layers']} layers, "
          f"{info['steps']} steps, dynamism at steps {info['dynamism_steps'] or 'none'}")
    print(f"replay: {shape['schedule']}, {shape['stages']} stages on {shape['ranks']} ranks x {shape['dp']} dp "
          f"= {shape['workers']} workers, {shape['microbatches']} microbatches, controller when={opts.balance.when}"
          + {"optimizer": f", optimizer state sharded over the {shape['dp']} replicas",
             "full": f", weights, gradients and optimizer state sharded over the {shape['dp']} replicas (FSDP2)"}
          .get(opts.shard, ""))
    print(summary_table(results))
    print("speedup: total time of static uniform / this policy's (migrations and decide time included); "
          "/worker: the same per worker-second; bottleneck: mean slowest stage per microbatch")
    for n in notes:
        print(f"not modelled: {n}")
    for p in plots:
        print(f"wrote {p}")


def replay_shape(trace, results, args: argparse.Namespace, opts) -> dict:
    """What was replayed: schedule, stages, ranks, dp, workers, microbatches, sharding."""
    from dynmo.engine import canonical_name

    h = trace.header
    first = results[0]
    stages = len(first.layouts[0]) - 1
    dp = args.dp or h.dp
    return {"schedule": canonical_name(opts.schedule or h.schedule), "stages": stages,
            "ranks": first.workers[0] // dp, "dp": dp, "workers": first.workers[0],
            "microbatches": opts.microbatches or h.microbatches, "stages_per_rank": stages // (first.workers[0] // dp),
            "shard": opts.shard}


def not_modelled(trace, opts, shape: dict) -> list[str]:
    """What this replay leaves out, said in the output."""
    out = []
    sharded = opts.shard == "optimizer" and shape["dp"] > 1
    full = opts.shard == "full" and shape["dp"] > 1
    if shape["dp"] > 1 and not opts.allreduce_bandwidth:
        if full:
            out.append("FSDP collectives: each unit's parameter all-gathers before its forward and its backward and "
                       "its gradient reduce-scatter, per microbatch (give --allreduce-bandwidth bytes/s)")
        else:
            out.append("data-parallel gradient all-reduce" + (" and the sharded optimizer's parameter all-gather"
                       if sharded else "") + " (give --allreduce-bandwidth bytes/s)")
    if sharded:
        out.append("sharding beyond the optimizer state (weights and gradients stay whole on every replica), "
                   "reduce-scatter (the gradients are all-reduced, as the runtime does) and per-worker memory "
                   "(the saving shows in migration bytes only)")
        if "prune" in trace.header.case:
            out.append("pruning with a sharded optimizer: the runtime does not run it yet (a what-if)")
    if full:
        out.append(_full_missing(trace, opts))
        refused = _full_refused(trace)
        if refused:
            out.append(f"{' and '.join(refused)} with parallel.shard = \"full\": the runtime does not run it yet "
                       "(a what-if)")
    if "freeze" in trace.header.case and _measured_bytes_rescaled(trace, opts, shape["dp"]):
        out.append("frozen layers' missing AdamW state: the traced run's measured state bytes are rescaled to "
                   "this replay's sharding as if every layer held weights, gradients and both moments")
    if opts.comm == 0 and not opts.link_delay:
        out.append("stage-to-stage transfer time (give --comm seconds)")
    if opts.op_overhead == 0:
        out.append("per-op runtime overhead outside the measured compute (give --op-overhead seconds)")
    if "ZeroBubble" in shape["schedule"] and any(s.wgrad is None for s in trace.steps):
        out.append("measured weight-gradient split: the zero-bubble schedules take wgrad = bwd / 2")
    if not opts.balance.retune_microbatches:
        out.append("micro-batch re-tuning after re-packing (give --retune-microbatches)")
    if shape["stages_per_rank"] > 1:
        out.append("re-packing: the runtime re-packs only with one stage per rank, so +repack policies are left out")
    out.append("per-layer cost changes caused by the placement itself (costs are replayed as traced)")
    return out


def _full_missing(trace, opts) -> str:
    """What the replay leaves out of parallel.shard = "full"."""
    from dynmo.sim.replay.runner import traced_shard

    s = "per-worker memory, the units being gathered included (the saving shows in migration bytes only)"
    if opts.allreduce_bandwidth:
        s = ("overlap of the FSDP collectives with compute (each runs inside its forward or backward op; FSDP2's "
             "prefetch is not modelled), " + s)
        if traced_shard(trace) == "full":
            s += (f"; the traced run sharded fully at dp {trace.header.dp}: its measured layer times hold its own "
                  "collectives, and the modelled ones come on top")
    return s


def _full_refused(trace) -> list[str]:
    """The traced run's features the runtime refuses with parallel.shard = "full"."""
    case = trace.header.case
    model = trace.header.config.get("model")
    tied = isinstance(model, dict) and model.get("tie_embeddings") is True
    return [what for what, on in (("pruning", "prune" in case), ("freezing", "freeze" in case),
                                  ("early exit", "early-exit" in case), ("tied embeddings", tied)) if on]


def _measured_bytes_rescaled(trace, opts, dp: int) -> bool:
    """Whether the replay scales the trace's measured state bytes (its sharding differs from the traced run's)."""
    from dynmo.loop import bytes_per_param
    from dynmo.sim.replay.runner import traced_shard

    h = trace.header
    return any(s.state_bytes is not None for s in trace.steps) and \
        bytes_per_param(opts.shard, dp) != bytes_per_param(traced_shard(trace), h.dp)
