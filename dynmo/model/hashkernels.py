"""The hash-attention kernels, each exact, each taking the heads sorted by (bucket, position)
(`dynmo.model.hashsort`) and returning the sorted outputs: `staircase` (CPU's fused
flash-attention kernels, chunk by chunk of each bucket's staircase), `flex` (FlexAttention with a
block mask built on the device) and `tiles` (the reference, eager torch). `dynmo.model.hashattn`
says when each runs and calls them through `hash_sparse_attention`."""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from dynmo.model.hashsort import sorted_rows, tile_test, unsort

# Query rows per staircase chunk. A chunk computes its band's masked half as waste (about
# STAIR_ROWS / queries of the bucket's area) and costs two kernel calls of fixed overhead; 64,
# 128 and 256 measured within noise of each other at 4k-16k tokens and 2-16 buckets, 128 the
# smallest masks (docs/bench/hashattn-kernels.md).
STAIR_ROWS = 128
# FlexAttention's GPU kernels tile by at least 128 rows; a BlockMask's tile must be a multiple.
FLEX_TILE = 128


@functools.cache
def has_flex() -> bool:
    """Whether this torch has FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flash_cpu():
    """CPU's fused flash-attention forward and backward (the kernels behind SDPA on CPU), which
    return and take the rows' logsumexp; None where this torch has no such ops."""
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return (fwd, bwd) if fwd is not None and bwd is not None else None


def staircase_plan(sbq, oq, sbk, ok, rows: int = 0):
    """The staircase's chunks, on the host: [(row, first query, queries, first key, keys every
    query sees, keys the last one sees)] in the sorted order of the R = B * H rows, and per query
    its mask width (keys from the chunk's first key it may attend, at least 1) and whether it
    has any allowed key ([R, T] each, on the device)."""
    B, H, T = sbq.shape
    R, dev, rows = B * H, sbq.device, rows or STAIR_ROWS
    sbq, oq, sbk, ok = (t.reshape(R, T) for t in (sbq, oq, sbk, ok))
    # A query's allowed keys are the sorted keys [start, end) of its row: its bucket's keys at
    # or before its position (keys sort by bucket * T + position).
    start = torch.searchsorted(sbk, sbq)
    end = torch.searchsorted(sbk * T + ok, sbq * T + oq, right=True)
    first_q = torch.searchsorted(sbq, sbq)  # the first query of each query's bucket
    past_q = torch.searchsorted(sbq, sbq, right=True)  # one past its bucket's last query
    lead = (torch.arange(T, device=dev) - first_q) % rows == 0  # a chunk starts at this query
    r, i = lead.nonzero(as_tuple=True)
    size = torch.minimum(past_q[r, i] - i, torch.full_like(i, rows))
    plan = torch.stack([r, i, size, start[r, i], end[r, i], end[r, i + size - 1]], 1).tolist()
    # a query before its bucket's first key attends that key in the mask (no row is all -inf)
    # and is zeroed afterwards
    return plan, (end - start).clamp_min(1), end > start


