"""What the `Trainer` (`dynmo.trainer`) writes about a run on rank 0: the config it ran with, the
start-up line, `metrics.jsonl` (`MetricsLog`), the trace, and `summary.json`'s object."""

from __future__ import annotations

from pathlib import Path

from dynmo.config import Config, to_toml
from dynmo.record import StepRecord
from dynmo.runtime import dist as rdist
from dynmo.runtime.metrics import MetricsLog
from dynmo.runtime.pipeline import Pipeline


def open_outputs(cfg: Config, ctx: rdist.DistContext, out: Path, start_step: int, pipe: Pipeline, letters: list[str],
                 params: list[int], boundary_bytes: list[int]) -> tuple[MetricsLog | None, object]:
    """The metrics log and the trace writer (None when `log.trace` is unset) of rank 0; None
    and None on the other ranks."""
    if not ctx.is_logger:
        return None, None
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(to_toml(cfg))
    log = MetricsLog(out, cfg.train.steps, start_step, cfg.log.tensorboard, cfg.log.progress, cfg.log.every)
    print(f"dynmo: {ctx.world} ranks (pp={ctx.pp} x dp={ctx.dp}, {ctx.backend}), schedule {cfg.parallel.schedule}, "
          f"{len(pipe.specs)} layers, layout {pipe.layout.format(letters)}", flush=True)
    trace = None
    if cfg.log.trace:
        from dynmo.sim.trace import TraceHeader, TraceWriter

        trace = TraceWriter(cfg.log.trace, TraceHeader.from_config(cfg.to_dict(), params, ctx.pp, ctx.dp,
                                                                   boundary_bytes=boundary_bytes))
    return log, trace


def summary(cfg: Config, start_step: int, pipe: Pipeline, started: rdist.DistContext, ctx: rdist.DistContext,
            records: list[StepRecord], wall_s: float) -> dict:
    """`summary.json`: the run's outcome in one object. `started` is the context the run began
    with (world and replicas); `ctx` is the one after any re-pack (pipeline ranks, workers)."""
    speeds = [r.tokens_per_s for r in records]
    return {
        "steps": cfg.train.steps,
        "start_step": start_step,
        "final_loss": records[-1].loss if records else None,
        "wall_s": wall_s,
        # the first step pays one-off set-up costs; leave it out of the mean when we can
        "mean_tokens_per_s": (sum(speeds[1:]) / len(speeds[1:]) if len(speeds) > 1 else (speeds or [None])[0]),
        "final_layout": list(pipe.layout.boundaries),
        "world": started.world,
        "workers": ctx.active_world,
        "pp": ctx.pp,
        "dp": started.dp,
        "microbatches": pipe.microbatches,
        "schedule": cfg.parallel.schedule,
    }
