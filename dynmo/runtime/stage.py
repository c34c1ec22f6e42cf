"""A stage's module (its contiguous layers) and a PipelineStage that times its compute.

Per-layer timing, cheap enough for every step (a clock mark per layer per microbatch:
perf_counter on CPU, CUDA events on GPU, resolved after the step):
  forward   time around each layer's call;
  backward  one-shot tensor hooks on every layer boundary. Backward runs the stage's layers
            last to first; the hook on layer k's output fires when its gradient is complete,
            i.e. when layer k+1's backward is done. The time from the start of the stage's
            backward to the first hook is the last layer's, the time after the last hook
            (including the stage input's gradient) is the first layer's, so per-layer times
            add up to the stage's backward time exactly.
  weight    zero-bubble schedules compute weight gradients in a separate pass that has no
            per-layer boundary; its time is shared among the stage's layers in proportion to
            their input-backward time (documented fallback).
  memory    activations saved for backward, per layer per microbatch: a saved-tensors hook
            adds up the storages autograd keeps (each storage once per forward; parameters
            excluded). The pipeline turns it into a per-stage estimate with the number of
            microbatches the schedule keeps in flight.

With `profile=False` the module runs its layers with no marks, hooks or counters (to measure
what the profiler costs).

Numerics and memory, per layer, wherever the layer sits:
  bf16      the forward runs under autocast and every layer's floating outputs are cast to
            bf16, so the activations between layers -- and so between stages -- are bf16 at
            every layer boundary, whatever the layout (a re-layout moves no rounding).
  recompute a checkpointed block runs under torch.utils.checkpoint (non-reentrant): it keeps
            only its inputs, which the memory record counts, and recomputes its forward inside
            its own backward span, so its measured backward time includes the recomputation.
            The recomputation runs with step statistics paused (a forward counted once).

What crosses a stage boundary (`example_io`): the hidden state, the token mask, then a split
block's carries (`dynmo.model.layers.CARRIES`), every one of them floating, in the compute dtype
(the bool ones as 0 / 1, which every float dtype holds exactly), every one of them in the
autograd graph, and every one of them gets a gradient back (zeros where the model takes none).
torch.distributed.pipelining before 2.13 needs all three: 2.7 to 2.11 make every receive buffer
of a stage require a gradient (an error on a bool buffer); 2.7 to 2.12 send a gradient back for
every received tensor (an error where there is none) and, in the zero-bubble schedules,
differentiate every output of a stage (an error on one outside the graph). 2.13 copes with
bool tensors and missing gradients itself. So the same tensors cross on every version: the
sending StageModule casts its bool outputs to the compute dtype (`_Sent`), the receiving one
turns them back into bool (`_Received`, whose backward hands out the zero gradients). The cost:
a [microbatch, seq] zero gradient sent back per bool tensor, and one per carry the model
takes no gradient through. Results are bitwise those of a single stage.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import checkpoint

from dynmo.dynamics.noise import LINKS
from dynmo.model import stats
from dynmo.model.layers import CARRIES


class Clock:
    """Marks and spans: perf_counter on CPU; CUDA events on GPU (kernels run asynchronously, so
    host time would measure launches). Spans are resolved once per step, after the step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class StageModule(nn.Module):
    """Runs its layers in order; keys are the stable layer names (embed, block3, head)."""

    def __init__(self, names: list[str], layers: list[nn.Module], indices: list[int], profile: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 recompute: frozenset[int] = frozenset(), received: tuple[bool, ...] | None = None,
                 sends: bool = False):
        super().__init__()
        self.layers = nn.ModuleDict(dict(zip(names, layers)))
        self.indices = indices  # global layer index of each local layer
        # stage boundaries (module docstring): `received`, per input that crossed one, whether the
        # model's tensor is bool (`boundary_bools`; None: the inputs are the model's own, e.g.
        # the tokens); `sends`: the outputs cross one, the bool ones as the compute dtype
        self.received = received
        self.sends = sends
        self.profile = profile
        device = device or torch.device("cpu")
        self.clock = Clock(device)
        # compute dtype: bf16 = autocast over the (fp32) parameters, bf16 between layers
        self.dtype = dtype
        self.autocast_device = device.type
        self.recompute = [i in recompute for i in indices]  # per local layer: checkpointed
        self.reset_timers()

    def _autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.autocast_device, dtype=self.dtype)

    def _run(self, k: int, layer: nn.Module, args: tuple) -> tuple:
        """Layer k on `args` (recomputed in backward if checkpointed); outputs as a tuple, floating
        ones in the compute dtype."""
        if self.recompute[k] and torch.is_grad_enabled():
            out = checkpoint(layer, *args, use_reentrant=False, context_fn=_recompute_context)
        else:
            out = layer(*args)
        if not isinstance(out, tuple):
            out = (out,)
        if self.dtype != torch.float32:
            out = tuple(t.to(self.dtype) if t.is_floating_point() else t for t in out)
        return out

    def reset_timers(self) -> None:
        # spans: (bucket, local layer position, microbatch, start mark, end mark); buckets f, b, w, c
        self.spans: list[tuple[str, int, int, object, object]] = []
        self.backwards = 0
        self.act_bytes = [0] * len(self.indices)  # activations saved for backward, summed over microbatches
        self.forwards = 0
        self.profile_s = 0.0  # host seconds spent in the profiler's own bookkeeping
        self._resolved: tuple[int, dict] | None = None
        self._mark = None

    def forward(self, *args):
        if self.received is not None:
            args = _Received.apply(self.received, *args)
        with self._autocast():
            out = self._forward(args) if self.profile else self._forward_plain(args)
        if self.sends:
            out = _Sent.apply(self.dtype, *out)
        return out[0] if len(out) == 1 else out

    def _forward_plain(self, args: tuple) -> tuple:
        out = args
        for k, layer in enumerate(self.layers.values()):
            out = self._run(k, layer, out)
        return out

    def _forward(self, args: tuple) -> tuple:
        out = args
        grad = torch.is_grad_enabled()
        if grad:
            self.forwards += 1
            if isinstance(out[0], torch.Tensor) and out[0].requires_grad:
                self._hook(out[0], 0)  # the stage input: its gradient closes layer 0's backward
        seen: set[int] = set()  # storages already counted in this forward (views, shared inputs)
        last = len(self.indices) - 1
        clock = self.clock
        t = clock.mark()
        for k, layer in enumerate(self.layers.values()):
            if grad:
                pack = self._packer(k, seen)
                if self.recompute[k]:  # what a checkpointed layer keeps: its inputs
                    for a in out:
                        if isinstance(a, torch.Tensor):
                            pack(a)
                with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                    out = self._run(k, layer, out)
            else:
                out = self._run(k, layer, out)
            now = clock.mark()
            self.spans.append(("f", k, self.forwards, t, now))
            t = now
            if grad and k < last and out[0].requires_grad:
                self._hook(out[0], k + 1)
        return out

    def _packer(self, k: int, seen: set[int]):
        def pack(t: torch.Tensor):
            h = time.perf_counter()
            if not (t.is_leaf and t.requires_grad):  # parameters are state, not activations
                st = t.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    self.act_bytes[k] += st.nbytes()
            self.profile_s += time.perf_counter() - h
            return t

        return pack

    def _hook(self, tensor: torch.Tensor, layer_pos: int) -> None:
        """When `tensor`'s gradient is ready, the backward of local layer `layer_pos` is done."""
        handle = None

        def fire(grad):
            now = self.clock.mark()
            self.spans.append(("b", layer_pos, self.backwards, self._mark, now))
            self._mark = now
            handle.remove()  # one-shot: receive buffers are reused across microbatches

        handle = tensor.register_hook(fire)

    def begin_backward(self) -> None:
        self.backwards += 1
        self._mark = self.clock.mark()

    def end_backward(self) -> None:
        # Whatever ran after the last boundary hook belongs to the first local layer.
        self.spans.append(("b", 0, self.backwards, self._mark, self.clock.mark()))

    def backward_spans(self) -> int:
        return sum(1 for sp in self.spans if sp[0] == "b")

    def _sums(self) -> dict[str, list[float]]:
        """Per-bucket sums (and per-microbatch times in `_per_mb`), resolved once per step:
        layer_times, layer_costs and compute_seconds all read them after the step."""
        if self._resolved is not None and self._resolved[0] == len(self.spans):
            return self._resolved[1]
        self.clock.sync()
        n = len(self.indices)
        out = {"f": [0.0] * n, "b": [0.0] * n, "w": [0.0], "c": [0.0]}
        per_mb: dict[tuple[str, int], dict[int, float]] = {}
        for bucket, k, mb, a, b in self.spans:
            dt = self.clock.seconds(a, b)
            out[bucket][k] += dt
            if bucket in "fb":
                d = per_mb.setdefault((bucket, k), {})
                d[mb] = d.get(mb, 0.0) + dt
        self._per_mb = per_mb
        self._resolved = (len(self.spans), out)
        return out

    def layer_times(self) -> dict[int, tuple[float, float]]:
        """{global layer index: (forward s, backward s)} summed over the step's microbatches."""
        sums = self._sums()
        bwd, wgrad = sums["b"], sums["w"][0]
        if wgrad:
            total = sum(bwd)
            share = [b / total if total > 0 else 1 / len(bwd) for b in bwd]
            bwd = [b + wgrad * s for b, s in zip(bwd, share)]
        return {i: (f, b) for i, f, b in zip(self.indices, sums["f"], bwd)}

    def layer_costs(self) -> dict[int, float]:
        """{global layer index: typical forward + backward seconds of one microbatch}: the median
        over the step's microbatches, so a microbatch slowed by something else on the machine
        (a preempted process, a GC pause) does not move the balancer; the weight-gradient pass
        of zero-bubble schedules is added as its per-microbatch mean share."""
        sums = self._sums()
        times = self.layer_times()
        n_mb = max(self.forwards, 1)
        out = {}
        for k, i in enumerate(self.indices):
            f = self._per_mb.get(("f", k), {})
            b = self._per_mb.get(("b", k), {})
            if not f:
                continue
            w_share = (times[i][1] - sums["b"][k]) / n_mb  # this layer's part of the wgrad pass
            out[i] = statistics.median(f.values()) + (statistics.median(b.values()) if b else 0.0) + w_share
        return out

    def compute_seconds(self) -> float:
        return self._sums()["c"][0]

    def layer_act_bytes(self) -> dict[int, float]:
        """{global layer index: activation bytes saved for backward per microbatch}."""
        n = max(self.forwards, 1)
        return {i: b / n for i, b in zip(self.indices, self.act_bytes)}


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _recompute_context():
    """torch.utils.checkpoint's (forward, recompute) contexts: the recomputation is not a new
    forward for the layers' step statistics."""
    return nullcontext(), stats.paused()


