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
import torch.distributed as dist
import torch.nn as nn

from dynmo import plan
from dynmo.config import Config
from dynmo.layout import Layout, LayoutError
from dynmo.model.gpt import loss_fn
from dynmo.model.hf import HFReader, load_layer
from dynmo.model.layers import LayerSpec, build_layer, empty_layer, layer_specs
from dynmo.runtime import faults, optim
from dynmo.runtime.dist import DistContext
from dynmo.runtime.memory import PeakMemory
from dynmo.runtime.schedules import schedule_class
from dynmo.runtime.tie import tied_embeddings
from dynmo.schedules import get_schedule, in_flight, stage_to_rank
from dynmo.runtime.stage import StageModule, TimedPipelineStage, example_io
from dynmo.runtime.transfer import Packet, recv_packet, send_packet


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


@dataclass
class MigrationReport:
    old: list[int]
    new: list[int]
    moves: list[dict] = field(default_factory=list)  # {"layer", "name", "from", "to"} (stages)
    bytes: int = 0  # payload bytes received by this rank (summed over ranks in the metrics)
    seconds: float = 0.0
    released: list[int] = field(default_factory=list)  # global ranks released by a re-pack

    def as_event(self) -> dict:
        return {
            "type": "migration",
            "old": self.old,
            "new": self.new,
            "layers_moved": len(self.moves),
            "moves": self.moves,
            "bytes": self.bytes,
            "seconds": self.seconds,
        } | ({"released_ranks": self.released} if self.released else {})


def compute_dtype(cfg: Config) -> torch.dtype:
    """The dtype layers compute in and activations travel in (`train.dtype`); parameters,
    gradients and optimizer state stay float32 either way."""
    return torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32


