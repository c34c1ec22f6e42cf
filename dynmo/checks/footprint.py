"""What a rank of a configured run holds at its peak, counted before anything is built. Pure.

The balancer's memory model (`dynmo.loop.DynmoLoop.observe`) with figures from the config
instead of measured ones: each placement unit holds its state (`dynmo.loop.bytes_per_param`:
fp32 weights, gradients and AdamW's two moments, split as `parallel.shard` splits them) plus
the activations it saves for backward per microbatch times the microbatches its stage holds
in flight (`dynmo.schedules.in_flight`, the schedule's). A rank holds the units of its stages.

Parameters per unit are counted from the shapes the model classes allocate (the projections,
MLPs or experts, norms, embeddings and head). Activations per token are the tensors autograd
saves in a block (elements of `d_model`, the q/k/v projections and the MLP width):

- attention half: the norm's output, q, k and v, attention's output and its contiguous copy
  (gpt), plus the rotary copies of q and k and the norm's input (llama, mixtral);
- MLP half: the residual, the norm's output, and two (GELU: fc out, its activation) or four
  (SwiGLU: gate, up, silu, product) tensors of the MLP width, for each of `top_k` experts
  with the routed copies of the tokens under MoE; Mixture of Depths: its capacity's share;
- the head: the norm's input and output, and the logits and their log-probabilities the loss
  keeps (vocab_size each).

A block whose activations are recomputed (`train.activation_checkpointing`) keeps its input
only, and the rank recomputes one such block at a time. In bf16 (`train.dtype`) activations
take 2 bytes an element and autocast keeps a bf16 copy of each weight for the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynmo.config import Config, ModelConfig
from dynmo.loop import bytes_per_param
from dynmo.plan import initial_layout, recompute_blocks, resolve_pp
from dynmo.schedules import get_schedule, in_flight, stage_to_rank

GiB = 2**30


@dataclass
class RankMemory:
    """The estimate for the fullest rank: bytes of state and of activations, and its pipeline rank."""

    rank: int
    state: float
    activations: float
    params: int  # parameters the rank holds (before sharding)
    ranks: int  # pipeline ranks x data-parallel replicas the estimate assumed

    @property
    def total(self) -> float:
        return self.state + self.activations


def _heads(m: ModelConfig) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, head width, MLP width)."""
    heads = m.n_heads
    if m.family == "gpt":
        return heads, heads, m.d_model // heads, m.mlp_ratio * m.d_model
    return heads, m.n_kv_heads or heads, m.head_dim or m.d_model // heads, m.intermediate_size or m.mlp_ratio * m.d_model


def _local_experts(cfg: Config) -> int:
    m, p = cfg.model, cfg.parallel
    return m.moe.num_experts // max(1, p.ep) + p.expert_slots


def unit_params(cfg: Config) -> list[tuple[int, int]]:
    """(parameters, of which in this rank's experts) of each placement unit in model order."""
    m = cfg.model
    d, gpt = m.d_model, m.family == "gpt"
    h, kv, hd, inter = _heads(m)
    qkv = (h + 2 * kv) * hd
    norm = 2 * d if gpt else d
    attn = d * qkv + h * hd * d + norm + (qkv + d if gpt else (qkv if m.attention_bias else 0))
    expert = 2 * d * inter + inter + d if gpt else 3 * d * inter
    if m.has_experts:
        experts = _local_experts(cfg) * expert
        mlp, mlp_experts = norm + d * m.moe.num_experts + experts, experts
    else:
        mlp, mlp_experts = norm + expert, 0
    if m.block == "mod":
        attn += 2 * d + 1  # the router (no bias) and the predictor
    halves = [(attn, 0), (mlp, mlp_experts)]
    blocks = [part for _ in range(m.n_layers)
              for part in (halves if cfg.parallel.unit == "sublayer" else [(attn + mlp, mlp_experts)])]
    embed = m.vocab_size * d + (m.seq_len * d if gpt else 0)
    head = m.vocab_size * d + norm
    return [(embed, 0), *blocks, (head, 0)]


