"""What a migrating layer carries, and the report of a migration.

A layer travels as one `Packet` (`dynmo.runtime.transfer`): its weights (`w.`), gradients
(`g.`), AdamW state per parameter (`o.`), and the per-layer state of each dynamic-model case
(`x.<case>.`). The receiver builds the layer empty from its spec, lets the cases shape it
(`prepare_layer`: e.g. an exit classifier), then loads everything. Of a sharded layer
(`parallel.shard = "full"`, `dynmo.runtime.fsdp`) each replica ships its own shards to the
same replica of the new stage; so does each replica's share of the experts under expert
parallelism (`parallel.ep`, `dynmo.runtime.experts`): the pipeline group is the replica's, so
the receiver is the same data-parallel index of the new stage, and it holds the same experts
(every group holds a layer's experts under one placement, `experts.ExpertGroup.orders`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dynmo.config import ModelConfig
from dynmo.layout import Layout
from dynmo.model.layers import LayerSpec, empty_layer
from dynmo.runtime import experts, faults, fsdp
from dynmo.runtime.dist import DistContext
from dynmo.runtime.transfer import Packet, recv_packet, send_packet


@dataclass
class MigrationReport:
    old: list[int]
    new: list[int]
    moves: list[dict] = field(default_factory=list)  # {"layer", "name", "from", "to"} (stages)
    bytes: int = 0  # payload bytes received by this rank (summed over ranks in the metrics)
    seconds: float = 0.0
    released: list[int] = field(default_factory=list)  # global ranks released by a re-pack

    def as_event(self) -> dict:
        return {
            "type": "migration",
            "old": self.old,
            "new": self.new,
            "layers_moved": len(self.moves),
            "moves": self.moves,
            "bytes": self.bytes,
            "seconds": self.seconds,
        } | ({"released_ranks": self.released} if self.released else {})


def pack_layer(layer: nn.Module, spec: LayerSpec, state: dict, extras: list) -> Packet:
    """The packet of one layer: weights, gradients, optimizer `state` ({param: {key: tensor}})
    and each case's (`extras`) per-layer tensors; of a sharded layer, this replica's shards."""
    tensors = {f"w.{k}": v for k, v in fsdp.local_state(layer).items()}
    for n, p in layer.named_parameters():
        if p.grad is not None:
            tensors[f"g.{n}"] = fsdp.local(p.grad)
        for k, v in state.get(n, {}).items():
            tensors[f"o.{n}.{k}"] = fsdp.local(v)
    for ex in extras:
        tensors |= {f"x.{ex.name}.{k}": v for k, v in ex.pack_layer(spec.index, layer).items()}
    return Packet({"spec": spec}, tensors)


def unpack_layer(pkt: Packet, model: ModelConfig, device: torch.device, extras: list,
                 mesh=None, ep=None) -> tuple[nn.Module, dict]:
    """(layer, optimizer state) rebuilt from a packet (its spec is `pkt.header["spec"]`); with a
    `mesh` (`parallel.shard = "full"`), sharded over it from this replica's shards; with an
    expert-parallel handle `ep`, holding this rank's experts (what the same replica shipped)."""
    spec: LayerSpec = pkt.header["spec"]
    if mesh is None:
        layer = experts.localize(empty_layer(spec, model, device), ep, spec.prefix)  # the layer's placement
    else:
        layer = fsdp.empty_sharded(spec, model, device, mesh)
    for ex in extras:  # structure first (e.g. an exit classifier), so the weights fit
        ex.prepare_layer(spec.index, layer)
    weights = {k[2:]: v for k, v in pkt.tensors.items() if k.startswith("w.")}
    if mesh is None:
        layer.load_state_dict(weights, strict=True)
    else:
        fsdp.load_local(layer, weights)
    state: dict[str, dict] = {}
    grads: dict[str, dict] = {}
    for k, v in pkt.tensors.items():
        if k.startswith("g."):
            grads[k[2:]] = {"grad": v}
        elif k.startswith("o."):
            pname, key = k[2:].rsplit(".", 1)
            state.setdefault(pname, {})[key] = v
    if mesh is not None:
        state, grads = fsdp.as_sharded_state(layer, state), fsdp.as_sharded_state(layer, grads)
    params = dict(layer.named_parameters())
    for n, g in grads.items():
        params[n].grad = g["grad"]
    for ex in extras:
        pre = f"x.{ex.name}."
        ex.unpack_layer(spec.index, layer, {k[len(pre):]: v for k, v in pkt.tensors.items() if k.startswith(pre)})
    return layer, state


def exchange_layers(specs: list[LayerSpec], layers: dict[int, nn.Module], states: dict[int, dict], src_rank: list[int],
                    dst_rank: list[int], old: Layout, new: Layout, ctx: DistContext, model: ModelConfig, extras: list,
                    report: MigrationReport, mesh=None, ep=None) -> None:
    """Ship every layer whose rank changes from `src_rank` to `dst_rank`, with its optimizer
    `states`; `layers`, `states` and `specs` are updated in place, the moves and the bytes
    received recorded in `report`. Call on every rank of the pipeline group: every rank walks
    the same global order, so each blocking send meets its receive."""
    old_owner, new_owner = old.owner(), new.owner()
    me, group, dev = ctx.pp_rank, ctx.pp_group, ctx.device
    for i in range(len(specs)):
        src, dst = src_rank[i], dst_rank[i]
        a, b = old_owner[i], new_owner[i]
        if a != b or src != dst:
            report.moves.append({"layer": i, "name": specs[i].name, "from": a, "to": b})
        if src == dst:
            continue  # same rank (maybe another virtual stage of it): nothing to ship
        if me == src:
            send_packet(pack_layer(layers[i], specs[i], states.pop(i), extras), dst, group, dev)
            del layers[i]
            faults.point("migration")
        elif me == dst:
            pkt = recv_packet(src, group, dev)
            report.bytes += pkt.nbytes  # counted where received: a released sender leaves
            spec = pkt.header["spec"]
            specs[spec.index] = spec  # before the layer is built: the cases shape it from its spec
            layers[i], states[i] = unpack_layer(pkt, model, dev, extras, mesh, ep)
