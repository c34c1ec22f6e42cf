"""Hash-sparse attention block ("hashattn"): dynamic sparse causal attention after
Pagliardini et al. 2023 ("Fast attention over long sequences with dynamic sparse flash
attention"), computed so that the skipped work is really skipped.

Query i may attend to key j iff j <= i and hash(q_i) == hash(k_j). Per head:

1. Hash: random-projection LSH, bucket = argmax(x @ R) over `n_buckets` fixed random
   directions R (a buffer drawn from the layer's seed, so a migrated or rebuilt layer has the
   same one). Queries and keys use the same R; they change as the weights train, so the bucket
   distribution, and with it the work, changes during training.
2. Reorder: sort queries by (bucket, position), and keys the same way (a stable sort by bucket).
   Within a bucket both are then in position order, so the keys a query may attend are a
   prefix of its bucket's keys: the allowed pairs of a bucket form a monotone staircase.
3. Attend the allowed pairs with one of the kernels (`model.hashattn.kernel`), all exact:
   - `staircase` (auto on CPU from STAIR_MIN_T tokens, tiles below): each bucket's sorted
     queries are cut into chunks of `STAIR_ROWS`. A chunk attends the prefix of its bucket's
     keys up to its last query: the keys every query of the chunk may attend with no mask, the
     band after them with one, each by CPU's fused flash-attention kernel (the one behind
     SDPA), the two merged by their logsumexps. The work is the staircase's area plus half a
     band per chunk; only O(T) tensors are kept for the backward. The chunks are planned on
     the host (one synchronisation per call, free on a CPU); whole rows (a head of a sequence)
     are dealt to torch's intra-op threads, each running its chunks on one thread.
   - `flex` (auto on CUDA): FlexAttention under torch.compile on the sorted sequences, a
     `BlockMask` of the tiles the tile test below needs and an exact `mask_mod` (same bucket,
     key position <= query position); built on the device, no host synchronisation, shapes
     static so a new mask every step does not recompile. It has no backward on CPU.
   - `tiles` (the reference, any device): tiles of `chunk` x `chunk` of the sorted sequences,
     computed only where the tile test passes, with the exact mask inside and a flash-style
     softmax over a query chunk's tiles, in eager torch.
4. Un-sort.

The tile test: a (query tile, key tile) pair of the sorted sequences is needed if the tiles'
bucket ranges overlap and the key tile's earliest position is not after the query tile's
latest one (what a block-sparse flash kernel decides from per-tile bucket and index ranges).

A query with no matching earlier key gets a zero output (the residual carries the token).
With `n_buckets = 1` every kernel but `tiles` runs dense causal SDPA (`is_causal=True`), which
equals the dense block. Attention dropout is not applied.

Cost: `blocks_computed` counts the tiles of `chunk` tokens the tile test needs, whatever the
kernel; `skipped_fraction = 1 - blocks_computed / blocks_causal`, where blocks_causal is what a
dense causal flash kernel computes with the same tile size (n(n+1)/2 tiles per head and
sequence, n = T / chunk).

Steps 1, 2 and the tile test live in `dynmo.model.hashsort`, the three kernels in
`dynmo.model.hashkernels`; `hash_sparse_attention` here is the one entry point.

Two families share steps 1-4 (`hash_sparse_attention`): `HashAttnBlock` (gpt) and
`LlamaHashAttnBlock` (llama), whose queries and keys are hashed after rotary, one LSH
projection per query head; a grouped key head is hashed and sorted by the directions of each
query head it serves, and read from its own heads (not expanded) by every kernel but `tiles`.

Per-layer stats (`block.last_stats`, summed over the forwards since `block.reset_stats()`):
blocks_computed, blocks_causal, skipped_fraction (from those sums), tokens_per_bucket (queries,
over batch and heads), forwards. The counts stay device tensors until the metrics read them
(`dynmo.model.stats.as_numbers`, once per step).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import HASH_KERNELS as KERNELS
from dynmo.config import HashAttnConfig, ModelConfig
from dynmo.model import hashkernels, llama
from dynmo.model.gpt import MLP, CausalSelfAttention, Halves
from dynmo.model.hashsort import compute_dtype, lsh_buckets, sorted_rows, tile_test, unsort
from dynmo.model.stats import StepStats

HashAttnOptions = HashAttnConfig  # options live in the config ([model.hashattn])

# Below this many tokens `auto` on CPU picks the tiles kernel: the staircase's two kernel
# calls per chunk then cost more than the tiles' few batched ops (one thread, 4 buckets: 8.9
# against 3.6 ms at 128 tokens, even at 512, 1.4x faster at 1024).
STAIR_MIN_T = 512


def check_kernel(kernel: str, device_type: str, needs_backward: bool = True) -> str | None:
    """Why `model.hashattn.kernel` cannot run on this device type (one line that says what to
    use instead), or None if it can."""
    if kernel not in KERNELS:
        return f"model.hashattn.kernel={kernel!r} is not one of {', '.join(KERNELS)}"
    if kernel == "staircase" and device_type != "cpu":
        return (f"model.hashattn.kernel='staircase' runs on CPU only (it calls CPU's flash-attention "
                f"kernels), not on {device_type}; use kernel='auto' or 'tiles'")
    if kernel == "staircase" and hashkernels.flash_cpu() is None:
        return (f"model.hashattn.kernel='staircase' needs torch's CPU flash-attention kernels, which "
                f"torch {torch.__version__} lacks; use kernel='auto' or 'tiles'")
    if kernel != "flex":
        return None
    if not hashkernels.has_flex():
        return (f"model.hashattn.kernel='flex' needs torch.nn.attention.flex_attention (torch>=2.5, "
                f"this is {torch.__version__}); use kernel='auto' or 'tiles'")
    if needs_backward and device_type in ("cpu", "mps"):
        alternative = "'staircase' or 'auto'" if device_type == "cpu" else "'auto' or 'tiles'"
        return (f"model.hashattn.kernel='flex' cannot train on {device_type}: FlexAttention has no "
                f"backward there; use kernel={alternative}")
    return None


def resolve_kernel(kernel: str, device_type: str, seq_len: int = STAIR_MIN_T) -> str:
    """The kernel `auto` stands for on this device type and sequence length (any other name
    stands for itself): the fastest exact one that runs there."""
    if kernel != "auto":
        return kernel
    if (device_type == "cpu" and hashkernels.flash_cpu() is not None and seq_len >= STAIR_MIN_T
            and not torch.compiler.is_compiling()):  # the staircase plans on the host: no graph holds it
        return "staircase"
    if device_type == "cuda" and hashkernels.has_flex():
        return "flex"
    return "tiles"


def hash_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, planes: torch.Tensor,
                          chunk: int, kernel: str = "auto") -> tuple[torch.Tensor, dict]:
    """Steps 1-4 of the module docstring for any family's heads: q [B, H, T, hd], k and v
    [B, Hkv, T, hd] (Hkv divides H: grouped heads) -> the output heads [B, H, T, hd] and the
    tile stats (device tensors, but `blocks_causal`, a number)."""
    B, H, T, hd = q.shape
    n_buckets = planes.shape[-1]
    if T % chunk:
        raise ValueError(f"hashattn.chunk={chunk} must divide the sequence length {T}")
    needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    problem = check_kernel(kernel, q.device.type, needs_backward)
    if problem:
        raise ValueError(problem)
    n, dev = T // chunk, q.device
    causal = B * H * n * (n + 1) // 2
    if n_buckets == 1 and kernel != "tiles":  # dense causal attention, the fastest there is
        dt = compute_dtype(q, v)
        y = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), is_causal=True,
                                           enable_gqa=k.shape[1] != H)
        info = {"blocks_computed": torch.full((), causal, device=dev),
                "blocks_causal": causal,
                "tokens_per_bucket": torch.full((1,), B * H * T, device=dev)}
        return y, info
    kernel = resolve_kernel(kernel, q.device.type, T)
    with torch.no_grad():
        bq, bk = lsh_buckets(q, planes), lsh_buckets(k, planes)
        (sbq, oq), (sbk, ok) = torch.sort(bq, dim=-1, stable=True), torch.sort(bk, dim=-1, stable=True)
        info = {
            "blocks_computed": tile_test(sbq, oq, sbk, ok, chunk).sum(),
            "blocks_causal": causal,
            "tokens_per_bucket": torch.zeros(n_buckets, dtype=torch.long, device=dev).index_add_(
                0, bq.flatten(), torch.ones(bq.numel(), dtype=torch.long, device=dev)),
        }
    if kernel == "tiles":
        return hashkernels.tiles(q, k, v, sbq, oq, sbk, ok, chunk), info
    dt = compute_dtype(q, v)
    qs, ks, vs = sorted_rows(q.to(dt), oq), sorted_rows(k.to(dt), ok), sorted_rows(v.to(dt), ok)
    if kernel == "flex":
        y = hashkernels.flex(qs, ks, vs, sbq, oq, sbk, ok, chunk)
    else:
        y = hashkernels.staircase(qs, ks, vs, sbq, oq, sbk, ok)
    return unsort(y, oq), info


def _check(opts: HashAttnOptions) -> None:
    if opts.n_buckets < 1 or opts.chunk < 1:
        raise ValueError(f"hashattn.n_buckets={opts.n_buckets} and hashattn.chunk={opts.chunk} must be >= 1")
    if opts.kernel not in KERNELS:
        raise ValueError(check_kernel(opts.kernel, "cpu"))


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
        y, info = hash_sparse_attention(q, k, v, self.planes, self.opts.chunk, self.opts.kernel)
        return self.proj(y.transpose(1, 2).reshape(B, T, C)), info


class LlamaHashSparseAttention(llama.Attention):
    """Same parameters as `llama.Attention`; a fixed LSH projection buffer per query head.

    Queries and keys are hashed after rotary, on what the attention scores are computed
    from, so a bucket groups tokens whose rotated vectors point alike. Each query head sorts
    its group's keys by its own directions, as in the GPT version; the grouped key and value
    heads are passed as they are (`hash_sparse_attention` reads each for every query head it
    serves), not expanded first.
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
        # `project` without its expansion of the grouped heads to the query heads
        q = self._heads(self.q_proj, x, self.n_heads)
        k, v = self._heads(self.k_proj, x, self.n_kv), self._heads(self.v_proj, x, self.n_kv)
        table = llama.rotary_table(self.cfg, x.shape[1], x.device, q.dtype)[:, None, : x.shape[1]]  # [2, 1, T, hd]
        q, k = llama.apply_rope(q, table), llama.apply_rope(k, table)
        y, info = hash_sparse_attention(q, k, v, self.planes, self.opts.chunk, self.opts.kernel)
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
