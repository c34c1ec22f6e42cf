"""What the `Trainer` (`dynmo.trainer`) changes before a step, on every rank: forced re-layouts
and expert re-placements (`parallel.relayout`, `parallel.replace_experts`), the DynMo loop's
layouts and the expert balancer's placements (rank 0 decides, every rank moves), and grows.

A layout with more stages than the pipeline has (after a re-pack released ranks) is a grow:
released ranks are gone, so every active rank saves a checkpoint that records the layout to
resume on, and the run ends; `dynmo train` restarts the job on its whole world from it
(`dynmo.launch`), and the restarted run reports what the restart cost in a "grow" event.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from dynmo import plan
from dynmo.checks import parse_replacements
from dynmo.config import Config
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.runtime.pipeline import Pipeline
from dynmo.trainer.setup import expert_balancer


class StepChanges:
    def __init__(self, cfg: Config, pipe: Pipeline, loop: DynmoLoop, start_step: int, resumed_grow: dict | None,
                 saved_layout: list[int] | None, created_at: float):
        self.cfg, self.pipe, self.loop = cfg, pipe, loop
        self.start_step = start_step
        # resuming from the checkpoint of a grow: the grow's record, and the layout it was saved on
        self.resumed_grow, self.saved_layout = resumed_grow, saved_layout
        self.created_at = created_at  # a grow's restart: what of it the set-up took
        self.relayouts = plan.parse_relayouts(cfg, pipe.num_stages)
        self.replacements = parse_replacements(cfg)  # forced expert re-placements {step: {layer: order}}
        self.expert_balancer = expert_balancer(cfg, pipe.ctx, pipe)  # rank 0 decides from the measured routing
        if resumed_grow is not None:
            # The grow's own step: resuming onto its layout applied it (and any forced re-layout
            # of that step before it). A grow onto fewer stages than this world re-packs onto it.
            grown = resumed_grow["layout"]
            self.relayouts.pop(start_step, None)
            if len(grown) - 1 < pipe.num_stages:
                self.relayouts[start_step] = Layout(tuple(grown))
        self.growing: dict | None = None  # a grow decided before this step: checkpoint, then the run ends

    def before_step(self, step: int) -> list[dict]:
        """Re-layouts first: a layer rebuilt by a migration must get this step's model changes too.

        A re-layout onto more stages than the pipeline has is a grow (`_grow`): nothing else
        happens before the step, which the restarted job trains."""
        events: list[dict] = []
        pipe = self.pipe
        if self.resumed_grow is not None and step == self.start_step:
            events.append(self._grow_event(self.resumed_grow))
        if step in self.relayouts:
            if self.relayouts[step].num_stages > pipe.num_stages:
                self._grow(step, self.relayouts[step], {"reason": "forced"})
                return events
            events.append(self._migrate(self.relayouts[step]) | {"reason": "forced"})
        if step in self.replacements and not pipe.released:
            events.append(pipe.replace_experts(self.replacements[step]) | {"reason": "forced"})
        if self.expert_balancer is not None and not pipe.released:
            events += self._balance_experts(step)
        if not pipe.released:
            events += self._rebalance(step)
        return events

    def _grow(self, step: int, layout: Layout, fields: dict) -> None:
        """A layout with more stages than the active pipeline: the released ranks are gone, so it
        is applied by a restart. Records the grow; the trainer saves the checkpoint and ends the run."""
        ctx = self.pipe.ctx
        launched = ctx.world // ctx.dp * self.cfg.parallel.virtual_stages
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
        local = self.cfg.train.global_batch // pipe.ctx.dp
        event = pipe.relayout(layout, self.loop.retuned_microbatches(local, m, old_stages, layout.num_stages)).as_event()
        if layout.num_stages < old_stages:
            event |= {"repacked": True, "stages": [old_stages, layout.num_stages], "microbatches": [m, pipe.microbatches]}
            if pipe.released:
                print(f"dynmo: rank {pipe.ctx.rank} released (re-packed onto {layout.num_stages} stages); exiting", flush=True)
        return event

    def _rebalance(self, step: int) -> list[dict]:
        """The DynMo loop's decision: rank 0 decides from the forecast cost, every rank migrates."""
        if self.cfg.balance.when == "never":
            return []
        ctx = self.pipe.ctx
        t0 = time.perf_counter()
        decision = self.loop.decide(step, self.pipe.layout, self.cfg.train.steps - step) if ctx.is_logger else None
        obj = [decision]
        dist.broadcast_object_list(obj, src=0, group=ctx.active_group)
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
        eb, ctx = self.expert_balancer, self.pipe.ctx
        if eb.every <= 0 or step % eb.every:
            return []
        decision, weighed = None, None
        if ctx.is_logger:
            layout = self.pipe.layout
            decision = eb.decide(step, dict(self.pipe.ep.orders), self.cfg.train.steps - step,
                                 step_times=lambda steps: self.loop.step_times(steps, layout))
            weighed = {k: v for k, v in eb.last.items() if k in decision}
        obj = [decision, weighed]
        dist.broadcast_object_list(obj, src=0, group=ctx.active_group)
        if not obj[0]:
            return []
        return [self.pipe.replace_experts(obj[0]) | {"reason": "auto", "weighed": obj[1]}]
