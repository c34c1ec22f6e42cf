"""A stage's module (its contiguous layers) and a PipelineStage that times its compute."""

from __future__ import annotations

import time

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage


class StageModule(nn.Module):
    """Runs layers `first .. first + len(layers) - 1` in order.

    Keys of `self.layers` are the stable layer names (embed, block3, head), so parameter
    names are the same wherever a layer lives.
    """

    def __init__(self, names: list[str], layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict(dict(zip(names, layers)))

    def forward(self, *args):
        out = args
        for layer in self.layers.values():
            out = layer(*out)
            if not isinstance(out, tuple):
                out = (out,)
        return out[0] if len(out) == 1 else out


class TimedPipelineStage(PipelineStage):
    """PipelineStage that adds up the seconds it spends computing (not waiting or sending).

    compute_s covers forward, full/input backward and weight backward of every microbatch.
    """

    compute_s: float = 0.0

    def reset_timers(self) -> None:
        self.compute_s = 0.0

    def forward_one_chunk(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - t

    def backward_one_chunk(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - t

    def backward_weight_one_chunk(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - t


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
