"""CALM-style early exit of tokens (Schuster et al. 2022; the paper's F.6), a `Case`.

After every block from `early_exit.first_block` on, a per-token confidence decides which of
the still-active tokens exit. An exited token keeps its hidden state from then on: later blocks
do not update it, and the head computes its logits (and the loss) from that final state.

Which confidence: CALM's strongest measure is the softmax response of the shared LM head, but
in a pipeline the head lives only on the last stage, so no earlier stage can evaluate it (and a
per-block copy of a vocabulary-sized head would cost more than the block). We use CALM's
learned alternative: a small per-block classifier, a Linear(d_model, 1) on the normalised,
detached hidden state, `conf = sigmoid(exit_head(layer_norm(h)))`; a token exits when
`conf >= early_exit.threshold`. Its training signal must also be local: the label is CALM's
hidden-state saturation, `cos(h_out, h_in) >= early_exit.saturation` (the block barely changed
the token, so later blocks are likely to change it little too). The binary cross-entropy over
the active tokens is carried into the backward pass by `attach_aux_loss` (coefficient
`early_exit.aux_loss_coef`); the detached input keeps it from changing the model itself. The
classifier trains from step 0; tokens exit from `early_exit.start_step` on.

Compute only on active tokens (`ExitRouter`, installed as `block.token_router`): per sequence,
the active positions are gathered (padded to the most active sequence of the microbatch;
padding rows are exited tokens, whose result is discarded), and the block runs its query
projection, attention, output projection and MLP on those rows only. Exited tokens still serve
as keys and values, with their frozen hidden state (CALM's state propagation): the block
projects K and V for every token, about 1/6 of a block's matmul work, and active tokens attend
causally to all earlier positions. So an active token's output is exactly what the dense block
would give it. When every token is active, the router runs the dense block unchanged.

Shapes crossing stage boundaries stay fixed: the hidden state keeps [batch, seq, d_model] and
the bool mask of active tokens travels with it (dynmo.model.gpt: "pad, do not compact").

Per-layer metrics (summed over the step's microbatch forwards): exit_active_tokens (tokens the
block computed on), exit_rows (rows it computed, incl. padding), exit_tokens (tokens that
exited after it), exit_rate (exit_tokens / exit_active_tokens), exit_confidence (mean over
active tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import ConfigError, EarlyExitConfig
from dynmo.dynamics import StepStats, attach_aux_loss
from dynmo.dynamics.case import Case, register_case


def check_options(e: EarlyExitConfig, cfg) -> None:
    n = cfg.model.n_layers
    if not 0 <= e.first_block < n:
        raise ConfigError(f"early_exit.first_block={e.first_block} must be a block number in 0..{n - 1}")
    if not 0.0 <= e.threshold <= 1.0:
        raise ConfigError(f"early_exit.threshold={e.threshold} must be in [0, 1] (a confidence)")
    if not -1.0 <= e.saturation <= 1.0:
        raise ConfigError(f"early_exit.saturation={e.saturation} must be in [-1, 1] (a cosine similarity)")
    if e.start_step < 0 or e.aux_loss_coef < 0:
        raise ConfigError("early_exit.start_step and early_exit.aux_loss_coef must be >= 0")
    if cfg.model.block != "dense":
        raise ConfigError(
            f"early_exit works on the dense block; model.block={cfg.model.block!r} routes tokens itself "
            "(set model.block = \"dense\" or early_exit.enabled = false)"
        )


def active_forward(block: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`block` on the active tokens only; inactive tokens pass bit for bit and serve as keys/values.

    Returns the new hidden state and the number of rows computed per sequence.
    """
    B, T, D = x.shape
    A = int(mask.sum(1).max())
    if A == 0:  # every token has exited: nothing to compute (a copy, never an alias of the input)
        return x.clone(), 0
    pos = torch.arange(T, device=x.device)
    # active positions first (in position order), then inactive ones as padding: distinct
    # positions, so the scatter below writes every position at most once
    idx = (pos + T * (~mask)).argsort(dim=1)[:, :A]
    valid = mask.gather(1, idx)
    g = idx.unsqueeze(-1).expand(-1, -1, D)
    attn = block.attn
    H = attn.n_heads
    h = block.ln1(x)
    w, b = attn.qkv.weight, attn.qkv.bias
    kv = F.linear(h, w[D:], None if b is None else b[D:])  # keys/values of every token
    q = F.linear(h.gather(1, g), w[:D], None if b is None else b[:D])  # queries of the active ones
    k, v = kv.split(D, dim=2)
    q = q.view(B, A, H, D // H).transpose(1, 2)
    k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (k, v))
    causal = (pos.view(1, 1, T) <= idx.unsqueeze(-1)).unsqueeze(1)  # [B, 1, A, T]
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal, dropout_p=attn.dropout if block.training else 0.0
    )
    sel = x.gather(1, g)
    s = sel + attn.proj(y.transpose(1, 2).contiguous().view(B, A, D))
    hm = block.ln2(s)
    m = block.mlp(hm)
    for _ in range(block.extra_mlp_passes):
        m = m + 0.0 * block.mlp(hm)
    new = torch.where(valid.unsqueeze(-1), s + m, sel)
    return x.scatter(1, g, new), A