class Pipeline:
    def __init__(self, cfg: Config, ctx: DistContext, layout: Layout):
        self.cfg, self.ctx = cfg, ctx
        self.specs: list[LayerSpec] = layer_specs(cfg.model)
        self.schedule_info = get_schedule(cfg.parallel.schedule)
        self.num_stages = ctx.pp * cfg.parallel.virtual_stages
        self.placement = stage_to_rank(self.num_stages, ctx.pp, self.schedule_info.placement)
        self._check_layout(layout)
        self.layout = layout
        self.microbatches = cfg.train.microbatches  # per replica per step; re-tuned after a re-pack
        self.microbatch = cfg.train.global_batch // ctx.dp // cfg.train.microbatches
        # numerics and memory, per layer wherever it sits (dynmo.runtime.stage)
        self.dtype = compute_dtype(cfg)
        self.recompute = frozenset(b + 1 for b in plan.recompute_blocks(cfg))  # layer indices
        self.memory = PeakMemory(ctx.device)
        self.released = False  # set when a re-pack took all this rank's layers away
        self.hf_read: tuple[int, int] | None = None  # tensors and bytes read from model.hf_path
        self.layers: dict[int, nn.Module] = self._build_layers(self._my_layers(layout))
        self.tie = tied_embeddings(cfg.model, self.specs, ctx, self.placement)  # None unless model.tie_embeddings
        self.optimizer = optim.build_optimizer(self._named_layers(), cfg.train, ctx.device)
        # objects with prepare_layer/pack_layer/unpack_layer (dynamic-model cases): the per-layer
        # structure and state that must travel with a migrating layer
        self.layer_extras: list = []
        self._build_schedule()

    def _build_layers(self, indices: list[int]) -> dict[int, nn.Module]:
        """This rank's layers at start-up: seeded from (seed, index), or read from a Hugging Face
        checkpoint (`model.hf_path`: only these layers' tensors are read)."""
        m, dev = self.cfg.model, self.ctx.device
        if not m.hf_path:
            return {i: build_layer(self.specs[i], m, self.cfg.train.seed, dev) for i in indices}
        layers = {}
        with HFReader(m.hf_path) as reader:
            for i in indices:
                layers[i] = empty_layer(self.specs[i], m, dev)
                load_layer(layers[i], self.specs[i], m, reader)
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
            module = StageModule([self.specs[i].name for i in idx], [self.layers[i] for i in idx], idx,
                                 profile=self.cfg.balance.profile, device=self.ctx.device, dtype=self.dtype,
                                 recompute=self.recompute)
            inputs, outputs = example_io(s == 0, s == self.num_stages - 1, self.microbatch, m.seq_len, m.d_model,
                                         m.vocab_size, self.ctx.device, self.dtype)
            self.stages.append(
                TimedPipelineStage(
                    module,
                    s,
                    self.num_stages,
                    self.ctx.device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.ctx.pp_group,
                )
            )
        stage_arg = self.stages if self.schedule_info.multi_stage else self.stages[0]
        # scale_grads=False: the division by the number of microbatches is ours (_scale_grads)
        self.schedule = schedule_class(self.schedule_info)(stage_arg, self.microbatches, loss_fn=loss_fn,
                                                           scale_grads=False)

    # ---- one step ---------------------------------------------------------------------
    def train_step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
        for st in self.stages:
            st.reset_timers()
        self.memory.reset()
        losses: list[torch.Tensor] = []
        self.schedule.step(inputs.to(self.ctx.device), target=targets.to(self.ctx.device), losses=losses)
        t_sched = time.perf_counter() - t0
        self._scale_grads()
        if self.tie is not None:  # both copies of a tied embedding get g_E + g_L
            self.tie.sum_grads(self.layers)
        self._sync_data_parallel_grads()
        grad_norm, scale = self._clip_grads()
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
        out = {}
        for i, layer in self.layers.items():
            total = 0
            for p in layer.parameters():
                total += p.numel() * p.element_size()
                if p.grad is not None:
                    total += p.grad.numel() * p.grad.element_size()
                for v in self.optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        total += v.numel() * v.element_size()
            out[i] = total
        return out

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations stage `stage` holds at its peak (an estimate)."""
        return in_flight(self.schedule_info.name, self.microbatches, self.num_stages, stage)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for i in sorted(self.layers) for p in self.layers[i].parameters() if p.grad is not None]

    def _scale_grads(self) -> None:
        """The one place gradients are scaled for the microbatches. The objective of a step is
        the mean over its microbatches (and data-parallel replicas) of each microbatch's loss
        plus its auxiliary losses. Each microbatch back-propagates its loss unscaled, and each
        auxiliary loss seeds its own gradient with its coefficient (`dynmo.model.aux_loss`), so
        no layer needs to know the microbatch count; the summed gradients are divided here by
        the number of microbatches, and by the number of replicas in the data-parallel
        reduction (`_sync_data_parallel_grads`)."""
        for g in self._grads():
            g.div_(self.microbatches)

    def _sync_data_parallel_grads(self) -> None:
        if self.ctx.dp_group is None:
            return
        grads = self._grads()
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.ctx.dp_group)
        flat.div_(self.ctx.dp)
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()

    def _clip_grads(self) -> tuple[float, float]:
        sq = torch.zeros(len(self.specs), dtype=torch.float32, device=self.ctx.device)
        for i, layer in self.layers.items():
            skip = self.tie.norm_skip(i) if self.tie is not None else ()  # a tied tensor counts once
            sq[i] = optim.layer_sq_norm(layer, skip).to(self.ctx.device)
        if self.ctx.pp > 1:
            # each entry is non-zero on exactly one rank, so the sum is exact
            dist.all_reduce(sq, group=self.ctx.pp_group)
        total, scale = optim.clip_coefficient(sq.cpu(), self.cfg.train.grad_clip)
        if scale != 1.0:
            for g in self._grads():
                g.mul_(scale)
        return total, scale

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
        src_rank = self.layer_ranks(old)
        old_owner, new_owner = old.owner(), new.owner()
        me, group, dev = self.ctx.pp_rank, self.ctx.pp_group, self.ctx.device
        # Every rank walks the same global order, so each blocking send meets its receive.
        for i in range(len(self.specs)):
            src, dst = src_rank[i], dst_rank[i]
            a, b = old_owner[i], new_owner[i]
            if a != b or src != dst:
                report.moves.append({"layer": i, "name": self.specs[i].name, "from": a, "to": b})
            if src == dst:
                continue  # same rank (maybe another virtual stage of it): nothing to ship
            if me == src:
                send_packet(self._pack_layer(i, states.pop(i)), dst, group, dev)
                del self.layers[i]
                faults.point("migration")
            elif me == dst:
                pkt = recv_packet(src, group, dev)
                report.bytes += pkt.nbytes  # counted where received: a released sender leaves
                self.layers[i], states[i] = self._unpack_layer(pkt)
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
            self.num_stages = new.num_stages
            self.placement = stage_to_rank(self.num_stages, ctx.pp, self.schedule_info.placement)
            self.tie = tied_embeddings(self.cfg.model, self.specs, ctx, self.placement)  # the head's rank moved
        if microbatches is not None:
            self.set_microbatches(microbatches)
        self.rebuild_optimizer(states)
        self._build_schedule()
        report.seconds = time.perf_counter() - t0
        return report

    def optimizer_states(self) -> dict[int, dict]:
        """{local layer index: its AdamW state by parameter name}, to carry across a rebuild."""
        return {i: optim.layer_state(self.optimizer, layer) for i, layer in self.layers.items()}

    def rebuild_optimizer(self, states: dict[int, dict]) -> None:
        """A new optimizer over the local layers as they are now (layers arrived or left,
        parameters replaced or frozen), carrying `states` (from `optimizer_states`)."""
        self.optimizer = optim.build_optimizer(self._named_layers(), self.cfg.train, self.ctx.device)
        for i, layer in self.layers.items():
            optim.load_layer_state(self.optimizer, layer, states.get(i, {}))

    def set_microbatches(self, m: int) -> None:
        local = self.cfg.train.global_batch // self.ctx.dp
        if m < 1 or local % m:
            raise ValueError(f"{m} microbatches do not divide the local batch of {local} sequences")
        self.microbatches = m
        self.microbatch = local // m

    def _pack_layer(self, i: int, state: dict) -> Packet:
        layer = self.layers[i]
        tensors = {f"w.{k}": v for k, v in layer.state_dict().items()}
        for n, p in layer.named_parameters():
            if p.grad is not None:
                tensors[f"g.{n}"] = p.grad
            for k, v in state.get(n, {}).items():
                tensors[f"o.{n}.{k}"] = v
        for ex in self.layer_extras:
            tensors |= {f"x.{ex.name}.{k}": v for k, v in ex.pack_layer(i, layer).items()}
        return Packet({"spec": self.specs[i]}, tensors)

    def _unpack_layer(self, pkt: Packet) -> tuple[nn.Module, dict]:
        spec: LayerSpec = pkt.header["spec"]
        self.specs[spec.index] = spec
        layer = empty_layer(spec, self.cfg.model, self.ctx.device)
        for ex in self.layer_extras:  # structure first (e.g. an exit classifier), so the weights fit
            ex.prepare_layer(spec.index, layer)
        weights = {k[2:]: v for k, v in pkt.tensors.items() if k.startswith("w.")}
        layer.load_state_dict(weights, strict=True)
        params = dict(layer.named_parameters())
        state: dict[str, dict] = {}
        for k, v in pkt.tensors.items():
            if k.startswith("g."):
                params[k[2:]].grad = v
            elif k.startswith("o."):
                pname, key = k[2:].rsplit(".", 1)
                state.setdefault(pname, {})[key] = v
        for ex in self.layer_extras:
            pre = f"x.{ex.name}."
            ex.unpack_layer(spec.index, layer, {k[len(pre):]: v for k, v in pkt.tensors.items() if k.startswith(pre)})
        return layer, state
