"""Llama-family decoder layers (Llama, Mistral, Qwen2), computing what transformers computes.

Read top to bottom: RMSNorm -> rotary embedding -> attention (grouped-query) -> SwiGLU MLP ->
Block -> Embedding -> Head -> initialisation.

Parameter names inside each layer are Hugging Face's (`self_attn.q_proj.weight`,
`mlp.gate_proj.weight`, `input_layernorm.weight`, ...), so a checkpoint maps onto the layers by
a prefix (`dynmo.model.hf`). Like the GPT, every layer maps `(x, mask) -> (x, mask)` except the
embedding (`tokens -> (x, mask)`) and the head (`(x, mask) -> logits`); the mask of active
tokens travels with the hidden state and the dense blocks do not look at it unless early exit
sets `skip_inactive`. The dynamic variants of the family (Mixture of Depths, hash-sparse
attention) live with their GPT versions in `dynmo.model.mod` and `dynmo.model.hashattn`.

Numerics follow transformers: RMSNorm in float32 then back to the input dtype, rotary
frequencies computed in float32 from `rope_theta`, the rotate-half convention, softmax
attention through `scaled_dot_product_attention` with a causal mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import ModelConfig
from dynmo.model.gpt import SkipsInactive, causal_rows


class RMSNorm(nn.Module):
    """transformers' RMSNorm through torch's own `F.rms_norm` (one fused kernel each way on a GPU):
    in float32 for a float32 input, bitwise what transformers computes; any other input is
    normalised in float32, cast back and then scaled, as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps).to(x.dtype)


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def _inv_freq(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    hd = head_dim(cfg)
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))


_TABLES: dict[tuple, torch.Tensor] = {}  # (rope_theta, head_dim, length, device, dtype) -> rotary table


