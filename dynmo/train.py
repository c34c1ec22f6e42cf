"""Training entry point run on every rank: `torchrun --nproc-per-node N -m dynmo.train ...`.

`dynmo train --nproc N ...` validates the config, prepares the data once and launches this.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from dynmo import checks
from dynmo.config import Config, ConfigError, load_config, to_toml
from dynmo.controller import Controller, retune_microbatches
from dynmo.data import TokenData, prepare
from dynmo.dynamics.case import CASES, Case, merge_layer_stats
from dynmo.layout import Layout, imbalance
from dynmo.model.gpt import layer_param_counts
from dynmo.runtime import checkpoint
from dynmo.runtime import dist as rdist
from dynmo.runtime.metrics import MetricsLog
from dynmo.runtime.pipeline import Pipeline, StepResult


class StepHook(Protocol):
    """Seam for controllers and dynamic models: runs on every rank before each step.

    May change the model or call `trainer.pipe.relayout(...)`; returns events for the metrics.
    """

    def __call__(self, trainer: "Trainer", step: int) -> list[dict]: ...


def initial_layout(cfg: Config, num_stages: int) -> Layout:
    n = checks.num_layers(cfg)
    spec = cfg.parallel.layout.strip().lower()
    if spec == "uniform":
        return Layout.uniform(n, num_stages)
    if spec == "params":
        from dynmo.balance import Problem, balance

        counts = layer_param_counts(cfg.model)
        return Layout(tuple(balance(Problem(costs=counts, stages=num_stages), "deepspeed").boundaries))
    return checks.explicit_layout(cfg.parallel.layout, cfg, num_stages, "parallel.layout")


class Trainer:
    def __init__(self, cfg: Config, ctx: rdist.DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.out = Path(cfg.out)
        folder = prepare(cfg.data.paths, cfg.model.vocab_size, cfg.data.cache_dir) if ctx.rank == 0 else None
        obj = [str(folder) if folder else None]
        dist.broadcast_object_list(obj, src=0)
        self.data = TokenData.load(Path(obj[0]), cfg.model.seq_len, cfg.data.val_fraction, cfg.train.seed)
        num_stages = ctx.pp * cfg.parallel.virtual_stages
        self.pipe = Pipeline(cfg, ctx, initial_layout(cfg, num_stages))
        self.start_step = 0
        # dynamic-model cases (dynmo.dynamics.case): same list, same order on every rank; built
        # before a checkpoint loads, so the layers they add or freeze match what was saved
        self.cases: list[Case] = [cls(self) for cls in CASES.values() if cls.enabled(cfg)]
        self.pipe.layer_extras = self.cases  # their per-layer state travels with migrating layers
        if cfg.checkpoint.resume:
            path = Path(cfg.checkpoint.resume)
            saved = checkpoint.read_meta(path).get("cases", {})
            for c in self.cases:
                c.load_state(saved.get(c.name, {}))
            self.start_step = checkpoint.load(self.pipe, path)
            for c in self.cases:
                c.after_load(self.start_step)
        self.relayouts = checks.parse_relayouts(cfg, num_stages)
        b = cfg.balance
        self.controller = Controller(
            when=b.when, every=b.every, balancer=b.balancer, window=b.window, min_gain=b.min_gain,
            horizon=b.horizon, microbatches=cfg.train.microbatches, repack=b.repack,
            repack_tolerance=b.repack_tolerance, capacity=b.memory_gb * 2**30 or None,
        )
        self.param_counts = layer_param_counts(cfg.model)
        self.profile_s = 0.0  # profiler bookkeeping since the last decision
        self.layer_bytes: list[int] = []
        if b.when != "never":
            self._measure_workers()
        # re-layouts first: layers rebuilt by a migration must get this step's model changes too
        self.hooks: list[StepHook] = [self._forced_relayout, self._rebalance, self._skew, self._cases_before]
        self.kinds = [s.kind for s in self.pipe.specs]

    def _case_states(self) -> dict:
        return {c.name: c.state() for c in self.cases}

    def _measure_workers(self) -> None:
        """Worker speeds and link times for the stage cost (one stage per rank only: with
        virtual stages several stages share a worker and a link, which the load model of
        dynmo.balance does not describe)."""
        b, ctl, ctx = self.cfg.balance, self.controller, self.ctx
        if self.cfg.parallel.virtual_stages != 1:
            return
        from dynmo.runtime import probe

        speeds = [1.0] * ctx.pp
        if b.workers == "measure":
            # within 10% of the reference is noise, not a slower worker
            speeds = [1.0 if abs(x - 1.0) < 0.1 else x for x in probe.measure_speeds(ctx)]
        if b.speeds:
            speeds = list(b.speeds)
        ctl.speeds = speeds
        if b.links == "measure" and ctx.pp > 1:
            m = self.cfg.model
            ctl.transfer = probe.measure_links(ctx, self.pipe.microbatch, m.seq_len, m.d_model)
        if ctx.is_logger:
            links = ", ".join(f"{t * 1e3:.2f}" for t in ctl.transfer or [])
            print(f"dynmo: worker speeds {', '.join(f'{x:.2f}' for x in speeds)}; link ms/microbatch [{links}]", flush=True)

    # ---- hooks ---------------------------------------------------------------------------
    def _forced_relayout(self, trainer: "Trainer", step: int) -> list[dict]:
        if step not in self.relayouts:
            return []
        return [self._migrate(self.relayouts[step]) | {"reason": "forced"}]

    def _migrate(self, layout: Layout) -> dict:
        """Apply a layout on every active rank (a re-pack if it has fewer stages)."""
        pipe = self.pipe
        old_stages, m = pipe.num_stages, pipe.microbatches
        microbatches = None
        if layout.num_stages < old_stages and self.cfg.balance.retune_microbatches:
            local = self.cfg.train.global_batch // self.ctx.dp
            microbatches = retune_microbatches(local, m, old_stages, layout.num_stages)
        rep = pipe.relayout(layout, microbatches=microbatches)
        event = rep.as_event()
        if layout.num_stages < old_stages:
            event |= {"repacked": True, "stages": [old_stages, layout.num_stages], "microbatches": [m, pipe.microbatches]}
            if pipe.released:
                print(f"dynmo: rank {self.ctx.rank} released (re-packed onto {layout.num_stages} stages); exiting", flush=True)
            else:
                self.ctx = pipe.ctx
                self.controller.microbatches = pipe.microbatches
        return event

    def _skew(self, trainer: "Trainer", step: int) -> list[dict]:
        sk = self.cfg.skew
        on = step >= sk.start_step and sk.factor > 1
        for i, layer in self.pipe.layers.items():
            spec = self.pipe.specs[i]
            if spec.kind == "t" and hasattr(layer, "extra_mlp_passes"):
                layer.extra_mlp_passes = sk.factor - 1 if on and (spec.index - 1) in sk.blocks else 0
        if on and step == sk.start_step:
            return [{"type": "dynamism", "case": "skew", "blocks": sk.blocks, "factor": sk.factor}]
        return []

    def _cases_before(self, trainer: "Trainer", step: int) -> list[dict]:
        return [e | {"case": c.name} if "case" not in e else e for c in self.cases for e in c.before_step(step)]

    def _rebalance(self, trainer: "Trainer", step: int) -> list[dict]:
        """The DynMo loop: rank 0 decides from the forecast cost, every rank migrates."""
        ctl = self.controller
        if ctl.when == "never":
            return []
        t0 = time.perf_counter()
        decision = None
        if self.ctx.is_logger:
            # measured state bytes (weights, grads, AdamW moments; frozen blocks carry fewer)
            layer_bytes = self.layer_bytes or [16 * c for c in self.param_counts]
            decision = ctl.decide(step, self.pipe.layout, layer_bytes, self.cfg.train.steps - step)
        obj = [None if decision is None else (list(decision.layout.boundaries), decision)]
        dist.broadcast_object_list(obj, src=0, group=self.ctx.active_group)
        decide_s = time.perf_counter() - t0
        if obj[0] is None:
            return []
        boundaries, decision = obj[0]
        event = self._migrate(Layout(tuple(boundaries)))
        ctl.history.clear()  # costs measured under the old layout include its stage effects
        event |= {
            "reason": f"balance.when={ctl.when}",
            "balancer": ctl.balancer,
            "current_bottleneck_s": decision.current_bottleneck,
            "predicted_bottleneck_s": decision.predicted_bottleneck,
            "predicted_gain_s": decision.predicted_gain_s,
            "predicted_migration_s": decision.predicted_cost_s,
            "decide_s": decide_s,
            "profile_s": self.profile_s,
            "speeds": ctl.speeds,
            "transfer_s": ctl.transfer,
        }
        self.profile_s = 0.0
        return [event]

    def _observe(self, rec: dict) -> None:
        ctl = self.controller
        self.profile_s += rec["profile_s"]
        self.layer_bytes = [int(x) for x in rec["layer_state_bytes"]]  # what a migration ships, measured
        if self.cfg.balance.cost == "params":
            # parameter counts, scaled by each layer's density where pruning reports one
            density = rec.get("prune_density") or [None] * len(self.param_counts)
            costs = [c * (1.0 if d is None else d) for c, d in zip(self.param_counts, density)]
        else:
            costs = list(rec["layer_cost_s"])  # typical microbatch: robust to one slowed microbatch
            if ctl.speeds and self.cfg.parallel.virtual_stages == 1:
                # time on a worker of speed s is cost / s: undo it, so costs are worker-free
                owner = self.pipe.layout.owner()
                costs = [c * ctl.speeds[owner[i]] for i, c in enumerate(costs)]
        # memory per layer as the balancer sees it: state + activations of the most microbatches
        # any stage keeps in flight (conservative: the layer may land on the first stage)
        held = max(self.pipe.in_flight(j) for j in range(self.pipe.num_stages))
        ctl.memory = [s + held * a for s, a in zip(rec["layer_state_bytes"], rec["layer_act_bytes"])]
        if any(e["type"] == "dynamism" for e in rec["events"]):
            ctl.dynamism()
        ctl.observe(costs)
        for e in rec["events"]:
            if e["type"] == "migration":
                ctl.observe_migration(e["bytes"], e["seconds"])

    # ---- batches ---------------------------------------------------------------------------
    def _local_batch(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        g = self.cfg.train.global_batch
        batch = torch.from_numpy(self.data.batch(step, g, split))
        per = g // self.ctx.dp
        mine = batch[self.ctx.dp_rank * per : (self.ctx.dp_rank + 1) * per]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    # ---- loop --------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        log = None
        if ctx.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.toml").write_text(to_toml(cfg))
            log = MetricsLog(self.out, cfg.train.steps, self.start_step, cfg.log.tensorboard, cfg.log.progress, cfg.log.every)
            print(
                f"dynmo: {ctx.world} ranks (pp={ctx.pp} x dp={ctx.dp}, {ctx.backend}), schedule {cfg.parallel.schedule}, "
                f"{len(self.pipe.specs)} layers, layout {self.pipe.layout.format(self.kinds)}",
                flush=True,
            )
        trace = None
        if ctx.is_logger and cfg.log.trace:
            from dynmo.sim.trace import TraceHeader, TraceWriter

            header = TraceHeader.from_config(cfg.to_dict(), self.param_counts, ctx.pp, ctx.dp)
            trace = TraceWriter(cfg.log.trace, header)
        t_start = time.perf_counter()
        losses: list[float] = []
        speeds: list[float] = []
        for step in range(self.start_step, cfg.train.steps):
            events: list[dict] = []
            for hook in self.hooks:
                events += hook(self, step) or []
                if self.pipe.released:
                    break
            if self.pipe.released:
                return {"released": True, "rank": ctx.rank, "step": step}
            x, y = self._local_batch(step)
            res = self.pipe.train_step(step, x, y)
            for c in self.cases:
                events += [e | {"case": c.name} if "case" not in e else e for e in c.after_step(step, res)]
            rec = self._record(step, res, events)
            self._observe(rec)
            if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
                rec["val_loss"] = self.validate()
            losses.append(rec["loss"])
            speeds.append(rec["tokens_per_s"])
            if log:
                log.log(rec)
            if trace:
                trace.write_step(rec)
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                checkpoint.save(self.pipe, self.out / f"checkpoint-{step + 1}", step + 1, cfg, self._case_states())
        if trace:
            trace.close()
        if cfg.checkpoint.final:
            checkpoint.save(self.pipe, self.out / "checkpoint-final", cfg.train.steps, cfg, self._case_states())
        summary = {
            "steps": cfg.train.steps,
            "start_step": self.start_step,
            "final_loss": losses[-1] if losses else None,
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

    def _record(self, step: int, res: StepResult, events: list[dict]) -> dict:
        """Gather every rank's step figures onto all ranks and build the metrics record."""
        S, n = self.pipe.num_stages, len(self.pipe.specs)
        mig = [e for e in events if e["type"] == "migration"]
        scalars = [res.schedule_s, res.step_s, res.loss_sum, res.loss_count, sum(e.get("bytes", 0) for e in mig),
                   sum(e.get("seconds", 0.0) for e in mig), res.profile_s, res.peak_bytes]
        K = len(scalars)
        R = 5  # per-layer rows
        vec = torch.zeros(S + K + R * n, dtype=torch.float64)
        for s, c in res.stage_compute_s.items():
            vec[s] = c
        vec[S : S + K] = torch.tensor(scalars, dtype=torch.float64)
        # fwd s, bwd s, activation bytes / microbatch, state bytes, typical cost s / microbatch
        per_layer = vec[S + K :].view(R, n)
        for i, (f, b) in res.layer_times.items():
            per_layer[0, i], per_layer[1, i] = f, b
        for i, a in res.layer_act_bytes.items():
            per_layer[2, i] = a
        for i, m in res.layer_state_bytes.items():
            per_layer[3, i] = m
        for i, c in res.layer_costs.items():
            per_layer[4, i] = c
        parts = [torch.zeros_like(vec) for _ in range(self.ctx.active_world)]
        dist.all_gather(parts, vec, group=self.ctx.active_group)
        allv = torch.stack(parts)  # [active ranks (replica-major), S + K + 4n]
        dp, pp = self.ctx.dp, self.ctx.pp
        stage_compute = (allv[:, :S].sum(0) / dp).tolist()  # each stage once per replica
        sc = allv[:, S : S + K]
        iteration, step_s = float(sc[:, 0].max()), float(sc[:, 1].max())
        # per pipeline worker, averaged over replicas
        worker_compute = [float(allv[[r * pp + w for r in range(dp)], :S].sum() / dp) for w in range(pp)]
        worker_idle = [max(0.0, iteration - c) for c in worker_compute]
        loss = float(sc[:, 2].sum() / max(1.0, float(sc[:, 3].sum())))
        for e in mig:
            e["bytes"] = int(sc[:, 4].sum())
            e["seconds"] = float(sc[:, 5].max())
            if "predicted_bottleneck_s" in e:  # the slowest stage per microbatch, as measured on this step
                e["measured_bottleneck_s"] = max(stage_compute) / self.pipe.microbatches
        tokens = self.cfg.train.global_batch * self.cfg.model.seq_len
        per_mb = dp * self.pipe.microbatches  # each layer runs once per microbatch per replica
        layers = allv[:, S + K :].view(-1, R, n).sum(0)
        layer_fwd, layer_bwd = (layers[0] / per_mb).tolist(), (layers[1] / per_mb).tolist()
        act, state, cost = (layers[2] / dp).tolist(), (layers[3] / dp).tolist(), (layers[4] / dp).tolist()
        lay = self.pipe.layout
        stage_memory = [
            sum(state[i] for i in lay.layers(j)) + self.pipe.in_flight(j) * sum(act[i] for i in lay.layers(j))
            for j in range(S)
        ]
        stats: dict[str, list] = {}
        if self.cases:
            gathered: list = [None] * self.ctx.active_world
            mine: dict = {}
            for c in self.cases:
                mine.update(c.layer_stats())
            dist.all_gather_object(gathered, mine, group=self.ctx.active_group)
            stats = merge_layer_stats(gathered, n)
        rec = stats | {
            "step": step,
            "loss": loss,
            "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "step_s": step_s,
            "iteration_s": iteration,
            "layout": list(lay.boundaries),
            "layout_str": lay.format(self.kinds),
            "stage_compute_s": stage_compute,
            "stage_idle_s": [max(0.0, iteration - c) for c in stage_compute],
            "worker_compute_s": worker_compute,
            "worker_idle_s": worker_idle,
            "bubble_ratio": sum(worker_idle) / (pp * iteration) if iteration > 0 else 0.0,
            "workers": self.ctx.active_world,
            "microbatches": self.pipe.microbatches,
            "imbalance": imbalance(stage_compute),
            "layer_fwd_s": layer_fwd,
            "layer_bwd_s": layer_bwd,
            "layer_cost_s": cost,
            "layer_act_bytes": act,
            "layer_state_bytes": state,
            "stage_memory_bytes": stage_memory,
            "profile_s": float(sc[:, 6].max()),
            "grad_norm": res.grad_norm,
            "lr": self.pipe.optimizer.param_groups[0]["lr"],
            "events": events,
        }
        if self.ctx.device.type == "cuda":
            rec["worker_peak_memory_bytes"] = [float(allv[[r * pp + w for r in range(dp)], S + 7].max()) for w in range(pp)]
        return rec


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    ap = argparse.ArgumentParser(prog="dynmo.train", add_help=True)
    ap.add_argument("--config", default=None)
    known, rest = ap.parse_known_args(argv)
    return known.config, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config_path, overrides = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(config_path, overrides)
        checks.validate(cfg, world)
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dynmo: error: {e}", file=sys.stderr)
        return 2
    cfg.parallel.pp = checks.resolve_pp(cfg, world)
    ctx = rdist.init(cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.backend)
    try:
        trainer = Trainer(cfg, ctx)
        summary = trainer.run()
        if summary.get("released"):
            return 0  # nothing left to do here; the others train on (no collective with them)
        # Meet before tearing down: a rank that destroys its gloo groups while a peer still has
        # traffic in flight can abort ("terminate called without an active exception").
        dist.barrier(group=trainer.ctx.active_group)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