class _Sent(torch.autograd.Function):
    """What a stage hands over a boundary: its outputs, the bool ones cast to `dtype`, all of them
    part of the autograd graph (with a gradient function whenever one input needs a gradient):
    before 2.13, torch's zero-bubble schedules differentiate every output of a stage, and fail
    on one outside the graph (the cast mask, a detached carry). Backward passes the gradients
    of the floating inputs through, none to the bool ones. The floating outputs are aliases of
    the inputs, not views: torch detaches a stage's outputs in place after its backward."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *xs: torch.Tensor):
        ctx.bools = tuple(x.dtype == torch.bool for x in xs)
        return tuple(x.to(dtype) if b else x.detach() for b, x in zip(ctx.bools, xs))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *(None if b else g for b, g in zip(ctx.bools, grads)))


class _Received(torch.autograd.Function):
    """What crossed a stage boundary back as the model's tensors: each one flagged in `bools`
    becomes bool again, the rest pass unchanged (as aliases, like `_Sent`'s). Backward gives every
    received tensor a gradient: the one flowing back, zeros where none does (a bool one; a float
    one the stage does not differentiate through), so a gradient goes back for each (module
    docstring)."""

    @staticmethod
    def forward(ctx, bools: tuple[bool, ...], *xs: torch.Tensor):
        out = tuple(x.bool() if b else x.detach() for b, x in zip(bools, xs, strict=True))
        ctx.mark_non_differentiable(*(o for o, b in zip(out, bools) if b))
        ctx.zeros = [(x.shape, x.dtype, x.device) if b else None for b, x in zip(bools, xs)]
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # grads of unused float outputs arrive as zeros (materialized by autograd)
        return (None, *(g if z is None else torch.zeros(z[0], dtype=z[1], device=z[2])
                        for g, z in zip(grads, ctx.zeros)))


class TimedPipelineStage(PipelineStage):
    """PipelineStage that adds up the time it spends computing (not waiting or sending).

    Its sends go through the injected link delay (`noise.link_delay_ms`,
    `dynmo.dynamics.noise.LinkDelay`): the schedule asks for a microbatch's send ops after the
    forward or backward that produced them, outside the profiler's spans, and the stage waits
    there before handing them over to be posted. The wait is link time, never compute."""

    @property
    def compute_s(self) -> float:
        return self.submod.compute_seconds()

    def reset_timers(self) -> None:
        self.submod.reset_timers()

    def _span(self, t0) -> None:
        mod = self.submod
        mod.spans.append(("c", 0, 0, t0, mod.clock.mark()))

    def forward_one_chunk(self, *args, **kwargs):
        t = self.submod.clock.mark()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self._span(t)

    def backward_one_chunk(self, *args, **kwargs):
        mod = self.submod
        t = mod.clock.mark()
        mod.begin_backward()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            mod.end_backward()
            self._span(t)

    def _get_init_p2p_neighbors_ops(self):
        # torch 2.9 to 2.11 open the links to both neighbouring stages with a message each way
        # before the first step, to a stage on this same rank too: a send to itself, which gloo
        # cannot make. Stages on one rank hand tensors over directly, so leave those out.
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if ops:
            LINKS.wait(self.group_rank, self.stage_index_to_group_rank[self.stage_index + 1], "forward")
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if ops:
            LINKS.wait(self.group_rank, self.stage_index_to_group_rank[self.stage_index - 1], "backward")
        return ops

    def backward_weight_one_chunk(self, *args, **kwargs):
        mod = self.submod
        t = mod.clock.mark()
        before = mod.backward_spans()
        mod.begin_backward()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            if mod.backward_spans() != before:
                # torch runs the first stage's whole backward here: boundary hooks fired
                mod.end_backward()
            else:
                mod.spans.append(("w", 0, 0, t, mod.clock.mark()))
            self._span(t)


def boundary_bools(carry: tuple[str, ...] = ()) -> tuple[bool, ...]:
    """Per tensor crossing a stage boundary with `carry` (the hidden state, the token mask, then
    the carries): whether the model's tensor is bool (it crosses as the compute dtype)."""
    return (False, True) + tuple(not CARRIES[name].floating for name in carry)


def example_io(
    first: bool, last: bool, mb: int, seq_len: int, d_model: int, vocab: int, device: torch.device,
    dtype: torch.dtype = torch.float32, carry_in: tuple[str, ...] = (), carry_out: tuple[str, ...] = (),
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Static input/output examples so a rebuilt stage needs no shape inference: the tokens in,
    the logits out, and at a boundary what crosses it (module docstring): the hidden state, the
    mask, then `carry_in` / `carry_out` where the boundary falls between a block's two halves
    (names in `dynmo.model.layers.CARRIES`), all in the compute dtype and requiring a gradient,
    so that every torch version exchanges one gradient for each."""

    def boundary(carry):
        shapes = [(mb, seq_len, d_model), (mb, seq_len)]
        shapes += [(mb, seq_len, d_model) if CARRIES[name].per_feature else (mb, seq_len) for name in carry]
        return tuple(torch.empty(shape, device=device, dtype=dtype, requires_grad=True) for shape in shapes)

    inputs = (torch.empty(mb, seq_len, dtype=torch.long, device=device),) if first else boundary(carry_in)
    outputs = (torch.empty(mb, seq_len, vocab, device=device, dtype=dtype, requires_grad=True),) if last else boundary(carry_out)
    return inputs, outputs