def _block_acts(m: ModelConfig, block: int) -> tuple[float, float]:
    """Elements saved for backward per token of the sequence by block `block`'s (attention, MLP) halves."""
    d, gpt = m.d_model, m.family == "gpt"
    h, kv, hd, inter = _heads(m)
    qkv = (h + 2 * kv) * hd
    attn = d + qkv + 2 * h * hd if gpt else 2 * d + 2 * qkv + 2 * h * hd
    per_expert = 2 * inter if gpt else 4 * inter
    if m.has_experts:
        k = m.moe.top_k
        mlp = 2 * d + k * (per_expert + 2 * d) + m.moe.num_experts
    else:
        mlp = (d if gpt else 2 * d) + per_expert
    if m.block == "mod":
        caps = m.mod.capacities or [m.mod.capacity] * m.n_layers
        share = min(1.0, max(1 / m.seq_len, caps[block]))
        return share * attn + 2 * d, share * mlp
    return float(attn), float(mlp)


def unit_activations(cfg: Config) -> list[float]:
    """Bytes each placement unit saves for backward per microbatch (`recomputed` blocks: their input)."""
    m, t = cfg.model, cfg.train
    tokens = t.global_batch // max(1, cfg.parallel.dp) // max(1, t.microbatches) * m.seq_len
    elem = 2 if t.dtype == "bf16" else 4
    again = set(recompute_blocks(cfg))
    out = [0.0]
    for b in range(m.n_layers):
        a, f = _block_acts(m, b)
        if b in again:
            a, f = m.d_model, (m.d_model if cfg.parallel.unit == "sublayer" else 0)
        out.extend((a, f) if cfg.parallel.unit == "sublayer" else (a + f,))
    out.append(2 * m.d_model + 2 * m.vocab_size)
    return [x * tokens * elem for x in out]


def _recompute_peak(cfg: Config, blocks: list[int]) -> float:
    """Bytes of the largest recomputed block's activations, rebuilt during its backward."""
    m, t = cfg.model, cfg.train
    again = [b for b in blocks if b in set(recompute_blocks(cfg))]
    if not again:
        return 0.0
    tokens = t.global_batch // max(1, cfg.parallel.dp) // max(1, t.microbatches) * m.seq_len
    return max(sum(_block_acts(m, b)) for b in again) * tokens * (2 if t.dtype == "bf16" else 4)


def rank_memory(cfg: Config, world: int) -> RankMemory:
    """The peak bytes of the fullest rank of a run on `world` ranks, under `parallel.layout`."""
    stages = resolve_pp(cfg, world) * cfg.parallel.virtual_stages
    layout = initial_layout(cfg, stages, [n for n, _ in unit_params(cfg)])
    return layout_memory(cfg, world, list(layout.boundaries))


def layout_memory(cfg: Config, world: int, boundaries: list[int]) -> RankMemory:
    """`rank_memory` for the stage boundaries `boundaries` (a forced or decided layout)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    pp = resolve_pp(cfg, world)
    stages = len(boundaries) - 1
    params, acts = unit_params(cfg), unit_activations(cfg)
    per_param = bytes_per_param(p.shard, p.dp) + (2 if t.dtype == "bf16" else 0)
    owner = stage_to_rank(stages, pp, get_schedule(p.schedule).placement)
    sub = p.unit == "sublayer"
    best: RankMemory | None = None
    for r in range(pp):
        mine = [s for s in range(stages) if owner[s] == r]
        units = [i for s in mine for i in range(boundaries[s], boundaries[s + 1])]
        n = sum(params[i][0] for i in units)
        state = per_param * n
        blocks = sorted({(i - 1) // 2 if sub else i - 1 for i in units if 0 < i < len(params) - 1})
        act = sum(in_flight(p.schedule, t.microbatches, stages, s) * sum(acts[boundaries[s]:boundaries[s + 1]])
                  for s in mine) + _recompute_peak(cfg, blocks)
        cand = RankMemory(r, state, act, n, pp * p.dp)
        if best is None or cand.total > best.total:
            best = cand
    assert best is not None
    return best


def gb(x: float) -> str:
    """Bytes as GB with two significant decimals (never rounded down to 0)."""
    v = x / GiB
    if v >= 1024:
        return f"{v / 1024:.1f} TB"
    return f"{v:.2f} GB" if v >= 0.01 or v == 0 else f"{math.ceil(x / 2**20)} MB"
