"""Point-to-point shipping of a layer: its spec, weights, gradients and optimizer state.

A layer travels as one small pickled header (spec, names, shapes, dtypes) followed by one flat
buffer per dtype, so a move costs two messages plus one per dtype whatever the layer holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Packet:
    """Named tensors plus any picklable header fields."""

    header: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def send_packet(pkt: Packet, dst: int, group: dist.ProcessGroup, device: torch.device) -> int:
    """Send to group rank `dst`; returns payload bytes."""
    names = list(pkt.tensors)
    meta = [(n, tuple(pkt.tensors[n].shape), pkt.tensors[n].dtype) for n in names]
    dist.send_object_list([{"header": pkt.header, "meta": meta}], group=group, group_dst=dst, device=device)
    for dtype, flat in _flatten(pkt.tensors, names).items():
        dist.send(flat.to(device), group=group, group_dst=dst)
    return pkt.nbytes


def recv_packet(src: int, group: dist.ProcessGroup, device: torch.device) -> Packet:
    obj = [None]
    dist.recv_object_list(obj, group=group, group_src=src, device=device)
    header, meta = obj[0]["header"], obj[0]["meta"]
    sizes: dict[torch.dtype, int] = {}
    for _, shape, dtype in meta:
        sizes[dtype] = sizes.get(dtype, 0) + _numel(shape)
    flats = {}
    for dtype in _dtype_order(sizes):
        buf = torch.empty(sizes[dtype], dtype=dtype, device=device)
        dist.recv(buf, group=group, group_src=src)
        flats[dtype] = buf
    tensors, offsets = {}, {d: 0 for d in flats}
    for name, shape, dtype in meta:
        n = _numel(shape)
        tensors[name] = flats[dtype][offsets[dtype] : offsets[dtype] + n].view(shape).clone()
        offsets[dtype] += n
    return Packet(header, tensors)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype_order(dtypes) -> list[torch.dtype]:
    return sorted(dtypes, key=str)


def _flatten(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[torch.dtype, torch.Tensor]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for n in names:
        t = tensors[n]
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return {d: torch.cat(groups[d]) for d in _dtype_order(groups)}
