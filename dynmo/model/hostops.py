"""How many aten operators one microbatch's forward and backward dispatches: the host's work.

In eager mode every aten operator is at least one kernel launch on a GPU, so the number a model
dispatches per microbatch bounds how fast the host can feed the device, whatever its size. The
count is exact and needs no clock: `count_step(cfg)` builds the whole model from its config
(embedding -> blocks -> head), runs one microbatch forward, the loss and the backward under a
`TorchDispatchMode`, and counts every operator that is not a view (views launch nothing).

The same recorder lists the operators that make the host wait for the device (`SYNC_OPS`: a
scalar read, `nonzero`, boolean indexing, `masked_select`, `repeat_interleave` without its
`output_size`, `unique`, `bincount`), so a test can prove a training step holds none.

`benchmarks/host_ops.py` prints the counts per config; `with_overrides` gives the size they are
quoted at (d_model 64, 4 heads, 128 tokens, batch 2).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that read a device value on the host (or whose output shape is the data's).
SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select",
    "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::bincount", "aten::is_nonzero",
})
QUOTED = ["--model.d_model", "64", "--model.n_heads", "4", "--model.seq_len", "128"]  # the quoted size
BATCH = 2


def _name(func) -> str:
    return func._schema.name


def _is_sync(func, args, kwargs) -> bool:
    name = _name(func)
    if name in SYNC_OPS:
        return True
    if name == "aten::repeat_interleave":  # without output_size the output's length is a device sum
        return func._overloadname.startswith("Tensor") and kwargs.get("output_size") is None
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t is not None and t.dtype == torch.bool for t in indices)
    return False


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten operators dispatched inside it (`ops`, by name) and records the
    synchronising ones (`syncs`); with `strict` it raises on the first synchronising one."""

    def __init__(self, strict: bool = False):
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.strict = strict

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view:
            self.ops[_name(func)] += 1
        if _is_sync(func, args, kwargs):
            self.syncs[_name(func)] += 1
            if self.strict:
                raise AssertionError(f"{func} synchronises the host with the device in a training step")
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@dataclass
class StepCount:
    ops: Counter = field(default_factory=Counter)  # non-view aten operators by name
    syncs: Counter = field(default_factory=Counter)  # the synchronising ones among them

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def build_model(cfg, device: torch.device | str = "cpu") -> list[torch.nn.Module]:
    """Every layer of the model `cfg` (a `dynmo.config.Config`), in order, as a pipeline builds them."""
    from dynmo.model.layers import build_layer, layer_specs

    return [build_layer(s, cfg.model, cfg.train.seed, device) for s in layer_specs(cfg.model)]


def microbatch_step(layers, tokens: torch.Tensor) -> torch.Tensor:
    """One microbatch's forward (embedding, blocks, head), loss and backward; returns the loss."""
    from dynmo.model.gpt import loss_fn

    out = (tokens[:, :-1],)
    for layer in layers:
        out = layer(*out)
        out = out if isinstance(out, tuple) else (out,)
    loss = loss_fn(out[0], tokens[:, 1:])
    loss.backward()
    return loss.detach()


def count_step(cfg, batch: int = BATCH, strict: bool = False, layers=None) -> StepCount:
    """The operators of one microbatch step of `cfg`'s model (`microbatch_step`), counted on its
    second call: the first one may probe kernels once (`dynmo.model.grouped`) or compile, and
    the second accumulates into the gradients the first left, as a step's later microbatches do."""
    layers = build_model(cfg) if layers is None else layers
    gen = torch.Generator().manual_seed(0)
    device = next(layers[0].parameters()).device
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=gen).to(device)
    microbatch_step(layers, tokens)  # the counted one then accumulates into the gradients, as a step's later microbatches do
    rec = OpCounter(strict=strict)
    with rec:
        microbatch_step(layers, tokens)
    return StepCount(rec.ops, rec.syncs)


def quoted_config(path, overrides: list[str] | None = None):
    """The config at `path` at the size the counts are quoted at (`QUOTED`), plus `overrides`."""
    from dynmo.config import load_config

    return load_config(path, QUOTED + list(overrides or []))
