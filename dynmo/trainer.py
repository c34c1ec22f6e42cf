"""The `Trainer`: one rank's training loop. `dynmo.train` builds it under torchrun and runs it.

One step, on every rank: forced re-layouts, the DynMo loop's decision (rank 0 decides, every
rank migrates), the dynamic-model cases, the training step, one merged `StepRecord` that the
loop observes and the metrics and the trace write.

A layout with more stages than the pipeline has (after a re-pack released ranks) is a grow:
released ranks are gone, so every active rank saves a checkpoint that records the layout to
resume on, and the run ends; `dynmo train` restarts the job on its whole world from it
(`dynmo.launch`), and the restarted run reports what the restart cost in a "grow" event.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dynmo import plan
from dynmo.checks import parse_replacements
from dynmo.config import Config, to_toml
from dynmo.balance.experts import MOVE_BYTES_PER_PARAM
from dynmo.controller.experts import ExpertBalancer
from dynmo.flops import expert_share
from dynmo.data import TokenData, prepare
from dynmo.dynamics.case import Case
from dynmo.dynamics.noise import Noise, recorded_costs
from dynmo.dynamics.registry import CASES
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop, bytes_per_param
from dynmo.model.layers import layer_param_counts
from dynmo.record import StepRecord
from dynmo.runtime import checkpoint, experts, faults, probe
from dynmo.runtime import dist as rdist
from dynmo.runtime.failures import Diverged, last_checkpoint
from dynmo.runtime.host import PipelineHost
from dynmo.runtime.metrics import MetricsLog
from dynmo.runtime.pipeline import Pipeline
from dynmo.runtime.record import gather_record


class Trainer:
    def __init__(self, cfg: Config, ctx: rdist.DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.created_at = time.time()  # a grow's restart: what of it the set-up here took
        self.out = Path(cfg.out)
        folder = prepare(cfg.data.paths, cfg.model.vocab_size, cfg.data.cache_dir, cfg.model.hf_path) if ctx.rank == 0 else None
        obj = [str(folder) if folder else None]
        dist.broadcast_object_list(obj, src=0)
        self.data = TokenData.load(Path(obj[0]), cfg.model.seq_len, cfg.data.val_fraction, cfg.train.seed)
        num_stages = ctx.pp * cfg.parallel.virtual_stages
        self.params = layer_param_counts(cfg.model, cfg.parallel.unit)
        saved = checkpoint.read_meta(Path(cfg.checkpoint.resume)) if cfg.checkpoint.resume else {}
        if saved.get("unit", "block") != cfg.parallel.unit:  # its layout and costs count other units
            saved = {**saved, "layer_costs": None, "layout": None, "grow": None}
        self.saved_costs = saved.get("layer_costs")
        self.saved_layout = saved.get("layout")  # boundaries the checkpoint was saved on
        # resuming from the checkpoint of a grow: the layout it decided, when it fits this world
        self.resumed_grow: dict | None = saved.get("grow") if isinstance(saved.get("grow"), dict) else None
        grown = self.resumed_grow["layout"] if self.resumed_grow else None
        layout, rebalanced = plan.first_layout(cfg, num_stages, self.params, self.saved_costs, saved.get("layout"),
                                               grown)
        self.pipe = Pipeline(cfg, ctx, layout)
        self.letters = [s.letter for s in self.pipe.specs]
        if grown and ctx.is_logger:
            self._say_grown(grown, num_stages, len(saved["layout"]) - 1)
        if rebalanced and ctx.is_logger:
            print(f"dynmo: resuming on {num_stages} stages (saved on {len(saved['layout']) - 1}): layout "
                  f"{layout.format(self.letters)} chosen by the {cfg.balance.balancer} balancer "
                  "from the layer costs measured before the checkpoint", flush=True)
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
            for c in self.cases:
                c.load_state(saved.get("cases", {}).get(c.name, {}))
            self.start_step = checkpoint.load(self.pipe, Path(cfg.checkpoint.resume))
            for c in self.cases:
                c.after_load(self.start_step)
        self.relayouts = plan.parse_relayouts(cfg, num_stages)
        self.replacements = parse_replacements(cfg)  # forced expert re-placements {step: {layer: order}}
        self.expert_balancer = None  # balance.experts = "auto": rank 0 decides from the measured routing
        if cfg.balance.experts == "auto" and self.pipe.ep is not None:
            b = cfg.balance
            self.expert_balancer = ExpertBalancer(
                ranks=ctx.ep, groups=ctx.dp // ctx.ep, names=[s.prefix for s in self.pipe.specs],
                extra_slots=cfg.parallel.expert_slots,
                expert_bytes=MOVE_BYTES_PER_PARAM * experts.params_per_expert(self.pipe.specs, cfg.model),
                every=b.experts_every, window=b.window, min_gain=b.min_gain, confidence=b.confidence, horizon=b.horizon,
                expert_share={s.prefix: expert_share(cfg.model, cfg.parallel.unit == "sublayer") for s in self.pipe.specs})
        if self.resumed_grow is not None:
            # The grow's own step: resuming onto its layout applied it (and any forced re-layout
            # of that step before it). A grow onto fewer stages than this world re-packs onto it.
            self.relayouts.pop(self.start_step, None)
            if len(grown) - 1 < num_stages:
                self.relayouts[self.start_step] = Layout(tuple(grown))
        self.growing: dict | None = None  # a grow decided before this step: checkpoint, then the run ends
        speeds, transfer, transfer_back = self._measure_workers()
        # what one microbatch ships over each cut: the link times price a cut between blocks
        self.boundary_bytes = probe.boundary_bytes(cfg, self.pipe.microbatch, self.pipe.dtype.itemsize)
        self.loop = DynmoLoop(cfg.balance, microbatches=self.pipe.microbatches, schedule=cfg.parallel.schedule,
                              stages_per_rank=cfg.parallel.virtual_stages, layer_params=self.params, speeds=speeds,
                              transfer=transfer, transfer_back=transfer_back, boundary_bytes=self.boundary_bytes,
                              layer_flops=plan.layer_flops(cfg),
                              layer_bytes=[int(bytes_per_param(cfg.parallel.shard, cfg.parallel.dp) * n) for n in self.params])
        if self.saved_costs and cfg.balance.cost == "time":
            self.loop.controller.history.append(list(self.saved_costs))  # the starting forecast

    def _measure_workers(self) -> tuple[list[float] | None, list[float] | None, list[float] | None]:
        """Worker speeds and link times (forward, backward) for the balancer, when it runs.

        They need one stage per rank: with virtual stages several stages share a worker and a
        link, which the balancers' load model does not describe."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.balance.when == "never" or cfg.parallel.virtual_stages != 1:
            return None, None, None
        m = cfg.model
        speeds, transfer, transfer_back = probe.measure_workers(cfg.balance, ctx, self.pipe.microbatch, m.seq_len,
                                                                m.d_model, self.pipe.dtype.itemsize)
        if ctx.is_logger:
            links = ", ".join(f"{f * 1e3:.2f}/{b * 1e3:.2f}" for f, b in zip(transfer or [], transfer_back or []))
            print(f"dynmo: worker speeds {', '.join(f'{x:.2f}' for x in speeds)}; link ms/microbatch "
                  f"forward/backward [{links}]", flush=True)
        return speeds, transfer, transfer_back

    def _say_grown(self, grown: list[int], num_stages: int, saved_stages: int) -> None:
        """Rank 0, resuming from a grow's checkpoint: the layout it resumes on, and why."""
        g = self.resumed_grow
        if len(grown) - 1 == num_stages:
            print(f"dynmo: resuming on {num_stages} stages (saved on {saved_stages}): layout "
                  f"{Layout(tuple(grown)).format(self.letters)}, the one the grow at step {g['step']} decided", flush=True)
        elif len(grown) - 1 > num_stages:
            print(f"dynmo: the grow at step {g['step']} decided {len(grown) - 1} stages, but this job has "
                  f"{num_stages}; not using its layout", flush=True)
        else:
            print(f"dynmo: the grow at step {g['step']} decided {len(grown) - 1} of this job's {num_stages} stages: "
                  f"re-packing onto {Layout(tuple(grown)).format(self.letters)} before step {g['step']}", flush=True)

    # ---- before a step -------------------------------------------------------------------
    def _before_step(self, step: int) -> list[dict]:
        """Re-layouts first: a layer rebuilt by a migration must get this step's model changes too.

        A re-layout onto more stages than the pipeline has is a grow (`_grow`): nothing else
        happens before the step, which the restarted job trains."""
        events: list[dict] = []
        if self.resumed_grow is not None and step == self.start_step:
            events.append(self._grow_event(self.resumed_grow))
        if step in self.relayouts:
            if self.relayouts[step].num_stages > self.pipe.num_stages:
                self._grow(step, self.relayouts[step], {"reason": "forced"})
                return events
            events.append(self._migrate(self.relayouts[step]) | {"reason": "forced"})
        if step in self.replacements and not self.pipe.released:
            events.append(self.pipe.replace_experts(self.replacements[step]) | {"reason": "forced"})
        if self.expert_balancer is not None and not self.pipe.released:
            events += self._balance_experts(step)
        if not self.pipe.released:
            events += self._rebalance(step)
        if not self.pipe.released and self.growing is None:
            events += _tagged(self.cases, lambda c: c.before_step(step))
        return events

    def _grow(self, step: int, layout: Layout, fields: dict) -> None:
        """A layout with more stages than the active pipeline: the released ranks are gone, so it
        is applied by a restart. Records the grow; `run` saves the checkpoint and ends the run."""
        launched = self.ctx.world // self.ctx.dp * self.cfg.parallel.virtual_stages
        if layout.num_stages > launched:
            raise ValueError(f"a grow onto {layout.num_stages} stages at step {step}, but the job was launched "
                             f"with {launched}")
        self.growing = {"step": step, "layout": list(layout.boundaries),
                        "stages": [self.pipe.num_stages, layout.num_stages], "decided_at": time.time()} | fields

    def _grow_event(self, g: dict) -> dict:
        """The first step on the grown world: what the grow cost, from the decision to now
        (`restart_s`): the checkpoint (`checkpoint_s`), the old job's end and the new one's
        launch (processes, imports, rendezvous), and this job's set-up (`setup_s`: data, layers,
        the checkpoint's load, probes)."""
        now = time.time()
        extra = {k: v for k, v in g.items() if k not in ("step", "layout", "stages", "decided_at", "saved_at")}
        return {"type": "grow", "old": list(self.saved_layout), "new": g["layout"], "stages": g["stages"],
                "decided_step": g["step"], "checkpoint_s": g["saved_at"] - g["decided_at"],
                "setup_s": now - self.created_at, "restart_s": now - g["decided_at"]} | extra

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
        if decision.layout.num_stages > self.pipe.num_stages:  # released workers come back: a restart
            if self.resumed_grow is None or step != self.start_step:  # never twice at one step
                self._grow(step, decision.layout, self.loop.event(decision, decide_s))
            return []
        event = self._migrate(decision.layout) | self.loop.event(decision, decide_s)
        self.loop.applied(self.pipe.microbatches)
        return [event]

    def _balance_experts(self, step: int) -> list[dict]:
        """balance.experts = "auto": rank 0 decides from the measured routing, every rank moves.
        Only at the steps the balancer looks (every `balance.experts_every`): no broadcast between."""
        eb = self.expert_balancer
        if eb.every <= 0 or step % eb.every:
            return []
        decision, weighed = None, None
        if self.ctx.is_logger:
            layout = self.pipe.layout
            decision = eb.decide(step, dict(self.pipe.ep.orders), self.cfg.train.steps - step,
                                 step_times=lambda steps: self.loop.step_times(steps, layout))
            weighed = {k: v for k, v in eb.last.items() if k in decision}
        obj = [decision, weighed]
        dist.broadcast_object_list(obj, src=0, group=self.ctx.active_group)
        if not obj[0]:
            return []
        return [self.pipe.replace_experts(obj[0]) | {"reason": "auto", "weighed": obj[1]}]

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
            print(f"dynmo: {ctx.world} ranks (pp={ctx.pp} x dp={ctx.dp}, {ctx.backend}), schedule {cfg.parallel.schedule}, "
                  f"{len(self.pipe.specs)} layers, layout {self.pipe.layout.format(self.letters)}", flush=True)
            if cfg.log.trace:
                from dynmo.sim.trace import TraceHeader, TraceWriter

                trace = TraceWriter(cfg.log.trace, TraceHeader.from_config(cfg.to_dict(), self.params, ctx.pp, ctx.dp,
                                                                           boundary_bytes=self.boundary_bytes))
        t_start = time.perf_counter()
        records: list[StepRecord] = []
        for step in range(self.start_step, cfg.train.steps):
            faults.at_step(step)
            faults.point("step")
            events = self._before_step(step)
            if self.pipe.released:
                return {"released": True, "rank": ctx.rank, "step": step}
            if self.growing is not None:
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
        summary = _summary(self, ctx, records, time.perf_counter() - t_start)
        if log:
            log.close(summary)
        return summary

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
        if self.expert_balancer is not None:
            self.expert_balancer.observe(rec)
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
        g = self.growing
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


def _summary(t: Trainer, started: rdist.DistContext, records: list[StepRecord], wall_s: float) -> dict:
    """`summary.json`: the run's outcome in one object. `started` is the context the run began
    with (world and replicas); `t.ctx` is the one after any re-pack (pipeline ranks, workers)."""
    speeds = [r.tokens_per_s for r in records]
    return {
        "steps": t.cfg.train.steps,
        "start_step": t.start_step,
        "final_loss": records[-1].loss if records else None,
        "wall_s": wall_s,
        # the first step pays one-off set-up costs; leave it out of the mean when we can
        "mean_tokens_per_s": (sum(speeds[1:]) / len(speeds[1:]) if len(speeds) > 1 else (speeds or [None])[0]),
        "final_layout": list(t.pipe.layout.boundaries),
        "world": started.world,
        "workers": t.ctx.active_world,
        "pp": t.ctx.pp,
        "dp": started.dp,
        "microbatches": t.pipe.microbatches,
        "schedule": t.cfg.parallel.schedule,
    }