class _Staircase(torch.autograd.Function):
    """Sorted heads qs, ks, vs [R, T, hd] -> sorted outputs, chunk by chunk (module docstring).

    A chunk attends keys [s, e_first) with no mask (every query of the chunk sees them) and the
    band [e_first, e_last) with one; the two partial softmaxes merge by their logsumexps, as a
    split-KV flash kernel merges its splits. The backward runs the flash backward on each part
    with the merged output and logsumexp (exact: the gradient of a key set needs only those)
    and adds the keys' gradients in place. Only O(T) tensors are kept for the backward; the
    band masks (queries x band keys, about `rows` squared) are rebuilt there."""

    @staticmethod
    def forward(ctx, qs, ks, vs, plan, span, has_key):
        fwd, _ = flash_cpu()
        out = torch.zeros_like(qs)
        lse = torch.zeros(qs.shape[:2], dtype=torch.float32, device=qs.device)
        masked = torch.full((), float("-inf"), dtype=qs.dtype, device=qs.device)

        def chunk_forward(r, i, size, s, e_first, e_last):
            if e_last == s:  # no key of the bucket before any of these queries: zero
                return
            q = qs[r, i:i + size][None, None]
            parts = []
            if e_first > s:
                o, l = fwd(q, ks[r, s:e_first][None, None], vs[r, s:e_first][None, None])
                parts.append((o[0, 0], l[0, 0]))
            if e_last > e_first:
                o, l = fwd(q, ks[r, e_first:e_last][None, None], vs[r, e_first:e_last][None, None],
                           attn_mask=_band(span[r, i:i + size], s, e_first, e_last, masked))
                # rows with no key in the band: the kernel gives them a zero output and lse 0
                l = l[0, 0].masked_fill(span[r, i:i + size] <= e_first - s, float("-inf"))
                parts.append((o[0, 0], l))
            if len(parts) == 1:
                out[r, i:i + size], lse[r, i:i + size] = parts[0]
            else:
                (oa, la), (ob, lb) = parts
                l = torch.logaddexp(la, lb)
                out[r, i:i + size] = oa * (la - l).exp().unsqueeze(-1) + ob * (lb - l).exp().unsqueeze(-1)
                lse[r, i:i + size] = l

        _each_chunk(plan, chunk_forward)
        out.mul_(has_key.unsqueeze(-1))
        ctx.save_for_backward(qs, ks, vs, out, lse, span, has_key)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad):
        _, bwd = flash_cpu()
        qs, ks, vs, out, lse, span, has_key = ctx.saved_tensors
        grad = (grad * has_key.unsqueeze(-1)).to(qs.dtype)
        dq = torch.zeros_like(qs, dtype=torch.float32)
        dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
        masked = torch.full((), float("-inf"), dtype=qs.dtype, device=qs.device)

        def chunk_backward(r, i, size, s, e_first, e_last):
            rows = slice(i, i + size)
            q, g, o, l = (t[r, rows][None, None] for t in (qs, grad, out, lse))
            for a, b, mask in ((s, e_first, None), (e_first, e_last, "band")):
                if b <= a:
                    continue
                if mask:
                    mask = _band(span[r, rows], s, e_first, e_last, masked)
                gq, gk, gv = bwd(g, q, ks[r, a:b][None, None], vs[r, a:b][None, None], o, l, 0.0, False,
                                 attn_mask=mask)
                dq[r, rows] += gq[0, 0]
                dk[r, a:b] += gk[0, 0]
                dv[r, a:b] += gv[0, 0]

        _each_chunk(ctx.plan, chunk_backward)
        return dq.to(qs.dtype), dk.to(ks.dtype), dv.to(vs.dtype), None, None, None


def _each_chunk(plan: list, fn) -> None:
    """fn(*chunk) for every chunk of the plan. The chunks' kernels are small: split over the
    intra-op threads, each call would end in a barrier. Instead each of torch's intra-op threads
    (a Python thread here, the GIL released inside the kernels) takes whole rows of the plan, a
    share of about equal work, and runs their chunks on one thread in plan order: rows are
    disjoint, so every output and gradient row is written by one thread in the same order
    whatever the thread count (bitwise the same result)."""
    threads = torch.get_num_threads()
    groups = _row_groups(plan, threads)
    torch.set_num_threads(1)  # this thread's own setting (OpenMP's and MKL's are per thread)
    try:
        if len(groups) == 1:
            for chunk in plan:
                fn(*chunk)
            return

        def run(chunks):
            # a new thread starts with autograd recording: the chunks write into shared
            # tensors, which must not grow a graph (two threads would race on it)
            torch.set_num_threads(1)
            with torch.no_grad():
                for chunk in chunks:
                    fn(*chunk)

        with ThreadPoolExecutor(len(groups)) as pool:
            list(pool.map(run, groups))
    finally:
        torch.set_num_threads(threads)


def _row_groups(plan: list, n: int) -> list[list]:
    """The plan's chunks in at most n groups of whole rows (plan order kept inside a group), the
    rows dealt largest first to the group with the least work (queries x keys) so far."""
    work: dict[int, int] = {}
    for r, _, size, s, _, e_last in plan:
        work[r] = work.get(r, 0) + size * (e_last - s)
    n = min(n, len(work))
    if n <= 1:
        return [plan]
    load, owner = [0] * n, {}
    for r in sorted(work, key=lambda r: -work[r]):
        g = load.index(min(load))
        owner[r], load[g] = g, load[g] + work[r]
    groups: list[list] = [[] for _ in range(n)]
    for chunk in plan:
        groups[owner[chunk[0]]].append(chunk)
    return [g for g in groups if g]


def _band(span, s: int, e_first: int, e_last: int, masked: torch.Tensor) -> torch.Tensor:
    """The additive mask of a chunk's band keys [e_first, e_last): row j may attend those before
    s + span[j]."""
    cols = torch.arange(e_first - s, e_last - s, device=span.device)
    return torch.where(cols < span.unsqueeze(-1), 0.0, masked)


def staircase(qs, ks, vs, sbq, oq, sbk, ok) -> torch.Tensor:
    """Sorted heads [B, H, T, hd] -> sorted outputs by `_Staircase`."""
    B, H, T, hd = qs.shape
    with torch.no_grad():
        plan, span, has_key = staircase_plan(sbq, oq, sbk, ok)
    with torch.autocast(qs.device.type, enabled=False):  # the fused kernels run in qs's dtype
        y = _Staircase.apply(*(t.reshape(B * H, T, hd) for t in (qs, ks, vs)), plan, span, has_key)
    return y.view(B, H, T, hd)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_tile(T: int, chunk: int) -> int:
    """The BlockMask's tile: a multiple of chunk and of the GPU kernels' tile when T allows it."""
    t = math.lcm(chunk, FLEX_TILE)
    return t if T % t == 0 else chunk


