"""The parts of `dynmo.runtime.pipeline.Pipeline`'s moves between two steps that are not the
layers' own transfer (`dynmo.runtime.migration`): the groups a re-pack leaves behind, and
moving experts between the ranks of an expert-parallel group."""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from dynmo.config import ModelConfig
from dynmo.model.layers import LayerSpec
from dynmo.runtime import experts, fsdp
from dynmo.runtime.dist import DistContext


def released_ranks(ctx: DistContext, keep: list[int]) -> list[int]:
    """Global ranks a re-pack onto pipeline positions `keep` releases, of those active now."""
    stay = ctx.shrink_ranks(keep)
    return [r for r in (ctx.active_ranks or range(ctx.world)) if r not in stay]


def regroup(ctx: DistContext, ep: experts.ExpertGroup | None, mesh,
            layers: dict[int, nn.Module]) -> tuple[experts.ExpertGroup | None, object]:
    """The expert-parallel group and the sharding mesh of the shrunk job `ctx`; the layers held
    here are bound to the new expert group."""
    if ep is not None:
        ep = experts.group_of(ctx, ep.orders, ep.slots)
        for layer in layers.values():
            experts.rebind(layer, ep)
    if mesh is not None:  # layers arriving later shard over the new group
        mesh = fsdp.mesh_of(ctx.dp_group, ctx.device)
    return ep, mesh


def replace_experts(layers: dict[int, nn.Module], specs: list[LayerSpec], optimizer, ep: experts.ExpertGroup | None,
                    ctx: DistContext, model: ModelConfig, new: dict[str, tuple[int, ...]]) -> dict:
    """`Pipeline.replace_experts`: moves the experts and returns the `replacement` event."""
    if ep is None:
        raise ValueError("moving experts needs expert parallelism (parallel.ep > 1)")
    t0 = time.perf_counter()
    old = {n: ep.orders.get(n) for n in new}
    names = {i: specs[i].prefix for i in layers}
    got = experts.apply_placement(layers, names, optimizer, ep, new)
    total = torch.tensor([float(got), time.perf_counter() - t0], dtype=torch.float64, device=ctx.device)
    figures = [torch.zeros_like(total) for _ in range(ctx.active_world)]
    torch.distributed.all_gather(figures, total, group=ctx.active_group)
    n = model.moe.num_experts
    moved = {k: experts.moved_experts(old[k] or ep.start(n), o, ep.size) for k, o in new.items()}
    return {"type": "replacement", "placements": {k: list(o) for k, o in new.items()},
            "experts_moved": {k: v for k, v in moved.items() if v},
            "bytes": int(sum(f[0] for f in figures)), "seconds": float(max(f[1] for f in figures))}
