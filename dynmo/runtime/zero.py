"""Optimizer state sharded over a stage's data-parallel replicas (`parallel.shard = "optimizer"`,
ZeRO stage 1, as Megatron's distributed optimizer and DeepSpeed's ZeRO-1 do it).

Every replica keeps the full parameters and computes the full averaged gradients, as with no
sharding (`dynmo.runtime.grads.sync_data_parallel`, then the gradient norm and clipping over
the whole gradient). AdamW state exists only for this replica's rows of each parameter: rows
`shard_rows(n, dp, rank)` of dimension 0, split as `torch.chunk` splits them (and as DTensor's
`Shard(0)` places them, so a checkpoint stores the state as one sharded tensor per parameter).
A step updates those rows in place -- the slice is a view of the parameter -- and an
all-gather over the data-parallel group puts every replica's rows into every copy.

AdamW is elementwise, so updating rows lo:hi of a parameter computes what updating the whole
parameter computes on those rows: training is bitwise the unsharded training (fp32 on CPU).

State bytes per replica fall to about 1/dp of the moments (weights and gradients stay whole).
A migrating layer carries this replica's state rows to the same replica of its new stage
(`dynmo.runtime.migration`: data-parallel replica k of one pipeline sends to replica k of
the same pipeline), so no state is gathered to move it.

What this costs: one all-gather of the parameters per step, on top of the gradient all-reduce
(a reduce-scatter would halve the gradient traffic; gloo has none for uneven rows, so the
all-reduce stays, on every backend, to keep one path).
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping

import torch
import torch.distributed as dist
import torch.nn as nn

from dynmo.config import TrainConfig
from dynmo.runtime import optim


GATHER_BYTES = 4 * 2**20  # largest set of all-gather buffers (every replica's rows) in one step's parameter gather


def shard_rows(n: int, dp: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a dimension of size n that replica `rank` of `dp` holds: chunks of
    ceil(n / dp) rows in replica order, the last ones shorter or empty (torch.chunk's split)."""
    size = math.ceil(n / dp) if n else 0
    lo = min(rank * size, n)
    return lo, min(lo + size, n)


