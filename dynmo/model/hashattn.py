"""Hash-sparse attention block ("hashattn"): dynamic sparse causal attention after
Pagliardini et al. 2023 ("Fast attention over long sequences with dynamic sparse flash
attention"), computed tile by tile so the skipped work is really skipped.

Query i may attend to key j iff j <= i and hash(q_i) == hash(k_j). Per head:

1. Hash: random-projection LSH, bucket = argmax(x @ R) over `n_buckets` fixed random
   directions R (a buffer drawn from the layer's seed, so a migrated or rebuilt layer has the
   same one). Queries and keys use the same R; they change as the weights train, so the bucket
   distribution, and with it the work, changes during training.
2. Reorder: sort queries by (bucket, position), and keys the same way.
3. Tile: split both sorted sequences into chunks of `chunk` tokens. A (query chunk, key
   chunk) tile is computed only if the chunks' bucket ranges overlap and the key chunk's
   earliest position is not after the query chunk's latest one (the test a block-sparse flash
   kernel makes from per-tile bucket and index ranges). Inside a computed tile the exact mask
   (same bucket, causal on original positions) applies.
4. A softmax over the computed tiles of each query chunk (running max and sum combined across
   tiles, as flash attention does), then un-sort.

A query with no matching earlier key gets a zero output (the residual carries the token).
With `n_buckets = 1` the sort is the identity, the computed tiles are exactly the causal
lower triangle and the result equals dense causal attention. Attention dropout is not applied.

Cost: the tile matmuls run on the computed tiles only, so the layer's time follows
`blocks_computed`; `skipped_fraction = 1 - blocks_computed / blocks_causal`, where
blocks_causal is what a dense causal flash kernel computes with the same tile size
(n(n+1)/2 tiles per head and sequence, n = T / chunk).

Two families share steps 1-4 (`hash_sparse_attention`): `HashAttnBlock` (gpt) and
`LlamaHashAttnBlock` (llama), whose queries and keys are hashed after rotary, one LSH
projection per query head, the grouped keys and values expanded to the query heads.

Per-layer stats (`block.last_stats`, summed over the forwards since `block.reset_stats()`):
blocks_computed, blocks_causal, skipped_fraction (from those sums), tokens_per_bucket (queries,
over batch and heads), forwards.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from dynmo.config import HashAttnConfig, ModelConfig
from dynmo.model import llama
from dynmo.model.gpt import MLP, CausalSelfAttention, Halves
from dynmo.model.stats import StepStats

HashAttnOptions = HashAttnConfig  # options live in the config ([model.hashattn])


def lsh_buckets(t: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """[B, H, T, hd] -> [B, H, T] bucket ids: argmax over the directions planes [H, hd, n_buckets]."""
    if planes.shape[-1] == 1:
        return torch.zeros(t.shape[:-1], dtype=torch.long, device=t.device)
    return torch.matmul(t, planes.unsqueeze(0)).argmax(-1)


def hash_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, planes: torch.Tensor,
                          chunk: int) -> tuple[torch.Tensor, dict]:
    """Steps 1-4 of the module docstring for any family's heads: q, k, v [B, H, T, hd] (keys and
    values already one per query head) -> the output heads [B, H, T, hd] and the tile stats."""
    B, H, T, hd = q.shape
    c, n_buckets = chunk, planes.shape[-1]
    if T % c:
        raise ValueError(f"hashattn.chunk={c} must divide the sequence length {T}")
    n = T // c
    with torch.no_grad():
        pos = torch.arange(T, device=q.device)
        bq, bk = lsh_buckets(q, planes), lsh_buckets(k, planes)
        oq, ok = (bq * T + pos).argsort(-1), (bk * T + pos).argsort(-1)  # sort by (bucket, position)
        sbq, sbk = bq.gather(-1, oq).view(B, H, n, c), bk.gather(-1, ok).view(B, H, n, c)
        spq, spk = oq.view(B, H, n, c), ok.view(B, H, n, c)  # original positions, sorted
        need = (
            (sbq[..., :1] <= sbk[..., -1].unsqueeze(-2))  # [B, H, n_q, n_k]: bucket ranges overlap
            & (sbk[..., 0].unsqueeze(-2) <= sbq[..., -1:])
            & (spk.amin(-1).unsqueeze(-2) <= spq.amax(-1, keepdim=True))  # some key not after some query
        )
        b, h, i, j = need.nonzero().unbind(1)
        allowed = (sbq[b, h, i].unsqueeze(-1) == sbk[b, h, j].unsqueeze(-2)) & (
            spk[b, h, j].unsqueeze(-2) <= spq[b, h, i].unsqueeze(-1)
        )  # [tiles, c, c]
        group = (b * H + h) * n + i  # the query chunk each tile belongs to

    def tiles(t, order, idx):
        return t.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, hd)).view(B, H, n, c, hd)[b, h, idx]

    # The softmax and the sums over a query chunk's tiles are float32 whatever autocast does (its
    # CUDA policy runs exp and sum in float32, its CPU policy does not); P @ V runs in v's dtype.
    acc = torch.float32
    s = (tiles(q, oq, i) @ tiles(k, ok, j).transpose(-1, -2)).to(acc) / math.sqrt(hd)
    s = s.masked_fill(~allowed, float("-inf"))
    with torch.no_grad():  # per-row max over the row's tiles; a constant shift of the softmax
        m = torch.full((B * H * n, c), float("-inf"), dtype=acc, device=s.device)
        m = m.scatter_reduce(0, group.unsqueeze(-1).expand(-1, c), s.amax(-1), "amax")
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m[group].unsqueeze(-1))
    denom = torch.zeros(B * H * n, c, dtype=acc, device=s.device).index_add(0, group, p.sum(-1).to(acc))
    pv = (p.to(v.dtype) @ tiles(v, ok, j)).to(acc)
    num = torch.zeros(B * H * n, c, hd, dtype=acc, device=s.device).index_add(0, group, pv)
    y_sorted = (num / denom.clamp_min(torch.finfo(acc).tiny).unsqueeze(-1)).to(v.dtype).view(B, H, T, hd)
    y = torch.zeros_like(y_sorted).scatter(2, oq.unsqueeze(-1).expand(-1, -1, -1, hd), y_sorted)
    info = {
        "blocks_computed": int(group.numel()),
        "blocks_causal": B * H * n * (n + 1) // 2,
        "tokens_per_bucket": torch.bincount(bq.flatten(), minlength=n_buckets).tolist(),
    }
    return y, info


def _check(opts: HashAttnOptions) -> None:
    if opts.n_buckets < 1 or opts.chunk < 1:
        raise ValueError(f"hashattn.n_buckets={opts.n_buckets} and hashattn.chunk={opts.chunk} must be >= 1")


class HashSparseAttention(CausalSelfAttention):
    """Same parameters as `CausalSelfAttention` (qkv, proj); a fixed LSH projection buffer."""

    def __init__(self, cfg: ModelConfig, opts: HashAttnOptions):
        super().__init__(cfg)
        _check(opts)
        self.opts = opts
        head_dim = cfg.d_model // cfg.n_heads
        self.register_buffer("planes", torch.randn(cfg.n_heads, head_dim, opts.n_buckets))

    def buckets(self, t: torch.Tensor) -> torch.Tensor:
        """[B, H, T, hd] -> [B, H, T] bucket ids."""
        return lsh_buckets(t, self.planes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        B, T, C = x.shape
        H = self.n_heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        y, info = hash_sparse_attention(q, k, v, self.planes, self.opts.chunk)
        return self.proj(y.transpose(1, 2).reshape(B, T, C)), info


class LlamaHashSparseAttention(llama.Attention):
    """Same parameters as `llama.Attention`; a fixed LSH projection buffer per query head.

    Queries and keys are hashed after rotary, on what the attention scores are computed
    from, so a bucket groups tokens whose rotated vectors point alike. Keys and values are
    expanded to the query heads first: each query head sorts and tiles its group's keys by
    its own directions, as in the GPT version.
    """

    def __init__(self, cfg: ModelConfig, opts: HashAttnOptions):
        super().__init__(cfg)
        _check(opts)
        self.opts = opts
        self.register_buffer("planes", torch.randn(self.n_heads, self.hd, opts.n_buckets))

    def buckets(self, t: torch.Tensor) -> torch.Tensor:
        """[B, H, T, hd] -> [B, H, T] bucket ids."""
        return lsh_buckets(t, self.planes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        q, k, v = self.project(x)
        y, info = hash_sparse_attention(q, k, v, self.planes, self.opts.chunk)
        return self.out(y), info


class HashStats(Halves, nn.Module):
    """The stats every family's hash-attention block keeps, from its attention's `info` (in the
    attention half)."""

    def reset_stats(self) -> None:
        self._stats = StepStats()

    @property
    def last_stats(self) -> dict:
        s = self._stats.sums
        if not self._stats.forwards:
            return {}
        return {
            "blocks_computed": s["blocks_computed"],
            "blocks_causal": s["blocks_causal"],
            "skipped_fraction": 1.0 - s["blocks_computed"] / s["blocks_causal"],
            "tokens_per_bucket": s["tokens_per_bucket"],
            "forwards": self._stats.forwards,
        }


class HashAttnBlock(HashStats):
    """Pre-norm block with hash-sparse causal attention (see module docstring)."""

    prunable = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # its Linears, for weight pruning
    mlp_units = ("mlp.fc", "mlp.proj")  # the MLP's in and out Linears, for structured pruning

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.opts = cfg.hashattn
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = HashSparseAttention(cfg, self.opts)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.reset_stats()

    halves = (("ln1", "attn"), ("ln2", "mlp"))

    def attn_half(self, x: torch.Tensor, mask: torch.Tensor):
        a, info = self.attn(self.ln1(x))
        self._stats.add(**info)
        return x + a, mask

    def mlp_half(self, x: torch.Tensor, mask: torch.Tensor):
        return x + self.mlp(self.ln2(x)), mask


class LlamaHashAttnBlock(HashStats):
    """Llama decoder block with hash-sparse causal attention on the rotated queries and keys."""

    prunable = llama.Block.prunable

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.opts = cfg.hashattn
        self.input_layernorm = llama.RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = LlamaHashSparseAttention(cfg, self.opts)
        self.post_attention_layernorm = llama.RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = llama.SwiGLU(cfg)
        self.reset_stats()

    halves = (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))

    def attn_half(self, x: torch.Tensor, mask: torch.Tensor):
        a, info = self.self_attn(self.input_layernorm(x))
        self._stats.add(**info)
        return x + a, mask

    def mlp_half(self, x: torch.Tensor, mask: torch.Tensor):
        return x + self.mlp(self.post_attention_layernorm(x)), mask
