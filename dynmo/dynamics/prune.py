"""Gradual global magnitude pruning (Zhu & Gupta 2017; the paper's Appendix C/F.3), a `Case`.

Schedule: at steps t = t0 + j*dt (j = 0..n) the model is pruned to sparsity

    S_t = S_f + (S_i - S_f) * (1 - (t - t0) / (n * dt))^3

(`prune.start_step` = t0, `prune.every` = dt, `prune.times` = n; with S_i = 0 the j = 0 step
prunes nothing, so n steps do work: 0.9 with n = 4 gives 52%, 79%, 89%, 90%).

What is pruned: the blocks' Linear weights (attention qkv/proj, MLP fc/proj); never the
embedding, the head, norms or biases. The threshold is *global*: one cut over the scores of
all blocks on all pipeline ranks, so blocks end up with different densities (the imbalance
the balancer has to fix). The cut is the exact distributed top-k of `dynmo.dynamics.topk` over
the model group. What is ranked is `prune.scoring` (see `dynmo.dynamics.prunemask`):

- `magnitude`: |w|; the masks equal `torch.nn.utils.prune.global_unstructured(...,
  L1Unstructured, amount=...)` on the whole model. On GPT-2-initialised models it removes
  nearly all of the residual projections (attn.proj, mlp.proj: initialised 1/sqrt(2 n_layers)
  smaller) at high sparsity.
- `normalized`: |w| over its tensor's RMS, so every tensor is ranked in its own scale; the
  masks equal `global_unstructured` with these as `importance_scores`.
- `lamp`: the LAMP score (Lee et al. 2021), also per-tensor scale free.

`prune.min_density` (default 0.02; 0 = off) is a floor: each tensor first keeps its best
ceil(min_density * entries) candidates, and the global cut shares the rest of the budget over
everything else. The default, magnitude with a 2% floor, keeps the global magnitude ranking
and the blocks' different densities, and no tensor is wiped out (measured against the other
scorings in docs/dynamic-models.md); scoring = "magnitude" with min_density = 0 gives exactly
torch's masks. Scores and floors are computed from each tensor alone and ties at the cut are
broken by (block, Linear, position), so a block's mask does not depend on the rank that holds
it, and data-parallel replicas (identical weights) compute identical masks. Already-pruned
weights are never revived (they are excluded from the candidates, as `global_unstructured`
does with an existing mask).

Keeping pruned weights at zero: each pruned Linear becomes a `dynmo.model.sparse.PrunedLinear`
over the same parameters, whose forward applies the mask, so their gradients are zero (grad
norm and AdamW moments see only live weights); their AdamW moments are cleared when pruned;
and `after_step` re-applies the mask after every optimizer step (AdamW's momentum could
otherwise move a freshly pruned weight).

Compute shrinks with density: each pruned block runs its Linears with the masked dense or the
CSR kernel of `dynmo.model.sparse`, picked by measurement after every pruning step
(`prune.kernel = "auto"`; `dynmo.dynamics.prunekernel`) or fixed (`dense`, `csr`). Both
kernels compute the same function; the choice (and the two measured times) per block is in the
metrics. Data-parallel replicas sum their measurements so they pick alike.

Half-block units (`parallel.unit = "sublayer"`): each half prunes the Linears it holds, under
the same global cut and tie-break keys as its whole block, so the masks are those of whole
blocks; structured pruning narrows the MLP halves (the attention halves have no hidden units).
The kernel is chosen per unit.

Structured pruning (`prune.structured = true`): whole MLP hidden units (a row of fc and the
matching column of proj) are removed by a global criterion on their L2 norms (scored as above:
`normalized` divides by the RMS of the block's unit norms, removed units counting as zeros),
so the dense matrices really shrink (every block keeps at least one unit, and at least
ceil(min_density * width) units). A migrated block is rebuilt at full size and resizes
itself when loading the smaller weights (`dynmo.model.gpt.MLP`). Resuming: the
checkpoint's `dynmo.json` records every block's MLP width, and the blocks are narrowed to it
before the weights load (which weights survive is in the saved weights themselves); resuming
an unstructured run restores the masks from the saved zeros.

Per-layer metrics: prune_density (live / original Linear weights), prune_kernel (0 dense,
1 csr), prune_dense_ms / prune_csr_ms (measured fwd+bwd of the block's Linears at the last
pruning step), prune_macs_per_token (multiply-adds per token of the block's Linears under the
chosen kernel: nnz for csr, all entries for dense), prune_hidden (MLP width; structured).
Unstructured runs also record each pruned Linear's mask features (`dynmo.tensor.matrix`):
prune_rows_<stat> and prune_cols_<stat> for stat in nz_density, max, cv, imbal (nonzeros per
row and per column), each a list over the block's pruned Linears; and, with kernel = auto,
prune_dense_pred_ms / prune_csr_pred_ms: the block's kernel times as `KernelModel` predicted
them from those features before they were measured (fitted on this rank's earlier pruning
steps; absent at the first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from dynmo.config import ConfigError, ModelConfig, PruneConfig
from dynmo.dynamics.case import Case, Host
from dynmo.dynamics.prunemask import (
    SCORINGS,
    floor_count,
    keep_with_floor,
    linears,
    mask_of,
    scores,
    unit_masks,
    unit_scores,
    weight_masks,
)
from dynmo.dynamics.prunekernel import KernelChoice
from dynmo.dynamics.topk import group_sum
from dynmo.model.layers import block_class
from dynmo.model.sparse import KERNELS, PrunedLinear, set_mask

# the public names, with the scoring and the cut of prunemask that callers import from here
__all__ = ["PRUNABLE", "SCORINGS", "Prune", "check_options", "floor_count", "keep_with_floor", "scores", "shrink_mlp",
           "sparsity_at", "unit_scores"]

PRUNABLE = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # Linear modules of a block


# ---- schedule ---------------------------------------------------------------------------------


def check_options(p: PruneConfig, model: ModelConfig | None = None) -> None:
    if not 0.0 <= p.initial_sparsity < 1.0 or not 0.0 <= p.final_sparsity < 1.0:
        raise ConfigError(
            f"prune.initial_sparsity={p.initial_sparsity} and prune.final_sparsity={p.final_sparsity} "
            "must be in [0, 1) (fractions of the blocks' Linear weights removed)"
        )
    if p.final_sparsity < p.initial_sparsity:
        raise ConfigError("prune.final_sparsity must be >= prune.initial_sparsity (pruning only removes weights)")
    if p.times < 1 or p.every < 1 or p.start_step < 0:
        raise ConfigError(
            f"prune.times={p.times}, prune.every={p.every} must be >= 1 and prune.start_step={p.start_step} >= 0"
        )
    if p.scoring not in SCORINGS:
        raise ConfigError(f"prune.scoring={p.scoring!r}; use magnitude (raw |w|), normalized (|w| / the tensor's RMS) "
                          "or lamp (layer-adaptive magnitude)")
    if not 0.0 <= p.min_density < 1.0:
        raise ConfigError(f"prune.min_density={p.min_density} must be in [0, 1) (fraction of each tensor always kept; 0 = no floor)")
    if p.min_density > 1.0 - p.final_sparsity + 1e-9:
        raise ConfigError(f"prune.min_density={p.min_density} cannot hold at prune.final_sparsity={p.final_sparsity}: "
                          f"use min_density <= {1.0 - p.final_sparsity:.4g} (1 - final_sparsity), or 0 for no floor")
    if p.kernel not in ("auto", *KERNELS):
        raise ConfigError(f"prune.kernel={p.kernel!r}; use auto (measure per layer), dense or csr")
    if p.structured and p.kernel == "csr":
        raise ConfigError("prune.structured = true shrinks dense matrices; it has no CSR kernel (use kernel = auto or dense)")
    if model is not None:
        cls = block_class(model)
        if not getattr(cls, "prunable", None):
            raise ConfigError(f"pruning needs blocks with prunable Linears; model.block={model.block!r} of "
                              f"model.family={model.family!r} has none (prune.enabled = false, or another block)")
        if p.structured and not getattr(cls, "mlp_units", None):
            raise ConfigError(f"prune.structured = true removes GPT MLP units; model.family={model.family!r} "
                              f"model.block={model.block!r} has none (use prune.structured = false)")


def sparsity_at(step: int, p: PruneConfig) -> float | None:
    """Target sparsity if `step` is a pruning step (Zhu & Gupta's cubic schedule), else None."""
    j, r = divmod(step - p.start_step, p.every)
    if step < p.start_step or r or j > p.times:
        return None
    return p.final_sparsity + (p.initial_sparsity - p.final_sparsity) * (1.0 - j / p.times) ** 3


# ---- structured: MLP hidden units ---------------------------------------------------------


def shrink_mlp(mlp: nn.Module, keep: torch.Tensor) -> None:
    """Keep only the hidden units `keep` (index tensor): new, smaller fc and proj."""
    fc, proj = mlp.fc, mlp.proj
    new_fc = nn.Linear(fc.in_features, len(keep), bias=fc.bias is not None, device=fc.weight.device, dtype=fc.weight.dtype)
    new_proj = nn.Linear(len(keep), proj.out_features, bias=proj.bias is not None, device=proj.weight.device, dtype=proj.weight.dtype)
    with torch.no_grad():
        new_fc.weight.copy_(fc.weight[keep])
        if fc.bias is not None:
            new_fc.bias.copy_(fc.bias[keep])
        new_proj.weight.copy_(proj.weight[:, keep])
        if proj.bias is not None:
            new_proj.bias.copy_(proj.bias)
    mlp.fc, mlp.proj = new_fc, new_proj


def narrow_mlps(blocks: dict[int, nn.Module], masks: list[torch.Tensor], states: dict[int, dict]) -> None:
    """Shrink each block's MLP (in block order) to the units its mask keeps, and slice the AdamW
    moments in `states` (`Host.optimizer_states`) alike; a block keeping every unit is left as is."""
    for (i, block), mask in zip(blocks.items(), masks):
        if bool(mask.all()):
            continue
        idx = mask.nonzero().squeeze(1)
        st = states[i]
        for pname, dim in (("mlp.fc.weight", 0), ("mlp.fc.bias", 0), ("mlp.proj.weight", 1)):
            for k in ("exp_avg", "exp_avg_sq"):
                if pname in st and k in st[pname]:
                    st[pname][k] = st[pname][k].index_select(dim, idx).clone()
        shrink_mlp(block.mlp, idx)


# ---- the case -----------------------------------------------------------------------------


class Prune(Case):
    name = "prune"
    section = "prune"

    def __init__(self, host: Host):
        super().__init__(host)
        check_options(self.opts, host.cfg.model)
        m = host.cfg.model
        with torch.device("meta"):  # the block as built, to count what pruning starts from
            block = block_class(m)(m)
        self.names: tuple[str, ...] = block.prunable
        self.sizes = {n: block.get_submodule(n).weight.numel() for n in self.names}  # as built
        self.full_size = sum(self.sizes.values())  # Linear weights of one block
        self.full_hidden = block.mlp.fc.out_features if self.opts.structured else 0
        self.kernels = KernelChoice(host, self.opts, host.microbatch * m.seq_len)
        self.sparsity = 0.0
        self.hidden: list[int] | None = None  # structured: every block's MLP width, model-wide

    def state(self) -> dict:
        return {"hidden": self.hidden} if self.opts.structured and self.hidden else {}

    def load_state(self, state: dict) -> None:
        """Resume a structurally pruned run: narrow the blocks to their saved widths before
        the weights load (the loader fills tensors in place, so their shapes must match)."""
        hidden = state.get("hidden")
        if not hidden:
            return
        host = self.host
        if len(hidden) != host.num_blocks:
            raise ValueError(f"the checkpoint's prune state has {len(hidden)} block widths, the model has {host.num_blocks} blocks")
        self.hidden = [int(h) for h in hidden]
        states = host.optimizer_states()
        for i, block in self._mlp_units().items():
            width = self.hidden[host.block_number(i)]
            if width != block.mlp.fc.out_features:
                shrink_mlp(block.mlp, torch.arange(width))
                states.pop(i, None)  # the loader allocates and fills the narrower moments
        host.rebuild_optimizer(states)

    def _mlp_units(self) -> dict[int, nn.Module]:
        """This rank's blocks that hold an MLP (whole blocks, or MLP halves)."""
        return {i: b for i, b in self.host.blocks().items() if getattr(b, "mlp", None) is not None}

    def after_load(self, step: int) -> None:
        done = [t for t in range(step) if (sparsity_at(t, self.opts) or 0.0) > 0.0]
        if done and not self.opts.structured:
            self._restore_masks(sparsity_at(done[-1], self.opts))

    def _restore_masks(self, s: float) -> None:
        """Resuming a pruned run: pruned weights were saved as exact zeros, the masks are those."""
        self.sparsity = s
        blocks = self.host.blocks()
        per_block = {i: {n: lin.weight.detach() != 0 for n, lin in linears(b, self.names).items()} for i, b in blocks.items()}
        self._apply_masks(blocks, per_block)

    # ---- hooks ----
    def before_step(self, step: int) -> list[dict]:
        s = sparsity_at(step, self.opts)
        if s is None or s <= 0.0:
            return []
        self.sparsity = s
        if self.opts.structured:
            return [self._prune_structured(step, s)]
        return [self._prune_unstructured(step, s)]

    def _prune_unstructured(self, step: int, s: float) -> dict:
        blocks = self.host.blocks()
        total = self.host.num_blocks * self.full_size
        keep = total - round(s * total)  # torch.nn.utils.prune rounds the same way
        per_block, kept = weight_masks(self.host, blocks, self.names, keep, self.opts)
        for i, ms in per_block.items():
            for name, mask in ms.items():
                self._clear_state(blocks[i].get_submodule(name).weight, mask)
        self._apply_masks(blocks, per_block)
        return {"type": "dynamism", "step": step, "sparsity": s, "kept": kept, "total": total,
                "scoring": self.opts.scoring, "min_density": self.opts.min_density}

    def _apply_masks(self, blocks: dict[int, nn.Module], per_block: dict[int, dict[str, torch.Tensor]]) -> None:
        self.kernels.choose(blocks, per_block)
        for i, ms in per_block.items():
            for name, mask in ms.items():
                set_mask(blocks[i], name, mask, self.kernels.kernel[i])

    def _clear_state(self, p: torch.Tensor, mask: torch.Tensor) -> None:
        st = self.host.optimizer_state(p)
        for k in ("exp_avg", "exp_avg_sq"):
            if st and k in st:
                st[k].mul_(mask)

    def _prune_structured(self, step: int, s: float) -> dict:
        host = self.host
        blocks = self._mlp_units()
        total = host.num_blocks * self.full_hidden
        keep = total - round(s * total)
        masks, kept = unit_masks(host, blocks, keep, self.opts, self.full_hidden)
        states = host.optimizer_states()
        narrow_mlps(blocks, masks, states)
        # the optimizer holds the old Parameters: rebuild it over the new ones, moments carried
        host.rebuild_optimizer(states)
        # every block's width, model-wide (a checkpoint records it for resuming)
        widths = torch.zeros(host.num_blocks, dtype=torch.int64)
        for i, block in blocks.items():
            widths[host.block_number(i)] = block.mlp.fc.out_features
        self.hidden = group_sum(widths, host.model_group).tolist()
        return {"type": "dynamism", "step": step, "sparsity": s, "structured": True, "kept_units": kept, "total_units": total,
                "scoring": self.opts.scoring, "min_density": self.opts.min_density}

    def after_step(self, step: int, result: Any) -> list[dict]:
        with torch.no_grad():
            for block in self.host.blocks().values():
                for lin in linears(block, self.names).values():
                    mask = mask_of(lin)
                    if mask is not None:
                        lin.weight.mul_(mask)
        return []

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        out: dict[str, dict[int, Any]] = {}
        for i, block in self.host.blocks().items():
            live = 0
            macs = 0
            for lin in linears(block, self.names).values():
                mask = mask_of(lin)
                nnz = lin.weight.numel() if mask is None else int(mask.sum())
                live += nnz
                macs += nnz if isinstance(lin, PrunedLinear) and lin.kernel == "csr" else lin.weight.numel()
            out.setdefault("prune_density", {})[i] = live / sum(self.sizes[n] for n in linears(block, self.names))
            out.setdefault("prune_macs_per_token", {})[i] = macs
            self.kernels.stats(i, out)
            if self.opts.structured and getattr(block, "mlp", None) is not None:
                out.setdefault("prune_hidden", {})[i] = block.mlp.fc.out_features
        return out

    # ---- migration: masks, kernel and timings travel with the block ----
    def pack_layer(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        if not self.host.is_block(index) or self.opts.structured:
            return {}  # structured: the smaller weights themselves carry the state
        out = {}
        for name, lin in linears(layer, self.names).items():
            mask = mask_of(lin)
            if mask is not None:
                out[f"mask.{name}"] = mask.bool()
        return out | self.kernels.pack(index)

    def unpack_layer(self, index: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        self.kernels.unpack(index, tensors)  # first: the masks below are set under the block's kernel
        for key, mask in tensors.items():
            if key.startswith("mask."):
                set_mask(layer, key[5:], mask, self.kernels.of(index))
