"""Grouped expert matmuls: rows sorted by expert, one matrix product per stacked expert weight.

`grouped_mm(x, w, offs)` multiplies the rows of x [R, K] by the weights w [G, K, N] of their group:
group g holds rows offs[g-1] .. offs[g] - 1 (offs: int32 cumulative counts, on x's device). Rows
past offs[-1] are rows nobody computes (assignments dropped by the capacity or the mask): their
outputs, and the gradients `grouped_mm` gives them, are undefined, and the caller keeps both
away from everything else (`dispatch_grouped` and `add_group_bias` send them to spare rows).

Where the installed torch has `torch._grouped_mm` (CPU and CUDA from torch 2.9) for the device,
dtype, layout and sizes (probed once each), one call covers every expert with no host
synchronisation; elsewhere (torch < 2.9, a dtype, layout or alignment it rejects) an exact
per-expert loop, which reads the offsets on the host once per call. `_grouped_mm` equals that
loop bitwise on CPU, forward and backward; it is not an autocast op, so under autocast both run
in the autocast dtype, as `bmm` would.

`dispatch_grouped` is the MoE layer's default expert compute: the kept assignments sorted by
expert (a stable argsort over fixed-length keys: a dropped assignment sorts last), each expert
weight applied once by `experts.grouped(x, offs, idx)`, and the gate-weighted outputs added back
to their tokens by `index_add`. Its cost is the kept assignments, whatever the routing's skew.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm") and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)
_WORKS: dict[tuple, bool] = {}  # (device, dtype, weight layout, in, out) -> whether _grouped_mm runs it, both ways


def _key(x: torch.Tensor, w: torch.Tensor) -> tuple:
    return x.device.type, x.dtype, w.stride(-1) == 1, w.shape[-2], w.shape[-1]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _probe(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `_grouped_mm` runs forward and backward for x's device and dtype and w's layout and
    sizes (alignment rules differ by device): a call on 32 rows and 2 groups, once per key (a
    failure of the backward could not be caught in the real call). The first call may come under
    no_grad, autocast, or inside a checkpointed block's forward: the probe's own autograd graph
    keeps its tensors away from the caller's saved-tensor hooks (a checkpoint counts what its
    forward saved, and the recomputation, which finds the key known, saves fewer) and from the
    profiler's count of a layer's activations."""
    K, N = w.shape[-2:]
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(x.device.type, enabled=False), \
                torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            a = torch.ones(32, K, device=x.device, dtype=x.dtype, requires_grad=True)
            b = torch.ones(2, K, N, device=x.device, dtype=x.dtype)
            b = (b if w.stride(-1) == 1 else b.transpose(1, 2).contiguous().transpose(1, 2)).requires_grad_()
            offs = torch.tensor([16, 32], device=x.device, dtype=torch.int32)
            y = torch._grouped_mm(a, b, offs=offs)
            y.backward(torch.ones_like(y))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def uses_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_mm(x, w, ...)` runs as one `torch._grouped_mm` (else the per-expert loop)."""
    if not HAS_GROUPED_MM:
        return False
    key = _key(x, w)
    if key not in _WORKS:
        _WORKS[key] = _probe(x, w)
    return _WORKS[key]


def probe(w: torch.Tensor, dtype: torch.dtype) -> bool:
    """`uses_grouped_mm` for rows in `dtype` times w [G, K, N] as `grouped_mm` receives it, run
    now: a compiled caller asks this first, since the probe cannot run inside a graph."""
    return uses_grouped_mm(torch.empty(0, w.shape[-2], device=w.device, dtype=dtype), w)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[R, N]: row i of x [R, K] times w[g] [K, N] of its group g (module docstring)."""
    if torch.is_autocast_enabled(x.device.type):
        dt = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dt), w.to(dt)
    if uses_grouped_mm(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    return loop_mm(x, w, offs)


def loop_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` by a loop over the groups, one matmul each (rows past the last offset: zeros)."""
    ends = offs.tolist()  # the one host read of the fallback
    parts, start = [], 0
    for g, end in enumerate(ends):
        parts.append(x[start:end] @ w[g])
        start = end
    parts.append(x.new_zeros(x.shape[0] - start, w.shape[-1]))
    return torch.cat(parts)


class GroupRows(NamedTuple):
    """The experts of rows sorted by expert, as the bias additions use them: `onehot` [R, E] (a
    row of idx E, nobody's: zeros) in the rows' dtype and `spare` [R, 1] (True for those rows;
    None where the caller knows there is none), built once for all the biases of one expert MLP."""

    onehot: torch.Tensor
    spare: torch.Tensor | None

    @staticmethod
    def of(idx: torch.Tensor, E: int, dtype: torch.dtype, spare: bool = True) -> "GroupRows":
        onehot = (idx.unsqueeze(1) == torch.arange(E, device=idx.device)).to(dtype)
        return GroupRows(onehot, (idx == E).unsqueeze(1) if spare else None)


class _GroupBias(torch.autograd.Function):
    """y [R, out] + bias[idx] (bias [E, out]; idx [R], E: a row nobody computes, no bias). The
    forward is one matmul with the rows' one-hot experts (cheaper than a gather and an add), the
    backward the transposed one over the gradient with the rows of idx E zeroed first (their
    gradients may be undefined, and a matmul would spread a NaN over every expert)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor, onehot: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(onehot, spare)
        ctx.bias_dtype = bias.dtype
        return torch.addmm(y, onehot.to(y.dtype), bias.to(y.dtype))  # exact: one 1 and zeros a row

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        onehot, spare = ctx.saved_tensors
        kept = g if spare is None else g.masked_fill(spare, 0)  # a row nobody computes may hold NaN
        grad_bias = onehot.to(g.dtype).t() @ kept  # a matmul, not an index_add: no atomics (slow in bf16 on a GPU)
        return g, grad_bias.to(ctx.bias_dtype), None, None


def add_group_bias(y: torch.Tensor, bias: torch.Tensor, idx: "torch.Tensor | GroupRows") -> torch.Tensor:
    """y + bias[idx], no bias for rows of idx E = bias.shape[0] (`_GroupBias`); `idx` may be the
    rows' `GroupRows`, built once for several biases."""
    rows = idx if isinstance(idx, GroupRows) else GroupRows.of(idx, bias.shape[0], y.dtype)
    return _GroupBias.apply(y, bias, rows.onehot, rows.spare)


def dispatch_grouped(x: torch.Tensor, r, experts) -> torch.Tensor:
    """Run `experts.grouped` on the kept assignments of the routing `r` (`dynmo.model.moe.Routing`)
    over the tokens x [N, D], rows sorted by expert, and return each token's gate-weighted sum of
    its experts' outputs [N, D] (zeros for a token with none). No host synchronisation.

    Every assignment keeps a row (fixed shapes); a dropped one sorts last, past the grouped
    matmuls' last offset, reads a spare zero token N and adds its (undefined) output, weighted 0,
    into a spare output row N that is cut off, so neither its output nor its gradients reach
    anything."""
    N, E = x.shape[0], r.kept.shape[0]
    key = torch.where(r.keep, r.expert, E)
    order = torch.argsort(key, stable=True)  # by expert, then in routing order; dropped ones last
    idx = key[order]
    token = torch.where(r.keep, r.token, N)[order]
    xs = torch.cat([x, x.new_zeros(1, x.shape[1])])[token]
    offs = torch.cumsum(r.kept, 0).to(torch.int32)
    y = experts.grouped(xs, offs, idx)
    w = torch.where(r.keep, r.weight, 0.0)[order]
    y = y * w.unsqueeze(1)  # in the experts' dtype promoted, as the padded path
    return y.new_zeros(N + 1, y.shape[1]).index_add(0, token, y)[:N]
