"""What every hash-attention kernel shares: bucket ids by random-projection LSH, the rows of
each head sorted by (bucket, position) and back, and the tile test (which tiles of the sorted
sequences may hold an allowed pair). The kernels are in `dynmo.model.hashkernels`, the blocks
and the entry point `hash_sparse_attention` in `dynmo.model.hashattn`, whose docstring says how
they fit together."""

from __future__ import annotations

import torch


def lsh_buckets(t: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """[B, Ht, T, hd] -> [B, H, T] bucket ids: argmax over the directions planes [H, hd,
    n_buckets] of the H query heads. With Ht < H (grouped keys) each of t's heads is hashed by
    the directions of every query head it serves."""
    B, Ht, T, hd = t.shape
    H, _, n_buckets = planes.shape
    if n_buckets == 1:
        return torch.zeros(B, H, T, dtype=torch.long, device=t.device)
    g = H // Ht
    return torch.matmul(t.unsqueeze(2), planes.view(Ht, g, hd, n_buckets)).argmax(-1).view(B, H, T)


class _Rows(torch.autograd.Function):
    """Rows of t [B, Ht, T, hd] in the order `order` [B, H, T] of each of the H heads (H a
    multiple of Ht: a grouped head is read by each query head it serves) -> [B, H, T, hd].
    Each order is a permutation, so the backward reads the gradient's rows in the inverse
    order (and sums a grouped head's), one row copy each; autograd's index_add would add them
    one by one."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        B, Ht, T, hd = t.shape
        H = order.shape[1]
        ctx.save_for_backward(order)
        ctx.heads = Ht
        rows = order.view(B, Ht, H // Ht, T) + torch.arange(0, B * Ht * T, T, device=t.device).view(B, Ht, 1, 1)
        return t.reshape(B * Ht * T, hd).index_select(0, rows.flatten()).view(B, H, T, hd)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        B, H, T, hd = grad.shape
        rows = inverse(order) + torch.arange(0, B * H * T, T, device=grad.device).view(B, H, 1)
        g = grad.reshape(B * H * T, hd).index_select(0, rows.flatten())
        return g.view(B, ctx.heads, H // ctx.heads, T, hd).sum(2), None


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse of each permutation along the last dim of `order`."""
    ar = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ar)


def sorted_rows(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t [B, Ht, T, hd] read in the order [B, H, T] of each query head -> [B, H, T, hd] (Ht
    divides H: a grouped head is read by each query head it serves, not copied to each first)."""
    return _Rows.apply(t, order)


def unsort(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[B, H, T, hd] rows in the sorted order `order` -> rows in position order."""
    return _Rows.apply(y, inverse(order))


def tile_test(sbq, oq, sbk, ok, c: int, full: bool = False):
    """[B, H, n, n] bool: which (query tile, key tile) pairs of c sorted tokens may hold an
    allowed pair (module docstring). With `full`, also which hold only allowed pairs (one
    bucket on both sides and every key before every query): FlexAttention skips their mask."""
    B, H, T = sbq.shape
    n = T // c
    qb, kb, qp, kp = (t.view(B, H, n, c) for t in (sbq, sbk, oq, ok))
    need = (
        (qb[..., :1] <= kb[..., -1].unsqueeze(-2))  # bucket ranges overlap
        & (kb[..., 0].unsqueeze(-2) <= qb[..., -1:])
        & (kp.amin(-1).unsqueeze(-2) <= qp.amax(-1, keepdim=True))  # some key not after some query
    )
    if not full:
        return need
    one_bucket = (
        (qb[..., :1] == qb[..., -1:])
        & (kb[..., 0] == kb[..., -1]).unsqueeze(-2)
        & (qb[..., :1] == kb[..., 0].unsqueeze(-2))
    )
    return need, one_bucket & (kp.amax(-1).unsqueeze(-2) <= qp.amin(-1, keepdim=True))


def compute_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The dtype the fused kernels run in: autocast's where it is on, else the values' (the
    output's dtype in every kernel)."""
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return v.dtype
