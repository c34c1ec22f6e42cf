"""Exact global top-k over tensors spread across the ranks of a process group.

The paper's Algorithm 2 gathers every rank's local top-k values on rank 0. `global_keep`
computes the same set with 32 scalar all-reduces instead of O(k) values: a bisection on the
float bit pattern finds the exact k-th largest score v* over all ranks (for non-negative
floats the int32 view is monotone), each rank keeps its entries > v*, and the ties at v* are
shared out in rank order so exactly k survive. On magnitudes the result equals
`torch.nn.utils.prune.global_unstructured(..., L1Unstructured, amount=...)` on the whole model
(up to the order among exactly equal magnitudes, where torch's topk is unspecified).
Negative scores mark entries that are not candidates (e.g. already pruned weights); they are
never kept, as `global_unstructured` never revives entries outside an existing mask.

Exactly equal scores at the threshold are kept in the order of each tensor's global `key`
(e.g. block number and Linear), then by position: the result is the same whichever rank holds
a tensor. Without keys they are kept in rank order, then in list and position order.

Pure torch and torch.distributed: with `group=None` (or a one-rank group) everything is local.
Over a group, the counts travel on the group's device (`group_device`: the rank's CUDA device
under NCCL, which takes no CPU tensors), whatever device the scores live on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _distributed(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def group_device(group) -> torch.device:
    """The device of the tensors a collective over `group` takes: the current CUDA device under
    NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_sum(t: torch.Tensor, group) -> torch.Tensor:
    """`t` summed over the ranks of `group` (in place; no-op on one rank), wherever `t` lives:
    the sum runs on the group's device (`group_device`)."""
    if _distributed(group):
        dev = group_device(group)
        if t.device == dev:
            dist.all_reduce(t, group=group)
        else:
            on_dev = t.to(dev)
            dist.all_reduce(on_dev, group=group)
            t.copy_(on_dev)
    return t


def group_count(n: int, group) -> int:
    """The sum of the integer `n` over the ranks of `group`."""
    if not _distributed(group):
        return n
    return int(group_sum(torch.tensor([n], dtype=torch.int64, device=group_device(group)), group))


def global_keep(scores: list[torch.Tensor], keep: int, group=None, keys: list[int] | None = None,
                num_keys: int = 0) -> list[torch.Tensor]:
    """Boolean masks keeping the `keep` largest scores over all tensors on all ranks of `group`.

    `scores` are non-negative float tensors (magnitudes); entries < 0 are not candidates
    (already pruned) and are never kept. Every rank of `group` must call this. Exact: the
    k-th largest value is found by bisection on the float32 bit pattern (32 all-reduces of one
    integer). Ties at the threshold are kept in rank order, then position order; with `keys`
    (one distinct integer in [0, num_keys) per tensor over the whole group) in key order, then
    position order, independent of which rank holds which tensor.
    """
    flat = torch.cat([s.detach().reshape(-1).float() for s in scores]) if scores else torch.zeros(0, device="cpu")
    bits = flat.view(torch.int32)  # non-negative floats: int order == float order; negatives < 0
    lo, hi = 0, 0x7F800000  # [0, +inf]
    total = group_count(int((bits >= 0).sum()), group)
    keep = max(0, min(keep, total))
    if keep == 0:
        keep_mask = torch.zeros_like(bits, dtype=torch.bool)
    else:
        # largest b with count(bits >= b) >= keep: that is the keep-th largest value
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if group_count(int((bits >= mid).sum()), group) >= keep:
                lo = mid
            else:
                hi = mid - 1
        above = bits > lo
        ties = bits == lo
        n_above = group_count(int(above.sum()), group)
        need = keep - n_above  # ties to keep
        keep_mask = above.clone()
        if keys is not None:  # handed out in key order, then position order
            if len(keys) != len(scores):
                raise ValueError(f"{len(keys)} keys for {len(scores)} score tensors")
            counts = torch.zeros(num_keys, dtype=torch.int64, device="cpu")  # read here; summed on the group's device
            off = 0
            for key, s in zip(keys, scores):
                counts[key] = int(ties[off : off + s.numel()].sum())
                off += s.numel()
            group_sum(counts, group)
            before = torch.cumsum(counts, 0) - counts  # ties of all tensors with a smaller key
            off = 0
            for key, s in zip(keys, scores):
                mine = max(0, min(int(counts[key]), need - int(before[key])))
                if mine:
                    idx = ties[off : off + s.numel()].nonzero().squeeze(1)[:mine] + off
                    keep_mask[idx] = True
                off += s.numel()
        else:  # handed out in rank order
            my_ties = int(ties.sum())
            before = 0
            if _distributed(group):
                dev = group_device(group)
                counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size(group))]
                dist.all_gather(counts, torch.tensor([my_ties], dtype=torch.int64, device=dev), group=group)
                before = sum(int(c) for c in counts[: dist.get_rank(group)])
            mine = max(0, min(my_ties, need - before))
            if mine:
                keep_mask[ties.nonzero().squeeze(1)[:mine]] = True
    out, off = [], 0
    for s in scores:
        out.append(keep_mask[off : off + s.numel()].view(s.shape))
        off += s.numel()
    return out
