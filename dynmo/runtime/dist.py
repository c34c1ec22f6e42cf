"""Process groups: a (dp x pp) DeviceMesh; gloo on CPU, NCCL when CUDA is present."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device
    backend: str
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    # Ranks still training (all, until re-packing releases some) and their group.
    active_group: dist.ProcessGroup

    @property
    def is_logger(self) -> bool:
        return self.rank == 0

    def pp_global_rank(self, pp_rank: int) -> int:
        return self.dp_rank * self.pp + pp_rank


def choose_backend(requested: str) -> str:
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("parallel.backend=nccl needs CUDA; use gloo (or auto) on CPU")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(dp: int, pp: int, backend: str = "auto") -> DistContext:
    """Join the torchrun job and build the (dp, pp) mesh. Rank r is replica r // pp, stage r % pp."""
    if "RANK" not in os.environ:
        raise RuntimeError(
            "dynmo.train runs under torchrun; use `dynmo train --nproc N ...` or "
            "`torchrun --nproc-per-node N -m dynmo.train ...`"
        )
    backend = choose_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp * pp != world:
        raise RuntimeError(f"parallel.dp={dp} x parallel.pp={pp} = {dp * pp} ranks, but torchrun started {world}")
    mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return DistContext(
        rank=rank,
        world=world,
        device=device,
        backend=backend,
        dp=dp,
        pp=pp,
        dp_rank=rank // pp,
        pp_rank=rank % pp,
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp") if dp > 1 else None,
        active_group=dist.group.WORLD,
    )
