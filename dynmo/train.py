"""Training entry point run on every rank: `torchrun --nproc-per-node N -m dynmo.train ...`.

`dynmo train --nproc N ...` validates the config, prepares the data once and launches this.
One step, on every rank: forced re-layouts, the DynMo loop's decision (rank 0 decides, every
rank migrates), the dynamic-model cases, the training step, one merged `StepRecord` that the
loop observes and the metrics and the trace write.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dynmo import checks, plan, rundir
from dynmo.config import Config, ConfigError, load_config, to_toml
from dynmo.data import TokenData, prepare
from dynmo.dynamics.case import Case
from dynmo.dynamics.registry import CASES
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.model.layers import layer_param_counts, layer_specs
from dynmo.record import StepRecord
from dynmo.runtime import checkpoint, faults, probe
from dynmo.runtime import dist as rdist
from dynmo.runtime.host import PipelineHost
from dynmo.runtime.metrics import MetricsLog
from dynmo.runtime.pipeline import Pipeline
from dynmo.runtime.record import gather_record
from dynmo.runtime.watch import Heartbeat


class Diverged(RuntimeError):
    """The loss or the gradient norm is not finite."""


class Trainer:
    def __init__(self, cfg: Config, ctx: rdist.DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.out = Path(cfg.out)
        folder = prepare(cfg.data.paths, cfg.model.vocab_size, cfg.data.cache_dir, cfg.model.hf_path) if ctx.rank == 0 else None
        obj = [str(folder) if folder else None]
        dist.broadcast_object_list(obj, src=0)
        self.data = TokenData.load(Path(obj[0]), cfg.model.seq_len, cfg.data.val_fraction, cfg.train.seed)
        num_stages = ctx.pp * cfg.parallel.virtual_stages
        self.params = layer_param_counts(cfg.model)
        saved = checkpoint.read_meta(Path(cfg.checkpoint.resume)) if cfg.checkpoint.resume else {}
        self.saved_costs = saved.get("layer_costs")
        self.pipe = Pipeline(cfg, ctx, self._first_layout(saved, num_stages))
        self.letters = [s.letter for s in self.pipe.specs]
        if self.pipe.hf_read:
            names = ", ".join(self.pipe.specs[i].name for i in sorted(self.pipe.layers))
            print(f"dynmo: rank {ctx.rank} read {self.pipe.hf_read[0]} tensors ({self.pipe.hf_read[1] / 1e6:.2f} MB) "
                  f"of {cfg.model.hf_path} for its layers {names}", flush=True)
        self.start_step = 0
        # dynamic-model cases: same list, same order on every rank; built before a checkpoint
        # loads, so the layers they add or freeze match what was saved
        self.cases: list[Case] = [cls(PipelineHost(self.pipe)) for cls in CASES if cls.enabled(cfg)]
        self.pipe.layer_extras = self.cases  # their per-layer state travels with migrating layers
        if cfg.checkpoint.resume:
            path = Path(cfg.checkpoint.resume)
            for c in self.cases:
                c.load_state(saved.get("cases", {}).get(c.name, {}))
            self.start_step = checkpoint.load(self.pipe, path)
            for c in self.cases:
                c.after_load(self.start_step)
        self.relayouts = plan.parse_relayouts(cfg, num_stages)
        speeds = transfer = transfer_back = None
        # Worker speeds and link times need one stage per rank: with virtual stages several
        # stages share a worker and a link, which the balancers' load model does not describe.
        if cfg.balance.when != "never" and cfg.parallel.virtual_stages == 1:
            m = cfg.model
            speeds, transfer, transfer_back = probe.measure_workers(cfg.balance, ctx, self.pipe.microbatch, m.seq_len, m.d_model,
                                                     self.pipe.dtype.itemsize)
            if ctx.is_logger:
                links = ", ".join(f"{f * 1e3:.2f}/{b * 1e3:.2f}" for f, b in zip(transfer or [], transfer_back or []))
                print(f"dynmo: worker speeds {', '.join(f'{x:.2f}' for x in speeds)}; link ms/microbatch "
                      f"forward/backward [{links}]", flush=True)
        self.loop = DynmoLoop(cfg.balance, microbatches=self.pipe.microbatches, schedule=cfg.parallel.schedule,
                              layer_params=self.params, speeds=speeds, transfer=transfer,
                              transfer_back=transfer_back)
        if self.saved_costs and cfg.balance.cost == "time":
            self.loop.controller.history.append(list(self.saved_costs))  # the starting forecast

    def _first_layout(self, saved: dict, num_stages: int) -> Layout:
        """`parallel.layout`, except when resuming on a different number of stages than the
        checkpoint was saved with (an elastic restart on fewer workers) and the layout is not
        explicit: then the balancer lays the layers out on the costs measured before the save."""
        cfg = self.cfg
        costs, old = saved.get("layer_costs"), saved.get("layout")
        explicit = cfg.parallel.layout.strip().lower() not in ("uniform", "params")
        if not costs or not old or len(old) - 1 == num_stages or explicit or cfg.parallel.virtual_stages != 1:
            return plan.initial_layout(cfg, num_stages, self.params)
        from dynmo.balance import Problem, balance

        layout = Layout(tuple(balance(Problem(costs=costs, stages=num_stages), cfg.balance.balancer).boundaries))
        if self.ctx.is_logger:
            print(f"dynmo: resuming on {num_stages} stages (saved on {len(old) - 1}): layout "
                  f"{layout.format([s.letter for s in layer_specs(cfg.model)])} chosen by the {cfg.balance.balancer} balancer "
                  "from the layer costs measured before the checkpoint", flush=True)
        return layout

    # ---- before a step -------------------------------------------------------------------
    def _before_step(self, step: int) -> list[dict]:
        """Re-layouts first: a layer rebuilt by a migration must get this step's model changes too."""
        events: list[dict] = []
        if step in self.relayouts:
            events.append(self._migrate(self.relayouts[step]) | {"reason": "forced"})
        if not self.pipe.released:
            events += self._rebalance(step)
        if not self.pipe.released:
            events += [e | {"case": c.name} if "case" not in e else e for c in self.cases for e in c.before_step(step)]
        return events

    def _migrate(self, layout: Layout) -> dict:
        """Apply a layout on every active rank (a re-pack if it has fewer stages)."""
        pipe = self.pipe
        old_stages, m = pipe.num_stages, pipe.microbatches
        local = self.cfg.train.global_batch // self.ctx.dp
        event = pipe.relayout(layout, self.loop.retuned_microbatches(local, m, old_stages, layout.num_stages)).as_event()
        if layout.num_stages < old_stages:
            event |= {"repacked": True, "stages": [old_stages, layout.num_stages], "microbatches": [m, pipe.microbatches]}
            if pipe.released:
                print(f"dynmo: rank {self.ctx.rank} released (re-packed onto {layout.num_stages} stages); exiting", flush=True)
            else:
                self.ctx = pipe.ctx
        return event

    def _rebalance(self, step: int) -> list[dict]:
        """The DynMo loop's decision: rank 0 decides from the forecast cost, every rank migrates."""
        if self.cfg.balance.when == "never":
            return []
        t0 = time.perf_counter()
        decision = self.loop.decide(step, self.pipe.layout, self.cfg.train.steps - step) if self.ctx.is_logger else None
        obj = [decision]
        dist.broadcast_object_list(obj, src=0, group=self.ctx.active_group)
        decide_s = time.perf_counter() - t0
        decision = obj[0]
        if decision is None:
            return []
        event = self._migrate(decision.layout) | self.loop.event(decision, decide_s)
        self.loop.applied(self.pipe.microbatches)
        return [event]

    # ---- batches -------------------------------------------------------------------------
    def _local_batch(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        g = self.cfg.train.global_batch
        batch = torch.from_numpy(self.data.batch(step, g, split))
        per = g // self.ctx.dp
        mine = batch[self.ctx.dp_rank * per : (self.ctx.dp_rank + 1) * per]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        log = trace = None
        if ctx.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.toml").write_text(to_toml(cfg))
            log = MetricsLog(self.out, cfg.train.steps, self.start_step, cfg.log.tensorboard, cfg.log.progress, cfg.log.every)
            print(
                f"dynmo: {ctx.world} ranks (pp={ctx.pp} x dp={ctx.dp}, {ctx.backend}), schedule {cfg.parallel.schedule}, "
                f"{len(self.pipe.specs)} layers, layout {self.pipe.layout.format(self.letters)}",
                flush=True,
            )
            if cfg.log.trace:
                from dynmo.sim.trace import TraceHeader, TraceWriter

                trace = TraceWriter(cfg.log.trace, TraceHeader.from_config(cfg.to_dict(), self.params, ctx.pp, ctx.dp))
        tokens = cfg.train.global_batch * cfg.model.seq_len
        t_start = time.perf_counter()
        records: list[StepRecord] = []
        for step in range(self.start_step, cfg.train.steps):
            faults.at_step(step)
            faults.point("step")
            events = self._before_step(step)
            if self.pipe.released:
                return {"released": True, "rank": ctx.rank, "step": step}
            res = self.pipe.train_step(step, *self._local_batch(step))
            for c in self.cases:
                events += [e | {"case": c.name} if "case" not in e else e for e in c.after_step(step, res)]
            stats: dict = {}
            for c in self.cases:
                stats.update(c.layer_stats())
            rec = gather_record(self.pipe, step, res, events, stats, tokens, self.letters)
            if not (math.isfinite(rec.loss) and math.isfinite(rec.grad_norm)):
                # every rank sees the merged record, so all stop here together; nothing is saved
                raise Diverged(f"the loss is {rec.loss} (gradient norm {rec.grad_norm}) at step {step}; "
                               f"training stopped before saving anything from it. {self._last_checkpoint()} "
                               "Lower train.lr, raise train.warmup_steps or set train.grad_clip, then resume.")
            self.loop.observe(rec)
            if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
                rec.val_loss = self.validate()
            records.append(rec)
            if log:
                log.log(rec)
            if trace:
                trace.write_step(rec)
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                self._save(self.out / f"checkpoint-{step + 1}", step + 1)
        if trace:
            trace.close()
        if cfg.checkpoint.final:
            self._save(self.out / "checkpoint-final", cfg.train.steps)
        speeds = [r.tokens_per_s for r in records]
        summary = {
            "steps": cfg.train.steps,
            "start_step": self.start_step,
            "final_loss": records[-1].loss if records else None,
            "wall_s": time.perf_counter() - t_start,
            # the first step pays one-off set-up costs; leave it out of the mean when we can
            "mean_tokens_per_s": (sum(speeds[1:]) / len(speeds[1:]) if len(speeds) > 1 else (speeds or [None])[0]),
            "final_layout": list(self.pipe.layout.boundaries),
            "world": ctx.world,
            "workers": self.ctx.active_world,
            "pp": self.ctx.pp,
            "dp": ctx.dp,
            "microbatches": self.pipe.microbatches,
            "schedule": cfg.parallel.schedule,
        }
        if log:
            log.close(summary)
        return summary

    def _save(self, path: Path, step: int) -> None:
        checkpoint.save(self.pipe, path, step, self.cfg, {c.name: c.state() for c in self.cases}, self.cfg.checkpoint.keep,
                        costs=self.loop.controller.forecast())

    def _last_checkpoint(self) -> str:
        latest = rundir.latest_checkpoint(self.out)
        return f"The last complete checkpoint is {latest}." if latest else "No checkpoint was saved yet."

    def validate(self) -> float:
        total, n = 0.0, 0
        for b in range(self.cfg.train.eval_batches):
            x, y = self._local_batch(b, "val")
            v = self.pipe.eval_loss(x, y)
            if v is not None:
                total, n = total + v, n + 1
        t = torch.tensor([total, float(n)])
        dist.all_reduce(t, group=self.ctx.active_group)
        return float(t[0] / t[1])


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when its parent (torchrun's agent) dies, however it
    dies, so a killed launcher never leaves workers training on their own."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the line above
        os._exit(1)


def _restart_resume(cfg: Config) -> int:
    """After torchrun restarted the job (`dynmo train --max-restarts N`), resume from the
    newest complete checkpoint in the run folder, if any. Returns the restart count."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart:
        latest = rundir.latest_checkpoint(Path(cfg.out))
        if latest is not None:
            cfg.checkpoint.resume = str(latest)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"dynmo: restart {restart}: resuming from {latest}", flush=True)
    return restart


def _folder_verdict(cfg: Config, ctx: rdist.DistContext, restart: int) -> str:
    """Rank 0 checks the run folder (a new run never writes over an old one) and tells all."""
    verdict = [""]
    if ctx.rank == 0 and not restart:
        try:
            rundir.check_run_folder(cfg.out, cfg.checkpoint.resume, cfg.overwrite)
            if cfg.overwrite:
                rundir.clear_run(cfg.out)
        except ConfigError as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def _is_peer_failure(e: BaseException) -> bool:
    """A collective or point-to-point operation failed because a peer died or stopped answering
    (also inside a checkpoint save, which DCP reports as its own exception)."""
    return isinstance(e, dist.DistError) or any(s in str(e) for s in checkpoint.PEER_FAILURES)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="dynmo.train", add_help=True)
    ap.add_argument("--config", default=None)
    known, overrides = ap.parse_known_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _die_with_parent()
    try:
        cfg = load_config(known.config, overrides)
        restart = _restart_resume(cfg)
        cfg.checkpoint.resume = rundir.resolve_resume(cfg.checkpoint.resume, cfg.out)
        checks.validate(cfg, world)
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dynmo: error: {e}", file=sys.stderr)
        return 2
    cfg.parallel.pp = plan.resolve_pp(cfg, world)
    ctx = rdist.init(cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.backend, cfg.parallel.timeout_s)
    heartbeat = None
    try:
        problem = _folder_verdict(cfg, ctx, restart)
        if problem:
            if ctx.rank == 0:
                print(f"dynmo: error: {problem}", file=sys.stderr)
            return 2
        heartbeat = Heartbeat(ctx.rank, ctx.world)
        trainer = Trainer(cfg, ctx)
        summary = trainer.run()
        if summary.get("released"):
            return 0  # nothing left to do here; the others train on (no collective with them)
        # Meet before tearing down: a rank that destroys its gloo groups while a peer still has
        # traffic in flight can abort ("terminate called without an active exception").
        dist.barrier(group=trainer.ctx.active_group)
    except (Diverged, checkpoint.CheckpointWriteError) as e:
        print(f"dynmo: error: rank {ctx.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        if not _is_peer_failure(e):
            raise
        silent = heartbeat.diagnose() if heartbeat else ""
        who = f"{silent} stopped responding" if silent else f"a peer failed ({str(e).splitlines()[0][:200]})"
        latest = rundir.latest_checkpoint(Path(cfg.out))
        print(f"dynmo: error: rank {ctx.rank} at step {faults.current_step()}: {who}; the job stops "
              f"(parallel.timeout_s = {cfg.parallel.timeout_s:g}). "
              + (f"The last complete checkpoint is {latest}." if latest else "No checkpoint was saved."),
              file=sys.stderr, flush=True)
        return 1
    finally:
        if heartbeat:
            heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
