"""Constant tensors, made once per value, shape, dtype and device and handed out again.

A training step that fills the same constant every microbatch (an auxiliary loss's gradient
seed, a zero tensor to scatter a routing target into) launches a kernel for it each time; a
constant made once launches none. Nothing may write into a tensor handed out here: callers use
it as an operand or scatter into it out of place. Inside a compiled graph it is made anew,
where it is the graph's own constant.
"""

from __future__ import annotations

import torch

_CACHE: dict[tuple, torch.Tensor] = {}


def full(value: float, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` filled with `value`, the same object for the same arguments (never
    write into it)."""
    shape = tuple(shape)
    if torch.compiler.is_compiling():
        return torch.full(shape, value, dtype=dtype, device=device)
    key = (value, shape, dtype, torch.device(device))
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = torch.full(shape, value, dtype=dtype, device=device)
    return t
