"""Which weights a pruning step keeps: the scores the global cut ranks (`prune.scoring`), the
per-tensor floor (`prune.min_density`), and the masks of one step over the model group, per
Linear weight (unstructured) or per MLP hidden unit (structured).

Everything here is computed from each tensor alone and cut by the exact distributed top-k of
`dynmo.dynamics.topk`, ties broken by (block, Linear, position), so a block's mask does not
depend on the rank that holds it. `dynmo.dynamics.prune` (the `Prune` case) applies the masks.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from dynmo.config import PruneConfig
from dynmo.dynamics.case import Host
from dynmo.dynamics.topk import global_keep, group_count
from dynmo.model.sparse import PrunedLinear

SCORINGS = ("magnitude", "normalized", "lamp")  # prune.scoring


# ---- scoring: what the global cut ranks ------------------------------------------------------


def scores(mag: torch.Tensor, live: torch.Tensor | None, scoring: str, n: int | None = None) -> torch.Tensor:
    """Float32 scores of one tensor's candidates for the global cut; -1 where `live` is False.

    `mag` holds non-negative magnitudes (|w| of a weight tensor, or the norms of a block's MLP
    units); `n` is the tensor's original number of entries (default `mag.numel()`: entries
    already removed count as zeros). Computed from the tensor alone, so a tensor scores the
    same on whichever rank holds it.

    magnitude   `mag` itself (torch.nn.utils.prune.global_unstructured's L1 criterion).
    normalized  `mag` / the tensor's RMS, sqrt(sum(mag^2 over live entries) / n): every tensor
                is measured in its own scale, so tensors initialised or trained smaller (the
                GPT-2 residual projections, 1/sqrt(2 n_layers)) compete fairly.
    lamp        LAMP (Lee et al. 2021): mag_u^2 / the sum of mag_v^2 over the live entries v of
                the tensor ranked at or above u (mag_v > mag_u, or equal at a later position);
                also scale free, and each tensor's largest entry scores 1, so a tensor keeps
                at least one entry while the global budget allows.
    """
    mag = mag.detach().float()
    flat = mag.reshape(-1)
    if live is not None:
        flat = flat.masked_fill(~live.reshape(-1).bool(), 0.0)
    if scoring == "magnitude":
        out = flat
    elif scoring == "normalized":
        scale = float(flat.double().square().sum().div(n or flat.numel()).sqrt())
        out = flat / torch.tensor(scale if scale > 0 else 1.0, dtype=torch.float32, device=flat.device)
    elif scoring == "lamp":
        order = torch.sort(flat, stable=True).indices  # ascending, equal entries in position order
        sq = flat.double().square()[order]
        suffix = sq.flip(0).cumsum(0).flip(0)  # sum of the squares from this entry to the largest
        out = torch.zeros_like(flat)
        out[order] = torch.where(suffix > 0, sq / suffix.clamp_min(1e-300), 0.0).float()
    else:
        raise ValueError(f"scoring={scoring!r}; use one of {SCORINGS}")
    if live is not None:
        out = out.masked_fill(~live.reshape(-1).bool(), -1.0)
    return out.view(mag.shape)


def floor_count(min_density: float, n: int) -> int:
    """Entries a tensor of `n` original entries keeps at least under `prune.min_density`."""
    return math.ceil(round(min_density * n, 6))


def keep_with_floor(score_list: list[torch.Tensor], keep: int, floors: list[int], group=None,
                    keys: list[int] | None = None, num_keys: int = 0) -> tuple[list[torch.Tensor], int]:
    """`global_keep` with a per-tensor floor: each tensor first keeps its `floors[t]` best
    candidates (by score, equal scores in position order; fewer if it has fewer), the rest of
    the `keep` budget goes to one global cut over everything else. Returns the masks and the
    number kept over the group (more than `keep` only when the floors alone exceed it)."""
    reserved = []
    for sc, f in zip(score_list, floors):
        flat = sc.reshape(-1)
        r = torch.zeros(flat.numel(), dtype=torch.bool, device=sc.device)
        f = min(f, int((flat >= 0).sum()))
        if f > 0:
            r[torch.sort(flat, descending=True, stable=True).indices[:f]] = True
        reserved.append(r.view(sc.shape))
    n_reserved = group_count(sum(int(r.sum()) for r in reserved), group)
    rest = [sc.masked_fill(r, -1.0) for sc, r in zip(score_list, reserved)]
    masks = global_keep(rest, keep - n_reserved, group, keys, num_keys)
    return [m | r for m, r in zip(masks, reserved)], max(keep, n_reserved)


def unit_scores(mlp: nn.Module) -> torch.Tensor:
    """L2 norm of each hidden unit's weights: its fc row, fc bias and proj column."""
    fc, proj = mlp.fc, mlp.proj
    sq = fc.weight.detach().pow(2).sum(1) + proj.weight.detach().pow(2).sum(0)
    if fc.bias is not None:
        sq = sq + fc.bias.detach().pow(2)
    return sq.sqrt()


# ---- a block's prunable Linears ------------------------------------------------------------


def linears(block: nn.Module, names: tuple[str, ...]) -> dict[str, nn.Module]:
    """A block's prunable Linear layers by name, in `names` order: those it holds (a half block
    holds its half's only; the other half's modules are None)."""
    return {name: block.get_submodule(name) for name in names if getattr(block, name.split(".")[0], None) is not None}


def mask_of(lin: nn.Module) -> torch.Tensor | None:
    """The mask of a pruned Linear, None if it was never pruned."""
    return lin.mask if isinstance(lin, PrunedLinear) else None


# ---- one pruning step's masks -------------------------------------------------------------


def weight_masks(host: Host, blocks: dict[int, nn.Module], names: tuple[str, ...], keep: int,
                 opts: PruneConfig) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
    """Unstructured: the masks of this rank's prunable Linear weights ({layer: {name: mask}}) after
    one global cut keeping `keep` weights over the model group (already-pruned weights stay
    out), and the number kept over the group."""
    score_list, owners, floors, keys = [], [], [], []
    for i, block in blocks.items():
        for name, lin in linears(block, names).items():
            j = names.index(name)  # the same key whether the block is placed whole or as halves
            old = mask_of(lin)
            score_list.append(scores(lin.weight.detach().abs(), None if old is None else old != 0, opts.scoring))
            owners.append((i, name))
            floors.append(floor_count(opts.min_density, lin.weight.numel()))
            keys.append(host.block_number(i) * len(names) + j)
    masks, kept = keep_with_floor(score_list, keep, floors, host.model_group, keys, host.num_blocks * len(names))
    per_block: dict[int, dict[str, torch.Tensor]] = {}
    for (i, name), mask in zip(owners, masks):
        per_block.setdefault(i, {})[name] = mask
    return per_block, kept


def unit_masks(host: Host, blocks: dict[int, nn.Module], keep: int, opts: PruneConfig,
               width: int) -> tuple[list[torch.Tensor], int]:
    """Structured: one mask over the MLP hidden units of each of this rank's blocks (in block
    order) after one global cut keeping `keep` units over the model group, and the number kept.
    `width` is a block's original MLP width; every block keeps at least one unit."""
    score_list = [scores(unit_scores(b.mlp), None, opts.scoring, width) for b in blocks.values()]
    floor = max(1, floor_count(opts.min_density, width))  # every block keeps >= 1 unit
    return keep_with_floor(score_list, keep, [floor] * len(score_list), host.model_group,
                           [host.block_number(i) for i in blocks], host.num_blocks)
