"""Dynamic-model blocks: drop-in replacements for `dynmo.model.gpt.Block` whose work changes
during training (SPEC component 5).

    moe.py       "moe"       Mixtral-style token-choice top-k Mixture of Experts MLP
    hashattn.py  "hashattn"  hash-based dynamic sparse causal attention (Pagliardini et al. 2023)
    mod.py       "mod"       Mixture of Depths: top-k tokens per sequence go through the block

Importing this package registers the three variants in `dynmo.model.gpt.BLOCKS`, so
`model.block = "moe"` (etc.) builds them. Every variant takes `(cfg: ModelConfig)` and maps
`(x, mask) -> (x, mask)` with the shapes of `Block`.

The plug-in interface for cases that change the model during training (pruning, freezing,
early exit, and the statistics of the blocks above) is `dynmo.dynamics.case.Case`.

Two things all the blocks share live here:

- `attach_aux_loss`: a block's auxiliary loss (MoE balance loss, MoD predictor loss) cannot be
  added to the loss, which exists only on the last pipeline stage. The block instead returns
  its output through an identity autograd Function whose backward also seeds the auxiliary
  loss with gradient `coef` (Megatron-Core's MoEAuxLossAutoScaler). The parameter gradients
  then equal those of `(main_loss + coef * aux_loss).backward()`.
- `StepStats`: per-layer statistics accumulated over the forwards (microbatches) of one step;
  each block exposes them as the plain dict `block.last_stats`, cleared by
  `block.reset_stats()`.
"""

from __future__ import annotations

import torch


class _AuxLossScaler(torch.autograd.Function):
    """Identity on `x`; backward also sends gradient `coef` into the scalar `aux`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, coef: float):
        ctx.coef = coef
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        # A copy, not `x` itself: an output aliasing an input would be a view that autograd
        # forbids modifying in place, and later code (or a schedule) may do that.
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.coef, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    """Return `x` unchanged, carrying `coef * aux` into the backward pass.

    Gradient scaling: the pipeline schedule back-propagates each microbatch's loss unscaled
    and divides all gradients by the number of microbatches at the end (torch pipelining's
    `scale_grads`). The auxiliary gradient is seeded per microbatch with `coef` and divided the
    same way, so the objective is the microbatch mean of `main + coef * aux`, exactly as a
    single process that averages `main + coef * aux` over the same microbatches. If a runtime
    instead scales the *loss* by 1/n_microbatches, pass `coef / n_microbatches` here.
    """
    if coef == 0.0 or not torch.is_grad_enabled() or not aux.requires_grad:
        return x
    return _AuxLossScaler.apply(x, aux, float(coef))


class StepStats:
    """Sums of per-forward quantities since the last reset. Values are python numbers/lists."""

    def __init__(self):
        self.forwards = 0
        self.sums: dict[str, float | list[float]] = {}

    def add(self, **values) -> None:
        self.forwards += 1
        for key, v in values.items():
            if isinstance(v, list):
                old = self.sums.get(key)
                self.sums[key] = v if old is None else [a + b for a, b in zip(old, v)]
            else:
                self.sums[key] = self.sums.get(key, 0) + v

    def mean(self, key: str) -> float:
        return self.sums[key] / self.forwards if self.forwards else 0.0


# Register the block variants and the cases (after the helpers above: the modules import them).
from dynmo.dynamics import case, earlyexit, freeze, hashattn, mod, moe, prune  # noqa: E402,F401
