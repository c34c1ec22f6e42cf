"""A readable GPT, built as a list of layers any rank can construct from a spec.

Read top to bottom: attention -> MLP -> Block -> Embedding -> Head -> loss -> initialisation.
`dynmo.model.layers` turns these into the list of layers a pipeline moves.

Every layer maps `(x, mask) -> (x, mask)` except the embedding (`tokens -> (x, mask)`) and the
head (`(x, mask) -> logits`). `mask` is a bool [batch, seq] tensor of *active* tokens with a
fixed shape; dense models leave it all True. Dynamic models (early exit, Mixture of Depths)
use it to skip work on inactive tokens without changing the tensor shapes that cross stage
boundaries.

Each layer is initialised from its own seed (seed, layer index), so a model built whole in
one process and a model built piecewise on many ranks, or a layer rebuilt on the rank it
migrated to, start from identical weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"model.d_model={cfg.d_model} must be divisible by model.n_heads={cfg.n_heads}")
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def attend_rows(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Attention output [B, A, C] of the rows at positions idx [B, A] of h [B, T, C]:
        queries of those rows only, keys and values of every token, causal on positions."""
        B, T, C = h.shape
        A, H = idx.shape[1], self.n_heads
        w, b = self.qkv.weight, self.qkv.bias
        kv = F.linear(h, w[C:], None if b is None else b[C:])
        q = F.linear(h.gather(1, idx.unsqueeze(-1).expand(-1, -1, C)), w[:C], None if b is None else b[:C])
        k, v = kv.split(C, dim=2)
        q = q.view(B, A, H, C // H).transpose(1, 2)
        k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_rows(idx, T), dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, A, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Structured pruning (dynmo/dynamics/prune.py) removes hidden units, so a migrated or
        # restored MLP may be narrower than the config says: take the width of the weights.
        w = state_dict.get(prefix + "fc.weight")
        if w is not None and w.shape[0] != self.fc.out_features:
            dev, dt = self.fc.weight.device, self.fc.weight.dtype
            self.fc = nn.Linear(self.fc.in_features, w.shape[0], bias=self.fc.bias is not None, device=dev, dtype=dt)
            self.proj = nn.Linear(w.shape[0], self.proj.out_features, bias=self.proj.bias is not None, device=dev, dtype=dt)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Halves:
    """A block that can be placed as two units (`parallel.unit = "sublayer"`): its attention
    half `attn_half(x, mask)` and its MLP half `mlp_half(x, mask, *carry)`; the whole block is
    the one after the other, the same operations in the same order. `halves` names the modules
    of each (`dynmo.model.layers.keep_half`); `part` is the half a split block runs, None for a
    whole one.

    The attention half returns `(x, mask, *carry)`: `carry` names what else the MLP half needs
    of it beside the residual stream (a Mixture-of-Depths block's routing decision), and it
    crosses a stage boundary with the residual stream when one falls between the halves. A
    half may be handed more than its own carry (the input an early-exit gate keeps for its
    decision); it takes its own, first."""

    halves: tuple[tuple[str, ...], tuple[str, ...]]
    carry: tuple[str, ...] = ()
    part: str | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor, *carry: torch.Tensor):
        if self.part == "attn":
            return self.attn_half(x, mask)
        if self.part == "mlp":
            return self.mlp_half(x, mask, *carry[:len(self.carry)])
        return self.dense_forward(x, mask)

    def dense_forward(self, x: torch.Tensor, mask: torch.Tensor):
        """The whole block: its attention half, then its MLP half."""
        return self.mlp_half(*self.attn_half(x, mask))


