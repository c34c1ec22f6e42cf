"""Gradual global magnitude pruning (Zhu & Gupta 2017; the paper's Appendix C/F.3), a `Case`.

Schedule: at steps t = t0 + j*dt (j = 0..n) the model is pruned to sparsity

    S_t = S_f + (S_i - S_f) * (1 - (t - t0) / (n * dt))^3

(`prune.start_step` = t0, `prune.every` = dt, `prune.times` = n; with S_i = 0 the j = 0 step
prunes nothing, so n steps do work: 0.9 with n = 4 gives 52%, 79%, 89%, 90%).

What is pruned: the blocks' Linear weights (attention qkv/proj, MLP fc/proj); never the
embedding, the head, norms or biases. The threshold is *global*: one magnitude cut over all
blocks on all pipeline ranks, so blocks end up with different densities (the imbalance the
balancer has to fix).

Distributed global top-k (`global_keep`): the paper's Algorithm 2 gathers every rank's local
top-k values on rank 0. We compute the same set with 32 scalar all-reduces instead of
O(k) values: a bisection on the float bit pattern finds the exact k-th largest magnitude v*
over all ranks (for non-negative floats the int32 view is monotone), each rank keeps its
entries > v*, and the ties at v* are shared out in rank order so exactly k survive. The result
equals `torch.nn.utils.prune.global_unstructured(..., L1Unstructured, amount=...)` on the whole
model (up to the order among exactly equal magnitudes, where torch's topk is unspecified).
Already-pruned weights are never revived (they are excluded from the candidates, as
`global_unstructured` does with an existing mask).

Keeping pruned weights at zero: the forward multiplies the weight by its mask, so their
gradients are zero (grad norm and AdamW moments see only live weights); their AdamW moments
are cleared when pruned; and `after_step` re-applies the mask after every optimizer step
(AdamW's momentum could otherwise move a freshly pruned weight).

Compute shrinks with density: each pruned block runs its Linears with one of two kernels,
picked by measurement after every pruning step (`prune.kernel = "auto"`):
    dense  masked dense matmul (cost independent of density);
    csr    torch sparse CSR: y = W_csr x (cost ~ nnz), grad x = W^T_csr g, grad W only at the
           nnz positions (`torch.sparse.sampled_addmm`), scattered into the *dense* weight's
           gradient. The optimizer keeps dense values (AdamW cannot step a CSR tensor); the
           CSR view is rebuilt from them in every forward (a gather of nnz values).
Both kernels compute the same function; the choice (and the two measured times) per block is
in the metrics. Data-parallel replicas sum their measurements so they pick alike.

Structured pruning (`prune.structured = true`): whole MLP hidden units (a row of fc and the
matching column of proj) are removed by a global L2-norm criterion, so the dense matrices
really shrink (every block keeps at least one unit). A migrated block is rebuilt at full size
and resizes itself when loading the smaller weights (`dynmo.model.gpt.MLP`). Resuming: the
checkpoint's `dynmo.json` records every block's MLP width, and the blocks are narrowed to it
before the weights load (which weights survive is in the saved weights themselves); resuming
an unstructured run restores the masks from the saved zeros.

Per-layer metrics: prune_density (live / original Linear weights), prune_kernel (0 dense,
1 csr), prune_dense_ms / prune_csr_ms (measured fwd+bwd of the block's Linears at the last
pruning step), prune_macs_per_token (multiply-adds per token of the block's Linears under the
chosen kernel: nnz for csr, all entries for dense), prune_hidden (MLP width; structured).
"""

from __future__ import annotations

import time
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import ConfigError, PruneConfig
from dynmo.dynamics.case import Case, register_case

PRUNABLE = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # Linear modules of a block
KERNELS = ("dense", "csr")

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")


# ---- schedule ---------------------------------------------------------------------------------


def check_options(p: PruneConfig) -> None:
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
    if p.kernel not in ("auto", *KERNELS):
        raise ConfigError(f"prune.kernel={p.kernel!r}; use auto (measure per layer), dense or csr")
    if p.structured and p.kernel == "csr":
        raise ConfigError("prune.structured = true shrinks dense matrices; it has no CSR kernel (use kernel = auto or dense)")


