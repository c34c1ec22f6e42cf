"""Llama-family decoder layers (Llama, Mistral, Qwen2), computing what transformers computes.

Read top to bottom: RMSNorm -> rotary embedding -> attention (grouped-query) -> SwiGLU MLP ->
Block -> Embedding -> Head -> initialisation.

Parameter names inside each layer are Hugging Face's (`self_attn.q_proj.weight`,
`mlp.gate_proj.weight`, `input_layernorm.weight`, ...), so a checkpoint maps onto the layers by
a prefix (`dynmo.model.hf`). Like the GPT, every layer maps `(x, mask) -> (x, mask)` except the
embedding (`tokens -> (x, mask)`) and the head (`(x, mask) -> logits`); the mask of active
tokens travels with the hidden state and the dense blocks do not look at it.

Numerics follow transformers: RMSNorm in float32 then back to the input dtype, rotary
frequencies computed in float32 from `rope_theta`, the rotate-half convention, softmax
attention through `scaled_dot_product_attention` with a causal mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import ModelConfig


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


def rotary(cfg: ModelConfig, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for positions 0..T-1."""
    hd = head_dim(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        cos, sin = rotary(self.cfg, T, x.device, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv != self.n_heads:  # each key/value head serves n_heads / n_kv query heads
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


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


class Block(nn.Module):
    """Pre-norm decoder block (t): x + attn(norm(x)), then + mlp(norm(...))."""

    prunable = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # its Linears, for weight pruning

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x)), mask


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
