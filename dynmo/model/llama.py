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
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def _inv_freq(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    hd = head_dim(cfg)
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))


def rotary(cfg: ModelConfig, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for positions 0..T-1."""
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), _inv_freq(cfg, device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_at(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T', head_dim] for the positions [B, T'] of rows taken out of their
    sequences, broadcasting over heads."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * _inv_freq(cfg, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (`n_kv_heads` key/value heads)."""

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

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """Key/value heads -> query heads: each serves n_heads / n_kv query heads."""
        if self.n_kv == self.n_heads:
            return t
        return t.repeat_interleave(self.n_heads // self.n_kv, dim=1)

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None):
        """Rotated queries and keys and the values, [B, n_heads, T, head_dim] each (keys and
        values expanded to the query heads); rotary at `positions` if given, else 0..T-1."""
        q = self._heads(self.q_proj, x, self.n_heads)
        k = self._heads(self.k_proj, x, self.n_kv)
        v = self._heads(self.v_proj, x, self.n_kv)
        if positions is None:
            cos, sin = rotary(self.cfg, x.shape[1], x.device, q.dtype)
        else:
            cos, sin = rotary_at(self.cfg, positions, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, self.expand(k), self.expand(v)

    def out(self, y: torch.Tensor) -> torch.Tensor:
        """[B, n_heads, T, head_dim] -> o_proj of the heads concatenated, [B, T, d_model]."""
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over the rows of x. `positions` [B, T'] are the rows' original
        positions when x holds only some tokens of each sequence, in position order (Mixture
        of Depths): rotary then encodes where a token really is, while the causal mask
        stays on row order, so rows placed after the chosen ones (padding) are never seen."""
        q, k, v = self.project(x, positions)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def attend_rows(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Attention output [B, A, d_model] of the rows at positions idx [B, A] of h [B, T, d]:
        queries of those rows only, keys and values of every token, causal on positions."""
        T = h.shape[1]
        q = self._heads(self.q_proj, h.gather(1, idx.unsqueeze(-1).expand(-1, -1, h.shape[-1])), self.n_heads)
        k = self._heads(self.k_proj, h, self.n_kv)
        v = self._heads(self.v_proj, h, self.n_kv)
        cos, sin = rotary(self.cfg, T, h.device, q.dtype)
        # the rows' entries of the keys' table, so a query rotates exactly as in the dense path
        q = apply_rotary(q, cos[idx].unsqueeze(1), sin[idx].unsqueeze(1))
        k = apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, self.expand(k), self.expand(v), attn_mask=causal_rows(idx, T))
        return self.out(y)


def intermediate_size(cfg: ModelConfig) -> int:
    return cfg.intermediate_size or cfg.mlp_ratio * cfg.d_model


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = intermediate_size(cfg)
        self.gate_proj = nn.Linear(cfg.d_model, inter, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        return self.lm_head(self.norm(x))


def init_weights(layer: nn.Module, cfg: ModelConfig) -> None:
    """transformers' Llama init: matrices and embeddings N(0, 0.02), biases 0, norms 1."""
    for name, p in layer.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            nn.init.ones_(p)
        elif p.dim() >= 2:
            nn.init.normal_(p, mean=0.0, std=0.02)
        else:
            nn.init.zeros_(p)