def sparsity_at(step: int, p: PruneConfig) -> float | None:
    """Target sparsity if `step` is a pruning step (Zhu & Gupta's cubic schedule), else None."""
    j, r = divmod(step - p.start_step, p.every)
    if step < p.start_step or r or j > p.times:
        return None
    return p.final_sparsity + (p.initial_sparsity - p.final_sparsity) * (1.0 - j / p.times) ** 3


# ---- distributed global top-k --------------------------------------------------------------


def _distributed(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def _sum(t: torch.Tensor, group) -> torch.Tensor:
    """`t` summed over the ranks of `group` (in place; no-op on one rank)."""
    if _distributed(group):
        dist.all_reduce(t, group=group)
    return t


def _count(t: torch.Tensor, group) -> int:
    return int(_sum(t, group))


def global_keep(scores: list[torch.Tensor], keep: int, group=None) -> list[torch.Tensor]:
    """Boolean masks keeping the `keep` largest scores over all tensors on all ranks of `group`.

    `scores` are non-negative float tensors (magnitudes); entries < 0 are not candidates
    (already pruned) and are never kept. Every rank of `group` must call this. Exact: the
    k-th largest value is found by bisection on the float32 bit pattern (32 all-reduces of one
    integer), ties at the threshold are kept in rank order, then position order.
    """
    flat = torch.cat([s.detach().reshape(-1).float() for s in scores]) if scores else torch.zeros(0)
    bits = flat.view(torch.int32)  # non-negative floats: int order == float order; negatives < 0
    lo, hi = 0, 0x7F800000  # [0, +inf]
    total = _count(torch.tensor([int((bits >= 0).sum())], dtype=torch.int64), group)
    keep = max(0, min(keep, total))
    if keep == 0:
        thr, keep_mask = hi + 1, torch.zeros_like(bits, dtype=torch.bool)
    else:
        # largest b with count(bits >= b) >= keep: that is the keep-th largest value
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _count(torch.tensor([int((bits >= mid).sum())], dtype=torch.int64), group) >= keep:
                lo = mid
            else:
                hi = mid - 1
        thr = lo
        above = bits > thr
        ties = bits == thr
        n_above = _count(torch.tensor([int(above.sum())], dtype=torch.int64), group)
        need = keep - n_above  # ties to keep, handed out in rank order
        my_ties = int(ties.sum())
        before = 0
        if _distributed(group):
            counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
            dist.all_gather(counts, torch.tensor([my_ties], dtype=torch.int64), group=group)
            before = sum(int(c) for c in counts[: dist.get_rank(group)])
        mine = max(0, min(my_ties, need - before))
        keep_mask = above.clone()
        if mine:
            keep_mask[ties.nonzero().squeeze(1)[:mine]] = True
    out, off = [], 0
    for s in scores:
        out.append(keep_mask[off : off + s.numel()].view(s.shape))
        off += s.numel()
    return out


# ---- kernels ------------------------------------------------------------------------------


class _CSRLinear(torch.autograd.Function):
    """y = x W^T + b with W given by its dense tensor and a fixed sparsity pattern.

    Work is proportional to nnz: forward and input-gradient are CSR x dense products, the
    weight gradient is computed only at the pattern (`sampled_addmm`), then scattered into a
    dense gradient so the optimizer keeps stepping dense values.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, pat):
        values = weight.reshape(-1).index_select(0, pat.flat)
        w = torch.sparse_csr_tensor(pat.crow, pat.col, values, weight.shape, check_invariants=False)
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.sparse.mm(w, x2.t()).t()
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2, values)
        ctx.pat, ctx.has_bias, ctx.shape = pat, bias is not None, weight.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, values = ctx.saved_tensors
        pat = ctx.pat
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            wt = torch.sparse_csr_tensor(
                pat.t_crow, pat.t_col, values.index_select(0, pat.t_perm), (ctx.shape[1], ctx.shape[0]), check_invariants=False
            )
            gx = torch.sparse.mm(wt, g2.t()).t().reshape(*grad.shape[:-1], ctx.shape[1])
        if ctx.needs_input_grad[1]:
            sampled = torch.sparse.sampled_addmm(pat.pattern, g2.t().contiguous(), x2, beta=0.0)
            gw = torch.zeros(ctx.shape[0] * ctx.shape[1], dtype=g2.dtype, device=g2.device)
            gw = gw.index_copy_(0, pat.flat, sampled.values()).view(ctx.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None


class Pattern:
    """The CSR structure of a mask (and of its transpose), fixed between pruning steps."""

    def __init__(self, mask: torch.Tensor):
        rows, cols = mask.shape
        self.flat = mask.reshape(-1).nonzero().squeeze(1)  # row-major == CSR value order
        r, c = self.flat // cols, self.flat % cols
        self.crow = torch.zeros(rows + 1, dtype=torch.int64, device=mask.device)
        self.crow[1:] = torch.bincount(r, minlength=rows).cumsum(0)
        self.col = c
        self.pattern = torch.sparse_csr_tensor(
            self.crow, self.col, torch.ones(len(c), device=mask.device), (rows, cols), check_invariants=False
        )
        # transpose: values sorted by (col, row)
        self.t_perm = (c * rows + r).argsort()
        self.t_crow = torch.zeros(cols + 1, dtype=torch.int64, device=mask.device)
        self.t_crow[1:] = torch.bincount(c, minlength=cols).cumsum(0)
        self.t_col = r.index_select(0, self.t_perm)
        self.nnz = len(c)


def _pruned_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if self.prune_kernel == "csr":
        return _CSRLinear.apply(x, self.weight, self.bias, self.prune_pattern)
    return F.linear(x, self.weight * self.prune_mask, self.bias)


def set_mask(lin: nn.Linear, mask: torch.Tensor, kernel: str) -> None:
    """Run `lin` with `mask` under `kernel`; its weights outside the mask are zeroed."""
    with torch.no_grad():
        lin.weight.mul_(mask)
    lin.prune_mask = mask.to(lin.weight.dtype)
    lin.prune_pattern = Pattern(mask) if kernel == "csr" else None
    lin.prune_kernel = kernel
    lin.forward = types.MethodType(_pruned_forward, lin)  # instance attribute shadows Linear.forward


def time_kernels(lin: nn.Linear, mask: torch.Tensor, rows: int, reps: int = 3) -> dict[str, float]:
    """Seconds of one forward + backward of `lin` on `rows` random rows, per kernel (min of reps)."""
    out = {}
    x = torch.randn(rows, lin.in_features, device=lin.weight.device)
    w = lin.weight.detach().clone().requires_grad_(True)
    b = None if lin.bias is None else lin.bias.detach().clone().requires_grad_(True)
    m = mask.to(w.dtype)
    pat = Pattern(mask)
    for kernel in KERNELS:
        best = float("inf")
        for _ in range(reps):
            xi = x.clone().requires_grad_(True)
            t = time.perf_counter()
            y = F.linear(xi, w * m, b) if kernel == "dense" else _CSRLinear.apply(xi, w, b, pat)
            y.sum().backward()
            best = min(best, time.perf_counter() - t)
        out[kernel] = best
    return out


# ---- structured: MLP hidden units ---------------------------------------------------------


def unit_scores(mlp: nn.Module) -> torch.Tensor:
    """L2 norm of each hidden unit's weights: its fc row, fc bias and proj column."""
    fc, proj = mlp.fc, mlp.proj
    sq = fc.weight.detach().pow(2).sum(1) + proj.weight.detach().pow(2).sum(0)
    if fc.bias is not None:
        sq = sq + fc.bias.detach().pow(2)
    return sq.sqrt()


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


# ---- the case -----------------------------------------------------------------------------


@register_case("prune")
class Prune(Case):
    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.prune.enabled

    def __init__(self, trainer):
        super().__init__(trainer)
        self.opts: PruneConfig = trainer.cfg.prune
        check_options(self.opts)
        m = trainer.cfg.model
        self.rows = trainer.pipe.microbatch * m.seq_len  # tokens per microbatch: the timing input
        d, h = m.d_model, m.mlp_ratio * m.d_model
        self.full_size = 3 * d * d + d * d + d * h + h * d  # Linear weights of one block
        self.full_hidden = h
        self.kernel: dict[int, str] = {}  # layer index -> chosen kernel (unstructured, after pruning)
        self.timings: dict[int, dict[str, float]] = {}
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
        if len(hidden) != self._num_blocks():
            raise ValueError(f"the checkpoint's prune state has {len(hidden)} block widths, the model has {self._num_blocks()} blocks")
        self.hidden = [int(h) for h in hidden]
        pipe = self.trainer.pipe
        states = pipe.optimizer_states()
        for i, block in self._blocks().items():
            width = self.hidden[pipe.specs[i].index - 1]
            if width != block.mlp.fc.out_features:
                shrink_mlp(block.mlp, torch.arange(width))
                states.pop(i, None)  # the loader allocates and fills the narrower moments
        pipe.rebuild_optimizer(states)

    def after_load(self, step: int) -> None:
        done = [t for t in range(step) if (sparsity_at(t, self.opts) or 0.0) > 0.0]
        if done and not self.opts.structured:
            self._restore_masks(sparsity_at(done[-1], self.opts))

    def _restore_masks(self, s: float) -> None:
        """Resuming a pruned run: pruned weights were saved as exact zeros, the masks are those."""
        self.sparsity = s
        blocks = self._blocks()
        per_block = {i: {n: lin.weight.detach() != 0 for n, lin in self._linears(b).items()} for i, b in blocks.items()}
        self._choose_kernels(blocks, per_block)
        for i, ms in per_block.items():
            for name, mask in ms.items():
                set_mask(blocks[i].get_submodule(name), mask, self.kernel[i])

    # ---- helpers ----
    def _blocks(self) -> dict[int, nn.Module]:
        pipe = self.trainer.pipe
        return {i: pipe.layers[i] for i in sorted(pipe.layers) if pipe.specs[i].kind == "t"}

    @staticmethod
    def _linears(block: nn.Module) -> dict[str, nn.Linear]:
        return {name: block.get_submodule(name) for name in PRUNABLE}

    def _num_blocks(self) -> int:
        return self.trainer.cfg.model.n_layers

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
        blocks = self._blocks()
        total = self._num_blocks() * self.full_size
        keep = total - round(s * total)  # torch.nn.utils.prune rounds the same way
        scores, owners = [], []
        for i, block in blocks.items():
            for name, lin in self._linears(block).items():
                w = lin.weight.detach().abs()
                old = getattr(lin, "prune_mask", None)
                scores.append(w if old is None else w.masked_fill(old == 0, -1.0))
                owners.append((i, name))
        masks = global_keep(scores, keep, self.trainer.ctx.pp_group)
        for (i, name), mask in zip(owners, masks):
            self._clear_state(blocks[i].get_submodule(name).weight, mask)
        per_block: dict[int, dict[str, torch.Tensor]] = {}
        for (i, name), mask in zip(owners, masks):
            per_block.setdefault(i, {})[name] = mask
        self._choose_kernels(blocks, per_block)
        for i, ms in per_block.items():
            for name, mask in ms.items():
                set_mask(blocks[i].get_submodule(name), mask, self.kernel[i])
        return {"type": "dynamism", "step": step, "sparsity": s, "kept": keep, "total": total}

    def _clear_state(self, p: torch.Tensor, mask: torch.Tensor) -> None:
        st = self.trainer.pipe.optimizer.state.get(p)
        for k in ("exp_avg", "exp_avg_sq"):
            if st and k in st:
                st[k].mul_(mask)

    def _choose_kernels(self, blocks: dict[int, nn.Module], per_block: dict[int, dict[str, torch.Tensor]]) -> None:
        n = len(self.trainer.pipe.specs)
        t = torch.zeros(n, 2, dtype=torch.float64)
        if self.opts.kernel == "auto":
            for i, ms in per_block.items():
                for name, mask in ms.items():
                    r = time_kernels(blocks[i].get_submodule(name), mask, self.rows)
                    t[i, 0] += r["dense"]
                    t[i, 1] += r["csr"]
            dp = self.trainer.ctx.dp_group
            if dp is not None:  # replicas pick alike
                dist.all_reduce(t, group=dp)
                t /= self.trainer.ctx.dp
        for i in per_block:
            if self.opts.kernel == "auto":
                self.kernel[i] = "csr" if t[i, 1] < t[i, 0] else "dense"
                self.timings[i] = {"dense": float(t[i, 0]), "csr": float(t[i, 1])}
            else:
                self.kernel[i] = self.opts.kernel

    def _prune_structured(self, step: int, s: float) -> dict:
        blocks = self._blocks()
        total = self._num_blocks() * self.full_hidden
        keep = total - round(s * total)
        scores = [unit_scores(b.mlp) for b in blocks.values()]
        masks = global_keep(scores, keep, self.trainer.ctx.pp_group)
        pipe = self.trainer.pipe
        states = pipe.optimizer_states()
        for (i, block), mask in zip(blocks.items(), masks):
            if not mask.any():  # every block keeps its strongest unit
                mask = mask.clone()
                mask[scores[list(blocks).index(i)].argmax()] = True
            if bool(mask.all()):
                continue
            idx = mask.nonzero().squeeze(1)
            st = states[i]
            for pname, dim in (("mlp.fc.weight", 0), ("mlp.fc.bias", 0), ("mlp.proj.weight", 1)):
                for k in ("exp_avg", "exp_avg_sq"):
                    if pname in st and k in st[pname]:
                        st[pname][k] = st[pname][k].index_select(dim, idx).clone()
            shrink_mlp(block.mlp, idx)
        # the optimizer holds the old Parameters: rebuild it over the new ones, moments carried
        pipe.rebuild_optimizer(states)
        # every block's width, model-wide (a checkpoint records it for resuming)
        widths = torch.zeros(self._num_blocks(), dtype=torch.int64)
        for i, block in blocks.items():
            widths[pipe.specs[i].index - 1] = block.mlp.fc.out_features
        self.hidden = _sum(widths, self.trainer.ctx.pp_group).tolist()
        return {"type": "dynamism", "step": step, "sparsity": s, "structured": True, "kept_units": keep, "total_units": total}

    def after_step(self, step: int, result: Any) -> list[dict]:
        with torch.no_grad():
            for block in self._blocks().values():
                for lin in self._linears(block).values():
                    mask = getattr(lin, "prune_mask", None)
                    if mask is not None:
                        lin.weight.mul_(mask)
        return []

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        out: dict[str, dict[int, Any]] = {}
        for i, block in self._blocks().items():
            lins = self._linears(block).values()
            live = 0
            macs = 0
            for lin in lins:
                mask = getattr(lin, "prune_mask", None)
                nnz = lin.weight.numel() if mask is None else int(mask.sum())
                live += nnz
                macs += nnz if getattr(lin, "prune_kernel", "dense") == "csr" else lin.weight.numel()
            out.setdefault("prune_density", {})[i] = live / self.full_size
            out.setdefault("prune_macs_per_token", {})[i] = macs
            out.setdefault("prune_kernel", {})[i] = float(self.kernel.get(i, "dense") == "csr")
            if i in self.timings:
                out.setdefault("prune_dense_ms", {})[i] = 1e3 * self.timings[i]["dense"]
                out.setdefault("prune_csr_ms", {})[i] = 1e3 * self.timings[i]["csr"]
            if self.opts.structured:
                out.setdefault("prune_hidden", {})[i] = block.mlp.fc.out_features
        return out

    # ---- migration: masks, kernel and timings travel with the block ----
    def pack_layer(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        if self.trainer.pipe.specs[index].kind != "t" or self.opts.structured:
            return {}  # structured: the smaller weights themselves carry the state
        out = {}
        for name, lin in self._linears(layer).items():
            if getattr(lin, "prune_mask", None) is not None:
                out[f"mask.{name}"] = lin.prune_mask.bool()
        if index in self.kernel:
            out["kernel"] = torch.tensor([KERNELS.index(self.kernel.pop(index))])
        if index in self.timings:
            tm = self.timings.pop(index)
            out["timings"] = torch.tensor([tm["dense"], tm["csr"]], dtype=torch.float64)
        return out

    def unpack_layer(self, index: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        if "kernel" in tensors:
            self.kernel[index] = KERNELS[int(tensors["kernel"])]
        if "timings" in tensors:
            d, c = tensors["timings"].tolist()
            self.timings[index] = {"dense": d, "csr": c}
        for key, mask in tensors.items():
            if key.startswith("mask."):
                set_mask(layer.get_submodule(key[5:]), mask, self.kernel.get(index, "dense"))