def flex_block_mask(sbq, oq, sbk, ok, chunk: int):
    """The BlockMask of the sorted sequences: the tile test's tiles (per tile, the min and max of
    bucket id and position), the exact rule inside. Built directly from the tile matrices, its
    backward's (query-side) indices ordered from the transposed ones by the same argsort, not
    by `BlockMask.from_kv_blocks`, whose nested vmap derives them at 5-25x the host time: the
    same tensors, in a number of operators that does not grow with T, heads or buckets."""
    from torch.nn.attention.flex_attention import BlockMask

    B, H, T = sbq.shape
    c = flex_tile(T, chunk)

    def allowed(b, h, qi, ki):
        return (sbq[b, h, qi] == sbk[b, h, ki]) & (ok[b, h, ki] <= oq[b, h, qi])

    def ordered(tiles):  # [B, H, n, n] bool -> (tiles per row, their columns first), static shapes
        cols = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
        return tiles.sum(-1, dtype=torch.int32), cols.to(torch.int32)

    need, full = tile_test(sbq, oq, sbk, ok, c, full=True)
    partial = need & ~full
    return BlockMask(seq_lengths=(T, T), kv_num_blocks=(kv := ordered(partial))[0], kv_indices=kv[1],
                     full_kv_num_blocks=(fkv := ordered(full))[0], full_kv_indices=fkv[1],
                     q_num_blocks=(q := ordered(partial.mT))[0], q_indices=q[1],
                     full_q_num_blocks=(fq := ordered(full.mT))[0], full_q_indices=fq[1],
                     BLOCK_SIZE=(c, c), mask_mod=allowed)


def flex(qs, ks, vs, sbq, oq, sbk, ok, chunk: int) -> torch.Tensor:
    """Sorted heads -> sorted outputs by FlexAttention (rows with no allowed key give zero)."""
    with torch.no_grad():
        mask = flex_block_mask(sbq, oq, sbk, ok, chunk)
    return _compiled_flex()(qs, ks, vs, block_mask=mask)


def tiles(q, k, v, sbq, oq, sbk, ok, chunk: int) -> torch.Tensor:
    """The reference: tile by tile in eager torch, grouped heads expanded first."""
    B, H, T, hd = q.shape
    c = chunk
    n = T // c
    if k.shape[1] != H:
        k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    with torch.no_grad():
        sbq, sbk = sbq.view(B, H, n, c), sbk.view(B, H, n, c)
        spq, spk = oq.view(B, H, n, c), ok.view(B, H, n, c)  # original positions, sorted
        b, h, i, j = tile_test(sbq.view(B, H, T), oq, sbk.view(B, H, T), ok, c).nonzero().unbind(1)
        allowed = (sbq[b, h, i].unsqueeze(-1) == sbk[b, h, j].unsqueeze(-2)) & (
            spk[b, h, j].unsqueeze(-2) <= spq[b, h, i].unsqueeze(-1)
        )  # [tiles, c, c]
        group = (b * H + h) * n + i  # the query chunk each tile belongs to

    def tiles(t, order, idx):
        return sorted_rows(t, order).view(B, H, n, c, hd)[b, h, idx]

    # The softmax and the sums over a query chunk's tiles are float32 whatever autocast does (its
    # CUDA policy runs exp and sum in float32, its CPU policy does not); P @ V runs in v's dtype.
    acc = torch.float32
    s = (tiles(q, oq, i) @ tiles(k, ok, j).transpose(-1, -2)).to(acc) / math.sqrt(hd)
    s = s.masked_fill(~allowed, float("-inf"))
    with torch.no_grad():  # per-row max over the row's tiles; a constant shift of the softmax
        m = torch.full((B * H * n, c), float("-inf"), dtype=acc, device=s.device)
        m = m.scatter_reduce(0, group.unsqueeze(-1).expand(-1, c), s.amax(-1), "amax")
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m[group].unsqueeze(-1))
    denom = torch.zeros(B * H * n, c, dtype=acc, device=s.device).index_add(0, group, p.sum(-1).to(acc))
    pv = (p.to(v.dtype) @ tiles(v, ok, j)).to(acc)
    num = torch.zeros(B * H * n, c, hd, dtype=acc, device=s.device).index_add(0, group, pv)
    y_sorted = (num / denom.clamp_min(torch.finfo(acc).tiny).unsqueeze(-1)).to(v.dtype).view(B, H, T, hd)
    return unsort(y_sorted, oq)
