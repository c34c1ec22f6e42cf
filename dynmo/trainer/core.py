"""The `Trainer`: one rank's training loop. `dynmo.train` builds it under torchrun and runs it.

One step, on every rank: forced re-layouts, the DynMo loop's decision (rank 0 decides, every
rank migrates), the dynamic-model cases, the training step, one merged `StepRecord` that the
loop observes and the metrics and the trace write.

Its collaborators: the set-up (`dynmo.trainer.setup`), the changes before a step -- re-layouts,
expert re-placements and grows (`dynmo.trainer.changes`) -- and what rank 0 writes
(`dynmo.trainer.log`). A grow (a layout onto more stages than a re-pack left) ends the run with
a checkpoint here; `dynmo train` restarts the job on its whole world from it.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dynmo import plan
from dynmo.trainer import setup
from dynmo.config import Config
from dynmo.dynamics.case import Case
from dynmo.dynamics.noise import Noise, recorded_costs
from dynmo.dynamics.registry import CASES
from dynmo.model.layers import layer_param_counts
from dynmo.record import StepRecord
from dynmo.runtime import checkpoint, faults, probe
from dynmo.runtime import dist as rdist
from dynmo.runtime.failures import Diverged, last_checkpoint
from dynmo.runtime.host import PipelineHost
from dynmo.runtime.metrics import MetricsLog
from dynmo.runtime.pipeline import Pipeline
from dynmo.runtime.record import gather_record
from dynmo.trainer.changes import StepChanges
from dynmo.trainer.log import open_outputs, summary


class Trainer:
    def __init__(self, cfg: Config, ctx: rdist.DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.created_at = time.time()  # a grow's restart: what of it the set-up here took
        self.out = Path(cfg.out)
        self.data = setup.load_data(cfg, ctx)
        num_stages = ctx.pp * cfg.parallel.virtual_stages
        self.params = layer_param_counts(cfg.model, cfg.parallel.unit)
        saved = setup.read_saved(cfg)
        self.saved_costs = saved.get("layer_costs")
        # resuming from the checkpoint of a grow: the layout it decided, when it fits this world
        resumed_grow: dict | None = saved.get("grow") if isinstance(saved.get("grow"), dict) else None
        grown = resumed_grow["layout"] if resumed_grow else None
        layout, rebalanced = plan.first_layout(cfg, num_stages, self.params, self.saved_costs, saved.get("layout"),
                                               grown)
        self.pipe = Pipeline(cfg, ctx, layout)
        self.letters = [s.letter for s in self.pipe.specs]
        if ctx.is_logger:
            setup.say_resumed(cfg, layout, self.letters, num_stages, saved, resumed_grow, rebalanced)
        if self.pipe.hf_read:
            setup.say_hf_read(cfg, ctx, self.pipe)
        self.start_step = 0
        # dynamic-model cases: same list, same order on every rank; built before a checkpoint
        # loads, so the layers they add or freeze match what was saved
        self.cases: list[Case] = [cls(PipelineHost(self.pipe)) for cls in CASES if cls.enabled(cfg)]
        self.pipe.layer_extras = self.cases  # their per-layer state travels with migrating layers
        if cfg.checkpoint.resume:
            for c in self.cases:
                c.load_state(saved.get("cases", {}).get(c.name, {}))
            self.start_step = checkpoint.load(self.pipe, Path(cfg.checkpoint.resume))
            for c in self.cases:
                c.after_load(self.start_step)
        speeds, transfer, transfer_back = setup.measure_workers(cfg, ctx, self.pipe)
        # what one microbatch ships over each cut: the link times price a cut between blocks
        self.boundary_bytes = probe.boundary_bytes(cfg, self.pipe.microbatch, self.pipe.dtype.itemsize)
        self.loop = setup.build_loop(cfg, self.pipe, self.params, self.boundary_bytes, speeds, transfer, transfer_back)
        if self.saved_costs and cfg.balance.cost == "time":
            self.loop.controller.history.append(list(self.saved_costs))  # the starting forecast
        self.changes = StepChanges(cfg, self.pipe, self.loop, self.start_step, resumed_grow, saved.get("layout"),
                                   self.created_at)

    # ---- before a step -------------------------------------------------------------------
    def _before_step(self, step: int) -> list[dict]:
        """Re-layouts, re-placements and grows (`StepChanges`), then the cases' changes, which a
        layer rebuilt by a migration must get too. Nothing of the cases on a released rank, nor
        before a grow's checkpoint: the restarted job trains this step."""
        events = self.changes.before_step(step)
        self.ctx = self.pipe.ctx  # a re-pack shrank the groups
        if not self.pipe.released and self.changes.growing is None:
            events += _tagged(self.cases, lambda c: c.before_step(step))
        return events

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
        log, trace = open_outputs(cfg, ctx, self.out, self.start_step, self.pipe, self.letters, self.params,
                                  self.boundary_bytes)
        t_start = time.perf_counter()
        records: list[StepRecord] = []
        for step in range(self.start_step, cfg.train.steps):
            faults.at_step(step)
            faults.point("step")
            events = self._before_step(step)
            if self.pipe.released:
                return {"released": True, "rank": ctx.rank, "step": step}
            if self.changes.growing is not None:
                return self._save_for_grow(step, log, trace)
            rec = self._train_step(step, events)
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
        done = summary(cfg, self.start_step, self.pipe, ctx, self.ctx, records, time.perf_counter() - t_start)
        if log:
            log.close(done)
        return done

    def _noise_of_injected(self):
        """With `[noise]` on, how costs injected by DYNMO_COSTS become the recorded ones (the
        noise's own draws, `recorded_costs`); None without noise."""
        noise = next((c for c in self.cases if isinstance(c, Noise)), None)
        if noise is None:
            return None
        ranks, m = self.pipe.layer_ranks(self.pipe.layout), self.pipe.microbatches
        return lambda step, costs: recorded_costs(noise.draws, step, costs, ranks, m)

    def _train_step(self, step: int, events: list[dict]) -> StepRecord:
        """The step itself, the cases' reports on it, and the merged record the loop observes."""
        cfg = self.cfg
        res = self.pipe.train_step(step, *self._local_batch(step))
        events += _tagged(self.cases, lambda c: c.after_step(step, res))
        stats: dict = {}
        for c in self.cases:
            stats.update(c.layer_stats())
        tokens = cfg.train.global_batch * cfg.model.seq_len
        rec = faults.injected_costs(gather_record(self.pipe, step, res, events, stats, tokens, self.letters),
                                    self._noise_of_injected())
        if not (math.isfinite(rec.loss) and math.isfinite(rec.grad_norm)):
            # every rank sees the merged record, so all stop here together; nothing is saved
            raise Diverged(f"the loss is {rec.loss} (gradient norm {rec.grad_norm}) at step {step}; "
                           f"training stopped before saving anything from it. {last_checkpoint(self.out)} "
                           "Lower train.lr, raise train.warmup_steps or set train.grad_clip, then resume.")
        self.loop.observe(rec)
        if self.changes.expert_balancer is not None:
            self.changes.expert_balancer.observe(rec)
        if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
            rec.val_loss = self.validate()
        return rec

    def _save(self, path: Path, step: int, grow: dict | None = None) -> None:
        checkpoint.save(self.pipe, path, step, self.cfg, {c.name: c.state() for c in self.cases}, self.cfg.checkpoint.keep,
                        costs=self.loop.controller.forecast(), grow=grow)

    def _save_for_grow(self, step: int, log: MetricsLog | None, trace) -> dict:
        """Every active rank: the checkpoint the grown job resumes from (`step` steps trained),
        recording the grow; then this job ends (exit 0) and `dynmo train` restarts it on the whole
        world. No summary: the run goes on."""
        g = self.changes.growing
        if self.ctx.is_logger:
            print(f"dynmo: growing back to {g['stages'][1]} pipeline ranks at step {step}: checkpoint, restart",
                  flush=True)
        path = self.out / f"checkpoint-{step}"
        self._save(path, step, grow=g | {"checkpoint": path.name})
        if trace:
            trace.close()
        if log:
            log.close(None)
        return {"grow": True, "step": step, "checkpoint": str(path), "stages": g["stages"]}

    def validate(self) -> float:
        total, n = 0.0, 0
        for b in range(self.cfg.train.eval_batches):
            x, y = self._local_batch(b, "val")
            v = self.pipe.eval_loss(x, y)
            if v is not None:
                total, n = total + v, n + 1
        t = torch.tensor([total, float(n)], device=self.ctx.device)  # NCCL takes no CPU tensor
        dist.all_reduce(t, group=self.ctx.active_group)
        return float(t[0] / t[1])


def _tagged(cases: list[Case], events_of) -> list[dict]:
    """Each case's events, tagged with the case's name unless the event names one already."""
    return [e if "case" in e else e | {"case": c.name} for c in cases for e in events_of(c)]