def _rows_view(p: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """This replica's rows of p, a view sharing p's storage (a 0-d tensor counts as one row)."""
    flat = p.detach() if p.dim() else p.detach().view(1)
    lo, hi = shard_rows(flat.shape[0], dp, rank)
    return flat[lo:hi]


class _StateByParam(MutableMapping):
    """The sharded optimizer's state keyed by the full parameters, like torch's `opt.state`:
    what `dynmo.runtime.optim` and the checkpoints read and write per parameter."""

    def __init__(self, inner: dict, slices: dict[nn.Parameter, nn.Parameter]):
        self.inner, self.slices = inner, slices

    def __getitem__(self, p):
        return self.inner[self.slices[p]]

    def __setitem__(self, p, value) -> None:
        self.inner[self.slices[p]] = value

    def __delitem__(self, p) -> None:
        del self.inner[self.slices[p]]

    def __contains__(self, p) -> bool:
        return p in self.slices and self.slices[p] in self.inner

    def get(self, p, default=None):
        return self[p] if p in self else default

    def __iter__(self):
        return (p for p, s in self.slices.items() if s in self.inner)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ShardedAdamW:
    """AdamW over this replica's rows of every trainable parameter of `layers`; `step()` updates
    them and all-gathers the parameters. Reads like a torch optimizer where the runtime uses one
    (`param_groups`, `state` keyed by parameter, `step`, `zero_grad`)."""

    def __init__(self, layers: dict[str, nn.Module], tc: TrainConfig, device: torch.device, dp: int, rank: int,
                 group: dist.ProcessGroup | None):
        self.dp, self.rank, self.group = dp, rank, group
        self.mesh = None  # the data-parallel group as a DeviceMesh, made when a checkpoint needs it
        self.slices: dict[nn.Parameter, nn.Parameter] = {}
        groups = []
        for g in optim.param_groups(layers, tc.weight_decay):
            rows = []
            for p in g["params"]:
                s = nn.Parameter(_rows_view(p, dp, rank))  # shares p's storage: the update lands in p
                self.slices[p] = s
                rows.append(s)
            groups.append({**g, "params": rows})
        self.inner = optim.adamw(groups, tc, device)
        self.state = _StateByParam(self.inner.state, self.slices)
        self.buckets = self._buckets()  # the step's all-gathers: fixed for this optimizer's parameters

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def rows_of(self, p: nn.Parameter) -> torch.Tensor:
        """This replica's rows of parameter p (the shape of its optimizer state)."""
        return self.slices[p]

    def step(self) -> None:
        for p, s in self.slices.items():
            s.grad = None if p.grad is None else _rows_view(p.grad, self.dp, self.rank)
        self.inner.step()
        self._gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, s in self.slices.items():
            s.grad = None
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _buckets(self) -> list[list[nn.Parameter]]:
        """The parameters in all-gather buckets of one dtype and at most `GATHER_BYTES` of
        buffers (every replica's padded rows), so the transient buffers stay small beside the
        state saved."""
        buckets: list[list[nn.Parameter]] = []
        size = 0
        for p in self.slices:
            nbytes = self._chunk(p) * self.dp * p.element_size()
            if not buckets or p.dtype != buckets[-1][0].dtype or size + nbytes > GATHER_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        return buckets

    @torch.no_grad()
    def _gather(self) -> None:
        """Every replica's updated rows into every copy, one all-gather per bucket."""
        for bucket in self.buckets:
            self._gather_bucket(bucket)

    def _chunk(self, p: torch.Tensor) -> int:
        """Values in one replica's (padded) rows of p."""
        n = p.shape[0] if p.dim() else 1
        return math.ceil(n / self.dp) * (p.numel() // n if n else 0)

    def _gather_bucket(self, params: list[nn.Parameter]) -> None:
        mine = torch.zeros(sum(self._chunk(p) for p in params), dtype=params[0].dtype, device=params[0].device)
        off = 0
        for p in params:
            rows = self.slices[p].detach().reshape(-1)
            mine[off:off + rows.numel()] = rows
            off += self._chunk(p)
        every = [mine if k == self.rank else torch.empty_like(mine) for k in range(self.dp)]
        dist.all_gather(every, mine, group=self.group)
        for k, buf in enumerate(every):
            if k == self.rank:
                continue
            off = 0
            for p in params:
                rows = _rows_view(p, self.dp, k)
                rows.copy_(buf[off:off + rows.numel()].view_as(rows))
                off += self._chunk(p)


def build(layers: dict[str, nn.Module], tc: TrainConfig, device: torch.device, shard: str, dp: int, rank: int,
          group: dist.ProcessGroup | None):
    """The optimizer of a rank's layers: torch's AdamW, or with `shard = "optimizer"` and more
    than one replica, `ShardedAdamW`."""
    if shard == "optimizer" and dp > 1:
        return ShardedAdamW(layers, tc, device, dp, rank, group)
    return optim.build_optimizer(layers, tc, device)


def state_rows(opt, p: nn.Parameter) -> torch.Tensor:
    """What p's optimizer state is shaped like: p, or this replica's rows of it."""
    return opt.rows_of(p) if isinstance(opt, ShardedAdamW) else p


def stored(opt, p: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    """p's optimizer state tensor as a checkpoint stores it: whole, or this replica's rows as
    one DTensor sharded over the data-parallel group (`Shard(0)`), which DCP writes once and
    reshards on load (any data-parallel size, sharded or not)."""
    if not isinstance(opt, ShardedAdamW) or value.dim() == 0:
        return value  # AdamW's step count: one number, the same on every replica
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    if opt.mesh is None:
        opt.mesh = DeviceMesh.from_group(opt.group, value.device.type)
    full = p if p.dim() else p.view(1)
    return DTensor.from_local(value, opt.mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
