"""Merge every active rank's view of one step into the `StepRecord` all ranks see.

Each rank knows only its own stages and layers; one `all_gather_object` over the active ranks
gives every rank all of them, so every rank builds the same record (and the DynMo loop on
every rank observes the same costs). Data-parallel replicas hold the same layers: their
per-layer and per-stage figures are averaged, their losses summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dynmo.layout import imbalance
from dynmo.record import StepRecord
from dynmo.runtime.pipeline import Pipeline, StepResult


@dataclass
class _RankFigures:
    result: StepResult
    layer_params: dict[int, int]
    migration_bytes: int
    migration_s: float
    stats: dict[str, dict[int, Any]]


def merge_layer_stats(parts: list[dict[str, dict[int, Any]]], num_layers: int) -> dict[str, list]:
    """Merge every rank's case `layer_stats()` into one list per metric, replicas averaged."""
    sums: dict[str, dict[int, Any]] = {}
    counts: dict[str, dict[int, int]] = {}
    for part in parts:
        for key, per_layer in part.items():
            for i, v in per_layer.items():
                s = sums.setdefault(key, {})
                if i in s:
                    s[i] = [a + b for a, b in zip(s[i], v)] if isinstance(v, list) else s[i] + v
                else:
                    s[i] = list(v) if isinstance(v, list) else v
                counts.setdefault(key, {})[i] = counts.get(key, {}).get(i, 0) + 1
    out: dict[str, list] = {}
    for key, s in sums.items():
        row: list = [None] * num_layers
        for i, v in s.items():
            n = counts[key][i]
            row[i] = [a / n for a in v] if isinstance(v, list) else v / n
        out[key] = row
    return out


def gather_record(pipe: Pipeline, step: int, res: StepResult, events: list[dict],
                  stats: dict[str, dict[int, Any]], tokens: int, layer_letters: list[str]) -> StepRecord:
    """The step's record on every active rank. Collective over the active ranks.

    `events` are this rank's; their migration bytes and seconds become the totals over all ranks
    (bytes summed, seconds of the slowest rank). `tokens` is the global batch in tokens.
    """
    ctx = pipe.ctx
    mig = [e for e in events if e["type"] == "migration"]
    mine = _RankFigures(
        res,
        {i: sum(p.numel() for p in layer.parameters()) for i, layer in pipe.layers.items()},
        sum(e.get("bytes", 0) for e in mig),
        sum(e.get("seconds", 0.0) for e in mig),
        stats,
    )
    parts: list[_RankFigures] = [None] * ctx.active_world  # type: ignore[list-item]
    dist.all_gather_object(parts, mine, group=ctx.active_group)  # replica-major: rank r*pp + w

    S, n, dp, pp = pipe.num_stages, len(pipe.specs), ctx.dp, ctx.pp
    per_mb = dp * pipe.microbatches  # each layer runs once per microbatch per replica
    stage_compute = [0.0] * S
    fwd, bwd, cost, act, state, params = ([0.0] * n for _ in range(6))
    for part in parts:
        r = part.result
        for s, c in r.stage_compute_s.items():
            stage_compute[s] += c / dp
        for i, (f, b) in r.layer_times.items():
            fwd[i] += f / per_mb
            bwd[i] += b / per_mb
        for src, dst in ((r.layer_costs, cost), (r.layer_act_bytes, act), (r.layer_state_bytes, state),
                         (part.layer_params, params)):
            for i, v in src.items():
                dst[i] += v / dp
    iteration = max(p.result.schedule_s for p in parts)
    step_s = max(p.result.step_s for p in parts)
    # per pipeline worker, averaged over replicas
    worker_compute = [sum(sum(parts[r * pp + w].result.stage_compute_s.values()) for r in range(dp)) / dp
                      for w in range(pp)]
    worker_idle = [max(0.0, iteration - c) for c in worker_compute]
    loss = sum(p.result.loss_sum for p in parts) / max(1, sum(p.result.loss_count for p in parts))
    for e in mig:
        e["bytes"] = int(sum(p.migration_bytes for p in parts))
        e["seconds"] = max(p.migration_s for p in parts)
        if "predicted_bottleneck_s" in e:  # the slowest stage per microbatch, as measured on this step
            e["measured_bottleneck_s"] = max(stage_compute) / pipe.microbatches
    lay = pipe.layout
    rec = StepRecord(
        step=step,
        loss=loss,
        tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
        step_s=step_s,
        iteration_s=iteration,
        layout=list(lay.boundaries),
        layout_str=lay.format(layer_letters),
        stage_compute_s=stage_compute,
        stage_idle_s=[max(0.0, iteration - c) for c in stage_compute],
        worker_compute_s=worker_compute,
        worker_idle_s=worker_idle,
        bubble_ratio=sum(worker_idle) / (pp * iteration) if iteration > 0 else 0.0,
        workers=ctx.active_world,
        microbatches=pipe.microbatches,
        imbalance=imbalance(stage_compute),
        layer_fwd_s=fwd,
        layer_bwd_s=bwd,
        layer_cost_s=cost,
        layer_act_bytes=act,
        layer_state_bytes=state,
        layer_params=[int(round(p)) for p in params],
        stage_memory_bytes=[
            sum(state[i] for i in lay.layers(j)) + pipe.in_flight(j) * sum(act[i] for i in lay.layers(j))
            for j in range(S)
        ],
        profile_s=max(p.result.profile_s for p in parts),
        grad_norm=res.grad_norm,
        lr=pipe.optimizer.param_groups[0]["lr"],
        events=events,
        stats=merge_layer_stats([p.stats for p in parts], n) if any(p.stats for p in parts) else {},
    )
    if all(p.result.peak_bytes for p in parts):  # measured on every rank (0 = the platform cannot say)
        rec.worker_peak_memory_bytes = [float(max(parts[r * pp + w].result.peak_bytes for r in range(dp)))
                                        for w in range(pp)]
    return rec
