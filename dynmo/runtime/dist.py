"""Process groups: a (dp x pp) DeviceMesh; gloo on CPU, NCCL when CUDA is present.

With expert parallelism (`parallel.ep` = E > 1) each pipeline position's dp replicas also form
dp/E expert-parallel groups of E consecutive replicas (the experts of every MoE layer are spread
over them, `dynmo.runtime.experts`) and E expert-replica groups of the dp/E replicas that hold
the same experts (their expert gradients are averaged there)."""

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
    active_ranks: list[int] | None = None  # global ranks, ascending; None = all
    # expert parallelism: E, this rank's index in its expert-parallel group, that group (None when
    # E = 1), and the group of the replicas holding the same experts (None when E = dp)
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    ep_replica_group: dist.ProcessGroup | None = None

    @property
    def active_world(self) -> int:
        return self.world if self.active_ranks is None else len(self.active_ranks)

    @property
    def is_logger(self) -> bool:
        return self.rank == 0

    def _global(self, replica: int, position: int) -> int:
        """Global rank of pipeline position `position` of replica `replica`."""
        return self.active_ranks[replica * self.pp + position] if self.active_ranks else replica * self.pp + position

    def shrink_ranks(self, keep: list[int]) -> list[int]:
        """Global ranks that stay when every replica keeps pipeline positions `keep`."""
        return sorted(self._global(r, k) for r in range(self.dp) for k in keep)

    def shrink(self, keep: list[int]) -> "DistContext | None":
        """Keep pipeline positions `keep` (ascending, 0 among them) in every replica.

        Returns the context of the shrunk job, or None on a released rank. Only the members of
        each new group create it (`use_local_synchronization=True`; `split_group` does not
        work on gloo), and every rank creates its groups in the same global order: pipeline
        groups by replica, then data-parallel groups by position, then the active group. The
        old groups stay alive, unused, until the end (destroying a group is collective).
        """
        if 0 not in keep or sorted(set(keep)) != list(keep):
            raise ValueError(f"pipeline positions to keep must be ascending and include 0, got {keep}")
        ranks_of = [[self._global(r, k) for k in keep] for r in range(self.dp)]
        active = self.shrink_ranks(keep)
        if self.rank not in active:
            return None

        def group(ranks: list[int]) -> dist.ProcessGroup:
            return dist.new_group(ranks=ranks, use_local_synchronization=True)

        pp_group = group(ranks_of[self.dp_rank])
        dp_group = None
        j = keep.index(self.pp_rank)
        if self.dp > 1:
            dp_group = group([ranks_of[r][j] for r in range(self.dp)])
        active_group = group(active) if len(active) < self.world else dist.group.WORLD
        ep_group, ep_replica_group = (_expert_groups(self.dp, self.ep, self.dp_rank,
                                                     lambda r: ranks_of[r][j], group) if self.ep > 1 else (None, None))
        return DistContext(
            rank=self.rank, world=self.world, device=self.device, backend=self.backend, dp=self.dp,
            pp=len(keep), dp_rank=self.dp_rank, pp_rank=j, pp_group=pp_group, dp_group=dp_group,
            active_group=active_group, active_ranks=active, ep=self.ep, ep_rank=self.ep_rank,
            ep_group=ep_group, ep_replica_group=ep_replica_group,
        )


def _expert_groups(dp: int, ep: int, dp_rank: int, global_of, group) -> tuple:
    """(this rank's expert-parallel group, its expert-replica group or None) at one pipeline
    position, `global_of(replica)` the global rank of each replica there. `group(ranks)` makes a
    group; only this rank's two are made (the groups of other positions are other ranks')."""
    block = dp_rank // ep
    ep_group = group([global_of(r) for r in range(block * ep, (block + 1) * ep)])
    replica_group = group([global_of(r) for r in range(dp_rank % ep, dp, ep)]) if dp > ep else None
    return ep_group, replica_group


def choose_backend(requested: str) -> str:
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("parallel.backend=nccl needs CUDA; use gloo (or auto) on CPU")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(dp: int, pp: int, backend: str = "auto", timeout_s: float = 300.0, ep: int = 1) -> DistContext:
    """Join the torchrun job and build the (dp, pp) mesh. Rank r is replica r // pp, stage r % pp.

    `timeout_s` bounds how long any collective or point-to-point operation waits for a peer
    (`parallel.timeout_s`): a hung or dead peer fails the job after it, not after torch's
    default of ten or thirty minutes."""
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
        timeout = datetime.timedelta(seconds=timeout_s)
        # Groups made later (the mesh's, a re-pack's, the tied embedding's) take torch's module
        # default, not the world's timeout: make the default ours so every group bounds its waits.
        c10d = dist.distributed_c10d
        c10d.default_pg_timeout = timeout
        if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
            c10d.default_pg_nccl_timeout = timeout
        dist.init_process_group(backend=backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp * pp != world:
        raise RuntimeError(f"parallel.dp={dp} x parallel.pp={pp} = {dp * pp} ranks, but torchrun started {world}")
    mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    ep_group = ep_replica_group = None
    if ep > 1:
        if dp % ep:
            raise RuntimeError(f"parallel.ep={ep} does not divide parallel.dp={dp}")
        # every rank makes every group, in one global order (new_group is collective over the world)
        mine = (rank // pp, rank % pp)
        for position in range(pp):
            for block in range(dp // ep):
                g = dist.new_group([r * pp + position for r in range(block * ep, (block + 1) * ep)])
                if mine[1] == position and mine[0] // ep == block:
                    ep_group = g
            for e in range(ep) if dp > ep else ():
                g = dist.new_group([r * pp + position for r in range(e, dp, ep)])
                if mine[1] == position and mine[0] % ep == e:
                    ep_replica_group = g
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
        ep=ep,
        ep_rank=(rank // pp) % ep,
        ep_group=ep_group,
        ep_replica_group=ep_replica_group,
    )