class SkipsInactive(Halves, nn.Module):
    """A pre-norm block that, with `skip_inactive` set, computes only the active tokens of a
    microbatch that has inactive ones, else every token: its halves are
    x + attention(x) and x + mlp(x) from the family's `attn_branch(x)`, `attn_rows(x, idx)`
    (the attention branch of the rows at positions idx only) and `mlp_branch(x)`.

    On the active tokens (`on_active_rows`), per sequence the active positions are gathered
    (padded to the most active sequence; padding rows are inactive tokens whose result is
    discarded) and the query projection, attention, output projection and MLP run on those
    rows only. Inactive tokens still serve as keys and values with their current hidden state,
    so an active token's output is exactly the dense block's, and inactive tokens pass bit for
    bit. Off (the default), the block never looks at the mask, which costs a dense model
    nothing."""

    # 0: gather exactly the rows needed; K: round them up to a multiple of seq_len / K, so a
    # compiled block sees at most K + 1 widths (`before_compile` sets it)
    width_buckets = 0
    WIDTH_BUCKETS = 16
    active_width: int | None = None  # this forward's rows per sequence; None: every token
    _width_hook = None

    @property
    def skip_inactive(self) -> bool:
        return self._width_hook is not None

    @skip_inactive.setter
    def skip_inactive(self, on: bool) -> None:
        if on and self._width_hook is None:
            self._width_hook = self.register_forward_pre_hook(SkipsInactive._read_width)
        elif not on and self._width_hook is not None:
            self._width_hook.remove()
            self._width_hook, self.active_width = None, None

    def before_compile(self, dtype: torch.dtype) -> None:
        """`dynmo.runtime.compiled` calls it before compiling the block: widths rounded up, so
        the graph sees at most WIDTH_BUCKETS + 1 of them."""
        self.width_buckets = self.WIDTH_BUCKETS

    def _read_width(self, args: tuple) -> None:
        """Before each forward (a pre-hook, so outside a compiled forward): how many rows per
        sequence it gathers, `active_width`: None with no inactive token, else the most active
        sequence's count (rounded up per `width_buckets`). The one host read of a skipping
        block's forward (the shape is the data's), one scalar; a compiled forward sees a Python
        int, one graph per distinct width."""
        mask = args[1]
        T = mask.shape[1]
        w = int(torch.where(mask.all(), T + 1, mask.sum(1).max()))
        step = -(-T // self.width_buckets) if self.width_buckets else 1
        self.active_width = None if w > T else min(T, -(-w // step) * step)

    def attn_half(self, x: torch.Tensor, mask: torch.Tensor):
        if self.active_width is not None:
            return on_active_rows(x, mask, lambda sel, idx: sel + self.attn_rows(x, idx), self.active_width), mask
        return x + self.attn_branch(x), mask

    def mlp_half(self, x: torch.Tensor, mask: torch.Tensor):
        if self.active_width is not None:
            return on_active_rows(x, mask, lambda sel, idx: sel + self.mlp_branch(sel), self.active_width), mask
        return x + self.mlp_branch(x), mask


class Block(SkipsInactive):
    """Pre-norm transformer block (t). With `skip_inactive` set (models whose tokens can leave
    the computation, e.g. early exit) it computes the active tokens only (`SkipsInactive`)."""

    prunable = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # its Linears, for weight pruning
    mlp_units = ("mlp.fc", "mlp.proj")  # the MLP's in and out Linears, for structured pruning
    halves = (("ln1", "attn"), ("ln2", "mlp"))

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def attn_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.ln1(x))

    def attn_rows(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.attn.attend_rows(self.ln1(x), idx)

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln2(x))


def active_rows(mask: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the active positions in position order, padded with inactive positions up
    to the most active sequence's count, or to `width` where the caller knows a bound on it
    (then no host synchronisation reads the count): (idx, valid), both [B, A]."""
    T = mask.shape[1]
    A = int(mask.sum(1).max()) if width is None else width
    pos = torch.arange(T, device=mask.device)
    # inactive positions sort after the active ones and stay distinct, so a scatter to idx
    # writes every position at most once
    idx = (pos + T * (~mask)).argsort(dim=1)[:, :A]
    return idx, mask.gather(1, idx)


def causal_rows(idx: torch.Tensor, T: int) -> torch.Tensor:
    """[B, 1, A, T] attention mask: the row at original position idx sees positions <= idx."""
    pos = torch.arange(T, device=idx.device)
    return (pos.view(1, 1, T) <= idx.unsqueeze(-1)).unsqueeze(1)


def on_active_rows(x: torch.Tensor, mask: torch.Tensor, update, width: int | None = None) -> torch.Tensor:
    """x with `update(sel, idx)` applied to its active rows only, for any family's block.

    `idx` [B, A] are the active positions per sequence (`active_rows`, A = `width` where the
    caller read it), `sel` [B, A, D] their hidden states; padding rows keep their input and
    inactive tokens are copied, so they pass bit for bit (with no active token, a copy: never
    an alias of the input)."""
    D = x.shape[-1]
    idx, valid = active_rows(mask, width)
    if idx.shape[1] == 0:
        return x.clone()
    g = idx.unsqueeze(-1).expand(-1, -1, D)
    sel = x.gather(1, g)
    return x.scatter(1, g, torch.where(valid.unsqueeze(-1), update(sel, idx), sel))


class Embedding(nn.Module):
    """Token + learned position embedding (E). Starts every token active."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor):
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        mask = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        return x, mask


class Head(nn.Module):
    """Final norm + LM head (L). The loss (`loss_fn`) is applied to its logits by the schedule.

    With `model.tie_embeddings`, `lm_head.weight` is a copy of the embedding's `tok.weight` kept
    equal by the runtime (`dynmo.runtime.tie`): E and L usually live on different stages.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one microbatch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def init_weights(layer: nn.Module, cfg: ModelConfig) -> None:
    """GPT-2 init: N(0, 0.02), residual projections scaled down by depth."""
    for name, p in layer.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