class ExitRouter:
    """`block.token_router`: compute active tokens only, then (exit blocks) let confident ones exit."""

    def __init__(self, opts: EarlyExitConfig, can_exit: bool):
        self.opts = opts
        self.can_exit = can_exit
        self.exiting = False  # set per step by the case (start_step)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = StepStats()

    def __call__(self, block: nn.Module, x: torch.Tensor, mask: torch.Tensor):
        B, T, D = x.shape
        n_active = int(mask.sum())
        if n_active == B * T:
            out, rows = block.dense_forward(x, mask)[0], T
        else:
            out, rows = active_forward(block, x, mask)
        exited, conf_sum = 0, 0.0
        if self.can_exit and block.exit_head is not None and n_active:
            active_in = mask
            logit = block.exit_head(F.layer_norm(out.detach(), (D,))).squeeze(-1)  # [B, T]
            with torch.no_grad():
                conf = torch.sigmoid(logit)
                label = (F.cosine_similarity(out, x, dim=-1) >= self.opts.saturation).to(logit.dtype)
                conf_sum = float(conf[active_in].sum())
                if self.exiting:
                    leave = active_in & (conf >= self.opts.threshold)
                    exited = int(leave.sum())
                    mask = active_in & ~leave
            bce = F.binary_cross_entropy_with_logits(logit, label, reduction="none")
            aux = bce.masked_select(active_in).mean()  # tokens that were active at this block
            out = attach_aux_loss(out, aux, self.opts.aux_loss_coef)
        self.stats.add(active_tokens=n_active, rows=B * rows, exited=exited, conf_sum=conf_sum)
        return out, mask

    def summary(self) -> dict[str, float]:
        s = self.stats.sums
        if not self.stats.forwards:
            return {}
        out = {"active_tokens": s["active_tokens"], "rows": s["rows"]}
        if self.can_exit:
            out["tokens"] = s["exited"]
            out["rate"] = s["exited"] / s["active_tokens"] if s["active_tokens"] else 0.0
            out["confidence"] = s["conf_sum"] / s["active_tokens"] if s["active_tokens"] else 0.0
        return out


@register_case("early-exit")
class EarlyExit(Case):
    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.early_exit.enabled

    def __init__(self, trainer):
        super().__init__(trainer)
        self.opts: EarlyExitConfig = trainer.cfg.early_exit
        check_options(self.opts, trainer.cfg)
        pipe = trainer.pipe
        states = pipe.optimizer_states()
        for i, layer in self._blocks().items():
            self._install(i, layer, new_head=True)
        # the optimizer was built before the exit classifiers existed
        pipe.rebuild_optimizer(states)

    def _blocks(self) -> dict[int, nn.Module]:
        pipe = self.trainer.pipe
        return {i: pipe.layers[i] for i in sorted(pipe.layers) if pipe.specs[i].kind == "t"}

    def _install(self, i: int, layer: nn.Module, new_head: bool) -> None:
        can_exit = self.trainer.pipe.specs[i].index - 1 >= self.opts.first_block
        if can_exit and new_head and layer.exit_head is None:
            d = self.trainer.cfg.model.d_model
            with torch.random.fork_rng(devices=[]):  # same weights wherever the block lives
                torch.manual_seed(self.trainer.cfg.train.seed * 1_000_003 + 7919 * (i + 1))
                head = nn.Linear(d, 1, device=self.trainer.ctx.device)
                nn.init.normal_(head.weight, 0.0, 0.02)
                nn.init.zeros_(head.bias)
            layer.exit_head = head
        layer.token_router = ExitRouter(self.opts, can_exit)

    def before_step(self, step: int) -> list[dict]:
        for layer in self._blocks().values():
            layer.token_router.exiting = step >= self.opts.start_step
            layer.token_router.reset_stats()
        if step == self.opts.start_step:
            return [{"type": "dynamism", "step": step, "first_block": self.opts.first_block,
                     "threshold": self.opts.threshold}]
        return []

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        out: dict[str, dict[int, Any]] = {}
        for i, layer in self._blocks().items():
            for k, v in layer.token_router.summary().items():
                out.setdefault(f"exit_{k}", {})[i] = v
        return out

    def unpack_layer(self, index: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        if self.trainer.pipe.specs[index].kind == "t":
            self._install(index, layer, new_head=False)  # the classifier came with the weights
