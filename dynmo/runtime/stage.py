"""A stage's module (its contiguous layers) and a PipelineStage that times its compute.

Per-layer timing, cheap enough for every step (a perf_counter per layer per microbatch):
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
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage


class StageModule(nn.Module):
    """Runs its layers in order; keys are the stable layer names (embed, block3, head)."""

    def __init__(self, names: list[str], layers: list[nn.Module], indices: list[int]):
        super().__init__()
        self.layers = nn.ModuleDict(dict(zip(names, layers)))
        self.indices = indices  # global layer index of each local layer
        self.fwd_s = [0.0] * len(indices)  # summed over the step's microbatches
        self.bwd_s = [0.0] * len(indices)
        self.wgrad_s = 0.0
        self._mark = 0.0

    def reset_timers(self) -> None:
        self.fwd_s = [0.0] * len(self.indices)
        self.bwd_s = [0.0] * len(self.indices)
        self.wgrad_s = 0.0

    def forward(self, *args):
        out = args
        hooks = torch.is_grad_enabled()
        if hooks and isinstance(out[0], torch.Tensor) and out[0].requires_grad:
            self._hook(out[0], 0)  # the stage input: its gradient closes layer 0's backward
        t = time.perf_counter()
        last = len(self.indices) - 1
        for k, layer in enumerate(self.layers.values()):
            out = layer(*out)
            if not isinstance(out, tuple):
                out = (out,)
            now = time.perf_counter()
            self.fwd_s[k] += now - t
            t = now
            if hooks and k < last and out[0].requires_grad:
                self._hook(out[0], k + 1)
        return out[0] if len(out) == 1 else out

    def _hook(self, tensor: torch.Tensor, layer_pos: int) -> None:
        """When `tensor`'s gradient is ready, the backward of local layer `layer_pos` is done."""
        handle = None

        def fire(grad):
            now = time.perf_counter()
            self.bwd_s[layer_pos] += now - self._mark
            self._mark = now
            handle.remove()  # one-shot: receive buffers are reused across microbatches

        handle = tensor.register_hook(fire)

    def begin_backward(self) -> None:
        self._mark = time.perf_counter()

    def end_backward(self) -> None:
        # Whatever ran after the last boundary hook belongs to the first local layer.
        self.bwd_s[0] += time.perf_counter() - self._mark

    def layer_times(self) -> dict[int, tuple[float, float]]:
        """{global layer index: (forward s, backward s)} summed over the step's microbatches."""
        bwd = list(self.bwd_s)
        if self.wgrad_s:
            total = sum(bwd)
            share = [b / total if total > 0 else 1 / len(bwd) for b in bwd]
            bwd = [b + self.wgrad_s * s for b, s in zip(bwd, share)]
        return {i: (f, b) for i, f, b in zip(self.indices, self.fwd_s, bwd)}


class TimedPipelineStage(PipelineStage):
    """PipelineStage that adds up the seconds it spends computing (not waiting or sending)."""

    compute_s: float = 0.0

    def reset_timers(self) -> None:
        self.compute_s = 0.0
        self.submod.reset_timers()

    def forward_one_chunk(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - t

    def backward_one_chunk(self, *args, **kwargs):
        t = time.perf_counter()
        self.submod.begin_backward()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.submod.end_backward()
            self.compute_s += time.perf_counter() - t

    def backward_weight_one_chunk(self, *args, **kwargs):
        t = time.perf_counter()
        mod = self.submod
        before = sum(mod.bwd_s)
        mod.begin_backward()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t
            if sum(mod.bwd_s) != before:
                # torch runs the first stage's whole backward here: boundary hooks fired
                mod.end_backward()
            else:
                mod.wgrad_s += dt
            self.compute_s += dt


def example_io(
    first: bool, last: bool, mb: int, seq_len: int, d_model: int, vocab: int, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Static input/output examples so a rebuilt stage needs no shape inference."""

    def hidden():
        return (
            torch.empty(mb, seq_len, d_model, device=device, requires_grad=True),
            torch.empty(mb, seq_len, dtype=torch.bool, device=device),
        )

    inputs = (torch.empty(mb, seq_len, dtype=torch.long, device=device),) if first else hidden()
    outputs = (torch.empty(mb, seq_len, vocab, device=device, requires_grad=True),) if last else hidden()
    return inputs, outputs
