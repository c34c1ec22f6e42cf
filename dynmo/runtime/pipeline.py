"""One rank's share of the pipeline: its layers, stages, schedule and optimizer.

The layout can change between any two steps (`relayout`): moved layers travel with their
weights, gradients and AdamW state, then the stages and the schedule are rebuilt. Training
after a re-layout is the same computation as without it (bitwise on CPU), because
  - every layer is built from its own seed and named by a stable name,
  - AdamW updates each parameter independently of how parameters are grouped,
  - the gradient norm is summed per layer in layer order, not per stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dynmo import plan
from dynmo.config import Config
from dynmo.layout import Layout, LayoutError
from dynmo.model.gpt import loss_fn
from dynmo.model.hf import HFReader, load_layer
from dynmo.model.layers import LayerSpec, build_layer, empty_layer, half_carry, layer_specs
from dynmo.runtime import experts, fsdp, grads, optim, zero
from dynmo.runtime.dist import DistContext
from dynmo.runtime.memory import PeakMemory
from dynmo.runtime.schedules import schedule_class
from dynmo.runtime.tie import tied_embeddings
from dynmo.schedules import get_schedule, in_flight, stage_to_rank
from dynmo.runtime.stage import StageModule, TimedPipelineStage, boundary_bools, example_io
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
        self.hf_read: tuple[int, int] | None = None  # tensors and bytes read from model.hf_path
        # parallel.shard = "full": every unit sharded over this stage's replicas (dynmo.runtime.fsdp)
        self.mesh = fsdp.mesh_of(ctx.dp_group, ctx.device) if cfg.parallel.shard == "full" else None
        # parallel.ep > 1: every MoE layer keeps only this rank's experts (dynmo.runtime.experts)
        self.ep = experts.group_of(ctx, slots=cfg.parallel.expert_slots)
        self.layers: dict[int, nn.Module] = self._build_layers(self._my_layers(layout))
        self.tie = tied_embeddings(cfg.model, self.specs, ctx, self.placement)  # None unless model.tie_embeddings
        self.optimizer = self._new_optimizer()
        # objects with prepare_layer/pack_layer/unpack_layer (dynamic-model cases): the per-layer
        # structure and state that must travel with a migrating layer
        self.layer_extras: list = []
        self._build_schedule()

    def _build_layers(self, indices: list[int]) -> dict[int, nn.Module]:
        """This rank's layers at start-up: seeded from (seed, index), or read from a Hugging Face
        checkpoint (`model.hf_path`: only these layers' tensors are read). With
        `parallel.shard = "full"` each is sharded as soon as it is built, so a rank holds one
        whole layer at a time."""
        m, dev = self.cfg.model, self.ctx.device

        def placed(layer: nn.Module, i: int) -> nn.Module:
            # built whole (the same weights), then this rank's experts under the layer's placement
            layer = experts.localize(layer, self.ep, self.specs[i].prefix)
            return layer if self.mesh is None else fsdp.shard(layer, self.mesh)

        if not m.hf_path:
            return {i: placed(build_layer(self.specs[i], m, self.cfg.train.seed, dev), i) for i in indices}
        layers = {}
        with HFReader(m.hf_path) as reader:
            for i in indices:
                layer = empty_layer(self.specs[i], m, dev)
                load_layer(layer, self.specs[i], m, reader)
                layers[i] = placed(layer, i)
        self.hf_read = (len(reader.names_read), reader.bytes_read)
        return layers

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
        m = self.cfg.model
        self.stages: list[TimedPipelineStage] = []
        for s in self.my_stages():
            idx = list(self.layout.layers(s))
            first, last = s == 0, s == self.num_stages - 1
            carry_in, carry_out = self._carry(idx[0] - 1), self._carry(idx[-1])
            module = StageModule([self.specs[i].name for i in idx], [self.layers[i] for i in idx], idx,
                                 profile=self.cfg.balance.profile, device=self.ctx.device, dtype=self.dtype,
                                 recompute=self.recompute, received=None if first else boundary_bools(carry_in),
                                 sends=not last)
            inputs, outputs = example_io(first, last, self.microbatch, m.seq_len, m.d_model, m.vocab_size,
                                         self.ctx.device, self.dtype, carry_in=carry_in, carry_out=carry_out)
            self.stages.append(TimedPipelineStage(module, s, self.num_stages, self.ctx.device, input_args=inputs,
                                                  output_args=outputs, group=self.ctx.pp_group))
        stage_arg = self.stages if self.schedule_info.multi_stage else self.stages[0]
        # scale_grads=False: the division by the number of microbatches is ours (grads.scale_grads)
        self.schedule = schedule_class(self.schedule_info)(stage_arg, self.microbatches, loss_fn=loss_fn,
                                                           scale_grads=False)

    def _carry(self, unit: int) -> tuple[str, ...]:
        """What crosses the boundary after `unit` beside (x, mask): a split block's carry when
        the unit is its attention half."""
        return self.half_carry if 0 <= unit < len(self.specs) and self.specs[unit].part == "attn" else ()

    # ---- one step ---------------------------------------------------------------------
    def train_step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
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
        return StepResult(
            loss_sum=float(sum(l.item() for l in losses)),
            loss_count=len(losses),
            schedule_s=t_sched,
            step_s=time.perf_counter() - t0,
            stage_compute_s={st.stage_index: st.compute_s for st in self.stages},
            layer_times={i: t for st in self.stages for i, t in st.submod.layer_times().items()},
            grad_norm=grad_norm,
            layer_costs={i: c for st in self.stages for i, c in st.submod.layer_costs().items()},
            layer_act_bytes={i: b for st in self.stages for i, b in st.submod.layer_act_bytes().items()},
            layer_state_bytes=state_bytes,
            profile_s=sum(st.submod.profile_s for st in self.stages),
            peak_bytes=self.memory.peak(),
        )

    def layer_state_bytes(self) -> dict[int, int]:
        """Bytes each local layer holds: weights, gradients and optimizer state."""
        return {i: optim.layer_state_bytes(self.optimizer, layer) for i, layer in self.layers.items()}

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations stage `stage` holds at its peak (an estimate)."""
        return in_flight(self.schedule_info.name, self.microbatches, self.num_stages, stage)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
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
            stay = self.ctx.shrink_ranks(keep)
            report.released = [r for r in (self.ctx.active_ranks or range(self.ctx.world)) if r not in stay]
            ctx = self.ctx.shrink(keep)
            if ctx is None:  # released: this rank holds nothing any more
                self.released, self.stages, self.schedule = True, [], None
                self.optimizer = None
                report.seconds = time.perf_counter() - t0
                return report
            self.ctx = ctx
            if self.ep is not None:  # the expert-parallel groups of the shrunk job
                self.ep = experts.group_of(ctx, self.ep.orders, self.ep.slots)
                for layer in self.layers.values():
                    experts.rebind(layer, self.ep)
            if self.mesh is not None:  # layers arriving later shard over the new group
                self.mesh = fsdp.mesh_of(ctx.dp_group, ctx.device)
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
        if self.ep is None:
            raise ValueError("moving experts needs expert parallelism (parallel.ep > 1)")
        t0 = time.perf_counter()
        old = {n: self.ep.orders.get(n) for n in new}
        names = {i: self.specs[i].prefix for i in self.layers}
        got = experts.apply_placement(self.layers, names, self.optimizer, self.ep, new)
        total = torch.tensor([float(got), time.perf_counter() - t0], dtype=torch.float64, device=self.ctx.device)
        figures = [torch.zeros_like(total) for _ in range(self.ctx.active_world)]
        torch.distributed.all_gather(figures, total, group=self.ctx.active_group)
        n = self.cfg.model.moe.num_experts
        moved = {k: experts.moved_experts(old[k] or self.ep.start(n), o, self.ep.size) for k, o in new.items()}
        return {"type": "replacement", "placements": {k: list(o) for k, o in new.items()},
                "experts_moved": {k: v for k, v in moved.items() if v},
                "bytes": int(sum(f[0] for f in figures)), "seconds": float(max(f[1] for f in figures))}

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
