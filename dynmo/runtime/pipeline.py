"""One rank's share of the pipeline: its layers, stages, schedule and optimizer.

The layout can change between any two steps (`relayout`): moved layers travel with their
weights, gradients and AdamW state, then the stages and the schedule are rebuilt. Training
after a re-layout is the same computation as without it (bitwise on CPU), because
  - every layer is built from its own seed and named by a stable name,
  - AdamW updates each parameter independently of how parameters are grouped,
  - the gradient norm is summed per layer in layer order, not per stage.

What it builds (layers, stages, the schedule) is built in `dynmo.runtime.build`; a re-pack's new
groups and the moves of experts are in `dynmo.runtime.relayout`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dynmo import plan
from dynmo.config import Config
from dynmo.layout import Layout, LayoutError
from dynmo.model.layers import LayerSpec, half_carry, layer_specs
from dynmo.runtime import experts, fsdp, grads, optim, zero
from dynmo.runtime.build import build_layers, build_schedule, build_stages
from dynmo.runtime.compiled import mark_step
from dynmo.runtime.dist import DistContext
from dynmo.runtime.memory import PeakMemory
from dynmo.runtime.relayout import regroup, released_ranks, replace_experts
from dynmo.runtime.schedules import forward_only
from dynmo.runtime.tie import tied_embeddings
from dynmo.schedules import get_schedule, in_flight, stage_to_rank
from dynmo.runtime.stage import TimedPipelineStage
from dynmo.runtime.migration import MigrationReport, exchange_layers


@dataclass
class StepResult:
    """What one rank saw during one training step."""

    loss_sum: float  # sum of microbatch losses (last stage only, else 0)
    loss_count: int
    schedule_s: float  # wall time inside schedule.step
    step_s: float  # wall time of the whole step (schedule + grad sync + optimizer)
    stage_compute_s: dict[int, float]  # per local stage: seconds computing
    layer_times: dict[int, tuple[float, float]]  # per local layer: (fwd s, bwd s) summed over microbatches
    grad_norm: float
    layer_costs: dict[int, float] = field(default_factory=dict)  # per local layer: median fwd+bwd s of a microbatch
    layer_act_bytes: dict[int, float] = field(default_factory=dict)  # per local layer, per microbatch
    layer_state_bytes: dict[int, int] = field(default_factory=dict)  # weights + grads + optimizer state
    profile_s: float = 0.0  # host seconds in the profiler's bookkeeping (saved-tensor accounting)
    peak_bytes: int = 0  # this rank's measured peak memory in the step (dynmo.runtime.memory); 0 = unknown

    @classmethod
    def of_stages(cls, stages: list[TimedPipelineStage], losses: list[torch.Tensor], t0: float, schedule_s: float,
                  grad_norm: float, state_bytes: dict[int, int], memory: PeakMemory) -> StepResult:
        """The step's result, read from the stages when it ends. The losses are read first: on an
        accelerator that waits for the step, so `step_s` (from `t0`) counts all of it."""
        return cls(
            loss_sum=float(sum(l.item() for l in losses)),
            loss_count=len(losses),
            schedule_s=schedule_s,
            step_s=time.perf_counter() - t0,
            stage_compute_s={st.stage_index: st.compute_s for st in stages},
            layer_times={i: t for st in stages for i, t in st.submod.layer_times().items()},
            grad_norm=grad_norm,
            layer_costs={i: c for st in stages for i, c in st.submod.layer_costs().items()},
            layer_act_bytes={i: b for st in stages for i, b in st.submod.layer_act_bytes().items()},
            layer_state_bytes=state_bytes,
            profile_s=sum(st.submod.profile_s for st in stages),
            peak_bytes=memory.peak(),
        )


def compute_dtype(cfg: Config) -> torch.dtype:
    """The dtype layers compute in and activations travel in (`train.dtype`); parameters,
    gradients and optimizer state stay float32 either way."""
    return torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32


class Pipeline:
    def __init__(self, cfg: Config, ctx: DistContext, layout: Layout):
        self.cfg, self.ctx = cfg, ctx
        self.specs: list[LayerSpec] = layer_specs(cfg.model, cfg.parallel.unit)
        self.half_carry = half_carry(cfg)  # what crosses a boundary between a block's halves
        self.schedule_info = get_schedule(cfg.parallel.schedule)
        self.num_stages = ctx.pp * cfg.parallel.virtual_stages
        self.placement = stage_to_rank(self.num_stages, ctx.pp, self.schedule_info.placement)
        self._check_layout(layout)
        self.layout = layout
        self.microbatches = cfg.train.microbatches  # per replica per step; re-tuned after a re-pack
        self.microbatch = cfg.train.global_batch // ctx.dp // cfg.train.microbatches
        # numerics and memory, per layer wherever it sits (dynmo.runtime.stage)
        self.dtype = compute_dtype(cfg)
        blocks = set(plan.recompute_blocks(cfg))
        self.recompute = frozenset(i for i, sp in enumerate(self.specs) if sp.block in blocks)  # unit indices
        self.norm_slots = grads.NormSlots(self.specs, cfg.model)  # the gradient norm per model layer
        self.memory = PeakMemory(ctx.device)
        self.released = False  # set when a re-pack took all this rank's layers away
        # parallel.shard = "full": every unit sharded over this stage's replicas (dynmo.runtime.fsdp)
        self.mesh = fsdp.mesh_of(ctx.dp_group, ctx.device) if cfg.parallel.shard == "full" else None
        # parallel.ep > 1: every MoE layer keeps only this rank's experts (dynmo.runtime.experts)
        self.ep = experts.group_of(ctx, slots=cfg.parallel.expert_slots)
        self.layers: dict[int, nn.Module]
        self.hf_read: tuple[int, int] | None  # tensors and bytes read from model.hf_path
        self.layers, self.hf_read = build_layers(cfg, ctx.device, self.specs, self._my_layers(layout), self.ep, self.mesh)
        self.tie = tied_embeddings(cfg.model, self.specs, ctx, self.placement)  # None unless model.tie_embeddings
        self.optimizer = self._new_optimizer()
        # objects with prepare_layer/pack_layer/unpack_layer (dynamic-model cases): the per-layer
        # structure and state that must travel with a migrating layer
        self.layer_extras: list = []
        self._build_schedule()

    # ---- placement --------------------------------------------------------------------
    def _check_layout(self, layout: Layout) -> None:
        n = len(self.specs)
        if layout.num_layers != n:
            raise LayoutError(f"layout {layout} covers {layout.num_layers} layers, the model has {n}")
        if layout.num_stages != self.num_stages:
            raise LayoutError(
                f"layout {layout} has {layout.num_stages} stages, the pipeline has {self.num_stages} "
                f"(pp={self.ctx.pp} x virtual_stages={self.cfg.parallel.virtual_stages})"
            )

    def my_stages(self, layout: Layout | None = None) -> list[int]:
        return [s for s in range((layout or self.layout).num_stages) if self.placement[s] == self.ctx.pp_rank]

    def _my_layers(self, layout: Layout) -> list[int]:
        return [i for s in self.my_stages(layout) for i in layout.layers(s)]

    def _named_layers(self) -> dict[str, nn.Module]:
        return {self.specs[i].name: self.layers[i] for i in sorted(self.layers)}

    def layer_ranks(self, layout: Layout) -> list[int]:
        """Pipeline rank holding each layer."""
        return [self.placement[s] for s in layout.owner()]

    # ---- build ------------------------------------------------------------------------
    def _build_schedule(self) -> None:
        self.stages: list[TimedPipelineStage] = build_stages(
            self.cfg, self.ctx, self.specs, self.layers, self.layout, self.my_stages(), self.microbatch,
            dtype=self.dtype, recompute=self.recompute, half_carry=self.half_carry)
        self.schedule = build_schedule(self.schedule_info, self.stages, self.microbatches)

    # ---- one step ---------------------------------------------------------------------
    def train_step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
        if self.cfg.train.cuda_graphs:
            mark_step()
        for st in self.stages:
            st.reset_timers()
        self.memory.reset()
        losses: list[torch.Tensor] = []
        self.schedule.step(inputs.to(self.ctx.device), target=targets.to(self.ctx.device), losses=losses)
        t_sched = time.perf_counter() - t0
        grads.scale_grads(self.layers, self.microbatches)
        if self.tie is not None:  # both copies of a tied embedding get g_E + g_L
            self.tie.sum_grads(self.layers)
        if self.mesh is None:  # sharded units: FSDP reduce-scattered and averaged them already
            grads.sync_data_parallel(self.layers, self.ctx)
        grad_norm, _ = grads.clip_grads(self.layers, self.norm_slots, self.tie, self.ctx, self.cfg.train.grad_clip,
                                        sharded=self.mesh is not None)
        lr = optim.lr_at(step, self.cfg.train)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        state_bytes = self.layer_state_bytes()  # grads still allocated: the step's peak
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult.of_stages(self.stages, losses, t0, t_sched, grad_norm, state_bytes, self.memory)

    def layer_state_bytes(self) -> dict[int, int]:
        """Bytes each local layer holds: weights, gradients and optimizer state."""
        return {i: optim.layer_state_bytes(self.optimizer, layer) for i, layer in self.layers.items()}

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations stage `stage` holds at its peak (an estimate)."""
        return in_flight(self.schedule_info.name, self.microbatches, self.num_stages, stage)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        if self.cfg.train.cuda_graphs:
            mark_step()
        with forward_only(self.schedule):
            self.schedule.eval(inputs.to(self.ctx.device), target=targets.to(self.ctx.device), losses=losses)
        return float(sum(l.item() for l in losses)) / len(losses) if losses else None

    # ---- migration ----------------------------------------------------------------------
    def relayout(self, new: Layout, microbatches: int | None = None) -> MigrationReport:
        """Move layers so that `new` holds. Call on every active rank between two steps.

        A layout with fewer stages than the pipeline is a re-pack (one stage per rank only):
        stage j goes to pipeline position j, the positions past the last stage hand over all
        their layers and are released; every data-parallel replica shrinks alike.
        `microbatches` re-tunes the microbatch count (a re-pack may allow fewer).
        """
        repack = new.num_stages < self.num_stages
        if repack:
            if self.cfg.parallel.virtual_stages != 1:
                raise LayoutError("re-packing onto fewer stages needs one stage per rank (gpipe or 1f1b)")
            keep = list(range(new.num_stages))
            if new.num_layers != len(self.specs):
                raise LayoutError(f"layout {new} covers {new.num_layers} layers, the model has {len(self.specs)}")
            dst_rank = [keep[s] for s in new.owner()]
        else:
            self._check_layout(new)
            dst_rank = self.layer_ranks(new)
        old = self.layout
        report = MigrationReport(list(old.boundaries), list(new.boundaries))
        if new == old and microbatches in (None, self.microbatches):
            return report
        t0 = time.perf_counter()
        states = self.optimizer_states()
        exchange_layers(self.specs, self.layers, states, self.layer_ranks(old), dst_rank, old, new, self.ctx,
                        self.cfg.model, self.layer_extras, report, mesh=self.mesh, ep=self.ep)
        self.layout = new
        if repack:
            report.released = released_ranks(self.ctx, keep)
            ctx = self.ctx.shrink(keep)
            if ctx is None:  # released: this rank holds nothing any more
                self.released, self.stages, self.schedule = True, [], None
                self.optimizer = None
                report.seconds = time.perf_counter() - t0
                return report
            self.ctx = ctx
            self.ep, self.mesh = regroup(ctx, self.ep, self.mesh, self.layers)
            self.num_stages = new.num_stages
            self.placement = stage_to_rank(self.num_stages, ctx.pp, self.schedule_info.placement)
            self.tie = tied_embeddings(self.cfg.model, self.specs, ctx, self.placement)  # the head's rank moved
        if microbatches is not None:
            self.set_microbatches(microbatches)
        self.rebuild_optimizer(states)
        self._build_schedule()
        report.seconds = time.perf_counter() - t0
        return report

    def replace_experts(self, new: dict[str, tuple[int, ...]]) -> dict:
        """Move the experts of the MoE layers named in `new` ({layer name: order}) to those
        placements (`experts.apply_placement`), weights, gradients and AdamW state. Call on every
        active rank between two steps, with the same `new`. Returns the `replacement` event:
        the bytes moved (summed over the ranks) and the seconds (the slowest rank's)."""
        return replace_experts(self.layers, self.specs, self.optimizer, self.ep, self.ctx, self.cfg.model, new)

    def optimizer_states(self) -> dict[int, dict]:
        """{local layer index: its AdamW state by parameter name}, to carry across a rebuild."""
        return {i: optim.layer_state(self.optimizer, layer) for i, layer in self.layers.items()}

    def rebuild_optimizer(self, states: dict[int, dict]) -> None:
        """A new optimizer over the local layers as they are now (layers arrived or left,
        parameters replaced or frozen), carrying `states` (from `optimizer_states`)."""
        self.optimizer = self._new_optimizer()
        for i, layer in self.layers.items():
            optim.load_layer_state(self.optimizer, layer, states.get(i, {}))

    def _new_optimizer(self):
        """AdamW over the local layers; with `parallel.shard = "optimizer"` its state holds this
        replica's rows of each parameter (`dynmo.runtime.zero`)."""
        ctx = self.ctx
        return zero.build(self._named_layers(), self.cfg.train, ctx.device, self.cfg.parallel.shard, ctx.dp,
                          ctx.dp_rank, ctx.dp_group)

    def set_microbatches(self, m: int) -> None:
        local = self.cfg.train.global_batch // self.ctx.dp
        if m < 1 or local % m:
            raise ValueError(f"{m} microbatches do not divide the local batch of {local} sequences")
        self.microbatches = m
        self.microbatch = local // m
