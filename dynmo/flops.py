"""What each layer of a configured model computes, counted before step 0. Pure (stdlib only).

Multiply-adds per token of the matmuls of each placement unit (the embedding, each block or
each block's attention and MLP halves, the head), from the model config alone:

- attention: the q, k, v and output projections (grouped-query for llama / mixtral), the
  scores and their weighted sum, causal: a token attends to (T + 1) / 2 tokens on average;
- MLP: GELU (gpt, 2 matrices of `mlp_ratio * d_model`) or SwiGLU (llama, mixtral, 3 of
  `intermediate_size`); a MoE MLP computes `top_k` experts and the router;
- Mixture of Depths: a block computes its capacity's share of each sequence's tokens, which
  attend among themselves, plus the router and the predictor on every token;
- the head: the projection onto the vocabulary. The embedding's lookup does no multiply-add.

What the dynamic cases change while training (pruned weights, frozen blocks' weight gradients,
exited tokens, hash attention's skipped tiles, MoE's dropped or padded rows) is left out:
this is the model's nominal work, the best guess of each layer's cost before any is measured.
`parallel.layout = "flops"` lays the pipeline out by it (`dynmo.plan.initial_layout`), and
benchmarks/gpu_check.py counts a model's FLOPs (MFU) with it. Backward costs about twice the
forward for every matmul, so the forward count is proportional to a step's.
"""

from __future__ import annotations

import math

from dynmo.config import ModelConfig


def _shapes(m: ModelConfig) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, head width, MLP multiply-adds per token of one MLP)."""
    d = m.d_model
    if m.family == "gpt":
        return m.n_heads, m.n_heads, d // m.n_heads, 2 * d * m.mlp_ratio * d  # fc, proj
    heads, kv = m.n_heads, m.n_kv_heads or m.n_heads
    return heads, kv, m.head_dim or d // heads, 3 * d * (m.intermediate_size or m.mlp_ratio * d)  # gate, up, down


def attention_macs(m: ModelConfig, tokens: int | None = None) -> float:
    """Multiply-adds per computed token of one block's attention, `tokens` in its sequence
    (default seq_len): projections, then scores and weighted sum over (tokens + 1) / 2 keys."""
    heads, kv, hd, _ = _shapes(m)
    t = m.seq_len if tokens is None else tokens
    proj = m.d_model * (heads + 2 * kv) * hd + heads * hd * m.d_model  # q, k, v, out
    return proj + 2 * heads * hd * (t + 1) / 2


def mlp_macs(m: ModelConfig) -> float:
    """Multiply-adds per token of one block's MLP (top_k experts and the router for MoE)."""
    mlp = _shapes(m)[3]
    if m.has_experts:
        return m.moe.top_k * mlp + m.d_model * m.moe.num_experts
    return mlp


def block_capacity(m: ModelConfig, block: int) -> float:
    """The share of each sequence's tokens block `block` computes (Mixture of Depths; else 1)."""
    if m.block != "mod":
        return 1.0
    caps = m.mod.capacities or [m.mod.capacity] * m.n_layers
    return min(m.seq_len, max(1, math.ceil(caps[block] * m.seq_len))) / m.seq_len


def block_halves_macs(m: ModelConfig, block: int) -> tuple[float, float]:
    """(attention half, MLP half) multiply-adds per token of the sequence for block `block`. A
    Mixture-of-Depths block's router and predictor (d_model each, on every token, and the
    router again on the chosen tokens; at capacity 1.0 the router alone) count in its
    attention half, where it decides."""
    if m.block != "mod":
        return attention_macs(m), mlp_macs(m)
    c = block_capacity(m, block)
    k = round(c * m.seq_len)  # tokens per sequence it computes
    routing = 1.0 if c >= 1.0 else 2 + c
    return c * attention_macs(m, k) + routing * m.d_model, c * mlp_macs(m)


def expert_share(m: ModelConfig, sublayer: bool = False) -> float:
    """The share of a MoE unit's multiply-adds in its experts (top_k expert MLPs per token): of
    the whole block, or of its MLP half with `sublayer` (the router is the rest). 0 without experts."""
    if not m.has_experts:
        return 0.0
    experts = m.moe.top_k * _shapes(m)[3]
    return experts / (mlp_macs(m) if sublayer else attention_macs(m) + mlp_macs(m))


def head_macs(m: ModelConfig) -> float:
    return float(m.d_model * m.vocab_size)


def unit_macs(m: ModelConfig, sublayer: bool = False) -> list[float]:
    """Multiply-adds per token of each placement unit in model order: the embedding (0), each
    block (or its attention half then its MLP half, `sublayer`), the head."""
    out = [0.0]
    for b in range(m.n_layers):
        a, f = block_halves_macs(m, b)
        out.extend((a, f) if sublayer else (a + f,))
    return [*out, head_macs(m)]


def forward_flops_per_token(m: ModelConfig) -> float:
    """Forward FLOPs per token (2 per multiply-add) of the whole model as configured."""
    return 2.0 * sum(unit_macs(m))