def rotary_table(cfg: ModelConfig, T: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[2, T, head_dim]: cos, and sin with the sign of `rotate_half` folded in and rolled back by
    half a head (`apply_rope`), for positions 0..T-1 (at least `seq_len` of them). Computed once
    per process (a stage), device and dtype, not per layer: entry t is the same for every
    length, so a longer table serves shorter sequences. Inside a compiled graph it is computed
    there (the graph's constant)."""
    T = max(T, cfg.seq_len)
    if torch.compiler.is_compiling():
        return _make_table(cfg, T, device, dtype)
    key = (cfg.rope_theta, head_dim(cfg), T, torch.device(device), dtype)
    if key not in _TABLES:
        with torch.no_grad(), torch.inference_mode(False):
            _TABLES[key] = _make_table(cfg, T, device, dtype)
    return _TABLES[key]


def _make_table(cfg: ModelConfig, T: int, device, dtype: torch.dtype) -> torch.Tensor:
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), _inv_freq(cfg, device))
    cos, sin = freqs.cos(), freqs.sin()
    # rotate_half's sin, (-sin, sin), rolled back by half a head: see `apply_rope`
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((sin, -sin), -1))).to(dtype)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` from the stage's table: x [..., head_dim] rotated, `table` [2, ..., head_dim]
    (`rotary_table`, its rows broadcasting against x's leading dims). transformers' rotate_half(x)
    * sin = roll(x * table[1], half), product for product, so both products are one
    multiplication: three operators forward and four backward instead of ten, the same values."""
    table = table.view(2, *[1] * (x.dim() + 1 - table.dim()), *table.shape[1:])  # aligned on x's last dims
    cos_part, sin_part = (x.unsqueeze(0) * table).unbind(0)
    return cos_part + sin_part.roll(x.shape[-1] // 2, -1)


def rotary(cfg: ModelConfig, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for positions 0..T-1, as transformers builds them (a reference:
    the blocks use `rotary_table` and `apply_rope`)."""
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), _inv_freq(cfg, device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding of x [B, heads, T, head_dim] (the reference `apply_rope` equals)."""
    return x * cos + _rotate_half(x) * sin


def _plain(*mods: nn.Module) -> bool:
    """Whether the modules are plain Linears (not pruned ones), whose weights may be concatenated."""
    return all(type(m) is nn.Linear for m in mods)


def fused_linear(x: torch.Tensor, *mods: nn.Linear) -> torch.Tensor:
    """The outputs of several Linears of the same input, concatenated on the last dim, as one
    matrix product (their weights concatenated; the parameters stay separate, as checkpoints and
    the Hugging Face layout keep them); pruned Linears run one by one. On the rows as a matrix
    (`rows`): a product over a 3-d input would add a reshape each way."""
    if len(mods) == 1:
        return rows(x, mods[0])
    if not _plain(*mods):
        return torch.cat([rows(x, m) for m in mods], -1)
    bias = None if mods[0].bias is None else torch.cat([m.bias for m in mods])
    return F.linear(x.reshape(-1, x.shape[-1]), torch.cat([m.weight for m in mods]), bias).view(*x.shape[:-1], -1)


def rows(x: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    """lin(x) computed on x's rows as one [tokens, features] matrix, in x's leading shape."""
    return lin(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (`n_kv_heads` key/value heads): the query,
    key and value projections as one matrix product, rotary applied to queries and keys at once
    from the stage's table, SDPA's grouped-query path (no repeated keys)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd, H, KV = head_dim(cfg), cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        if H % KV:
            raise ValueError(f"model.n_heads={H} must be a multiple of model.n_kv_heads={KV}")
        self.n_heads, self.n_kv, self.hd = H, KV, hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.d_model, H * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, KV * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, KV * hd, bias=bias)
        self.o_proj = nn.Linear(H * hd, cfg.d_model, bias=False)

    def _heads(self, proj: nn.Linear, x: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x.shape
        return proj(x).view(B, T, n, self.hd).transpose(1, 2)

    def _rope(self, positions: torch.Tensor | None, T: int, like: torch.Tensor) -> torch.Tensor:
        """The rotary table broadcasting over [B, T, heads, head_dim] (`apply_rope`): rows
        0..T-1, or the rows `positions` [B, T] of the table."""
        table = rotary_table(self.cfg, T, like.device, like.dtype)
        if positions is None:
            return table[:, :T, None]  # [2, T, 1, head_dim]
        return table[:, positions].unsqueeze(3)  # [2, B, T, 1, head_dim]

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None):
        """Rotated queries [B, n_heads, T, head_dim], keys and values [B, n_kv, T, head_dim];
        rotary at `positions` if given, else 0..T-1."""
        B, T, _ = x.shape
        H, KV = self.n_heads, self.n_kv
        qkv = fused_linear(x, self.q_proj, self.k_proj, self.v_proj).view(B, T, H + 2 * KV, self.hd)
        qk, v = qkv.split((H + KV, KV), 2)  # split, not slices: one gradient concatenation back
        q, k = apply_rope(qk, self._rope(positions, T, qkv)).split((H, KV), 2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """Key/value heads -> query heads: each serves n_heads / n_kv query heads."""
        if self.n_kv == self.n_heads:
            return t
        return t.repeat_interleave(self.n_heads // self.n_kv, dim=1)

    def attention(self, q, k, v, **kw) -> torch.Tensor:
        """SDPA with the key/value heads shared by query heads (`enable_gqa`)."""
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=self.n_kv != self.n_heads, **kw)

    def out(self, y: torch.Tensor) -> torch.Tensor:
        """[B, n_heads, T, head_dim] -> o_proj of the heads concatenated, [B, T, d_model]."""
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B * T, self.n_heads * self.hd)).view(B, T, -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over the rows of x. `positions` [B, T'] are the rows' original
        positions when x holds only some tokens of each sequence, in position order (Mixture
        of Depths): rotary then encodes where a token really is, while the causal mask
        stays on row order, so rows placed after the chosen ones (padding) are never seen."""
        return self.out(self.attention(*self.project(x, positions), is_causal=True))

    def attend_rows(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Attention output [B, A, d_model] of the rows at positions idx [B, A] of h [B, T, d]:
        queries of those rows only, keys and values of every token, causal on positions."""
        B, T, _ = h.shape
        A, H, KV = idx.shape[1], self.n_heads, self.n_kv
        picked = h.gather(1, idx.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        q = fused_linear(picked, self.q_proj).view(B, A, H, self.hd)
        kv = fused_linear(h, self.k_proj, self.v_proj).view(B, T, 2 * KV, self.hd)
        # the rows' entries of the keys' table, so a query rotates exactly as in the dense path
        q = apply_rope(q, self._rope(idx, T, q))
        k, v = kv.split((KV, KV), 2)
        k = apply_rope(k, self._rope(None, T, kv))
        y = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=causal_rows(idx, T))
        return self.out(y)


def intermediate_size(cfg: ModelConfig) -> int:
    return cfg.intermediate_size or cfg.mlp_ratio * cfg.d_model


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x), the gate and up projections as one matrix product."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = intermediate_size(cfg)
        self.gate_proj = nn.Linear(cfg.d_model, inter, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_linear(x, self.gate_proj, self.up_proj).chunk(2, -1)
        return rows(F.silu(gate) * up, self.down_proj)


class Block(SkipsInactive):
    """Pre-norm decoder block (t): x + attn(norm(x)), then + mlp(norm(...)).

    `skip_inactive` works as in `dynmo.model.gpt.Block` (early exit): the block then computes
    the active tokens only, exited ones serving as keys and values at their own positions.
    """

    prunable = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # its Linears, for weight pruning
    halves = (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def attn_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x))

    def attn_rows(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.self_attn.attend_rows(self.input_layernorm(x), idx)

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """Token embedding (E); positions enter through the rotary embedding in every block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, tokens: torch.Tensor):
        mask = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        return self.embed_tokens(tokens), mask


class Head(nn.Module):
    """Final RMSNorm + LM head (L)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return rows(self.norm(x), self.lm_head)


def init_weights(layer: nn.Module, cfg: ModelConfig) -> None:
    """transformers' Llama init: matrices and embeddings N(0, 0.02), biases 0, norms 1."""
    for name, p in layer.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            nn.init.ones_(p)
        elif p.dim() >= 2:
            nn.init.normal_(p, mean=0.0, std=0.02)
        else:
            nn.init.zeros_(p)
