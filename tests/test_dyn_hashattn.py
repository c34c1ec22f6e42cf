"""Hash-sparse attention: equals dense causal attention with one bucket, equals the dense
bucket-masked reference with many (skipping tiles loses nothing), the counted tile work
follows the hash distribution and changes during training."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dynmo.config import ModelConfig
from dynmo.model.hashattn import HashAttnBlock, HashAttnOptions, HashSparseAttention
from dynmo.model.gpt import Block, CausalSelfAttention
from dynmo.model.layers import BLOCKS, LayerSpec, build_layer
from tests.toy import train_block

B, T, D, H = 2, 32, 32, 2


def cfg_with(**opts) -> ModelConfig:
    cfg = ModelConfig(d_model=D, n_heads=H, seq_len=T, n_layers=2, mlp_ratio=2, block="hashattn")
    cfg.hashattn = HashAttnOptions(**opts)  # the config field the runtime adds later
    return cfg


def heads(attn, x):
    q, k, v = attn.qkv(x).split(D, dim=2)
    return (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))


def masked_reference(attn: HashSparseAttention, x: torch.Tensor) -> torch.Tensor:
    """Dense T x T attention with the mask (same bucket and causal); keyless rows give 0."""
    q, k, v = heads(attn, x)
    allowed = (attn.buckets(q).unsqueeze(-1) == attn.buckets(k).unsqueeze(-2)) & torch.ones(T, T, dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2) / math.sqrt(D // H)).masked_fill(~allowed, float("-inf"))
    y = torch.softmax(s, -1).nan_to_num(0.0) @ v
    return attn.proj(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("chunk", [4, 8, 32])
def test_one_bucket_equals_dense_causal_attention(chunk):
    torch.manual_seed(0)
    cfg = cfg_with(n_buckets=1, chunk=chunk)
    block = HashAttnBlock(cfg)
    dense = Block(cfg)
    dense.load_state_dict({k: v for k, v in block.state_dict().items() if k != "attn.planes"})
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        y, info = block.attn(x)
        torch.testing.assert_close(y, CausalSelfAttention.forward(dense.attn, x), atol=1e-6, rtol=0)  # SDPA
        out, m = block(x, mask)
        torch.testing.assert_close(out, dense(x, mask)[0], atol=1e-6, rtol=0)
    assert m is mask
    n = T // chunk
    assert info["blocks_computed"] == info["blocks_causal"] == B * H * n * (n + 1) // 2
    assert block.last_stats["skipped_fraction"] == 0.0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_buckets,chunk", [(2, 4), (4, 8), (8, 4), (16, 2)])
def test_many_buckets_equal_masked_dense_and_skip_work(seed, n_buckets, chunk):
    torch.manual_seed(seed)
    attn = HashSparseAttention(cfg_with(), HashAttnOptions(n_buckets=n_buckets, chunk=chunk))
    x = torch.randn(B, T, D)
    with torch.no_grad():
        y, info = attn(x)
        torch.testing.assert_close(y, masked_reference(attn, x), atol=1e-6, rtol=0)
    assert info["blocks_computed"] < info["blocks_causal"]  # tiles were skipped
    assert sum(info["tokens_per_bucket"]) == B * H * T and len(info["tokens_per_bucket"]) == n_buckets


def test_counted_tile_work_follows_blocks_computed():
    torch.manual_seed(1)
    hd, c, nb = D // H, 4, 8
    attn = HashSparseAttention(cfg_with(), HashAttnOptions(n_buckets=nb, chunk=c, kernel="tiles"))
    counts = set()
    for scale in [0.1, 1.0, 10.0]:  # different hash distributions -> different tiles
        x = scale * torch.randn(B, T, D) + torch.randn(D)
        with FlopCounterMode(display=False) as flops, torch.no_grad():
            _, info = attn(x)
        bmm = sum(v for op, v in flops.get_flop_counts()["Global"].items() if "bmm" in str(op))
        hashing = 2 * (2 * B * H * T * hd * nb)  # q and k projected on the LSH directions
        assert bmm == 2 * (2 * info["blocks_computed"] * c * c * hd) + hashing  # scores and P @ V per tile
        counts.add(info["blocks_computed"])
    assert len(counts) > 1


def test_skipped_fraction_changes_during_training_and_loss_decreases():
    torch.manual_seed(2)
    block = HashAttnBlock(cfg_with(n_buckets=4, chunk=4))
    losses, skipped = train_block(block, 10, "skipped_fraction", B, T, D)
    skipped = [float(s) for s in skipped]  # device tensors until the metrics read them
    assert all(0.0 < s < 1.0 for s in skipped)
    assert len(set(skipped)) > 1  # the hash distribution, and the work, move with the weights
    assert losses[-1] < losses[0]


def test_stats_accumulate_and_reset():
    torch.manual_seed(3)
    block = HashAttnBlock(cfg_with(n_buckets=4, chunk=4))
    mask = torch.ones(B, T, dtype=torch.bool)
    block(torch.randn(B, T, D), mask)
    one = dict(block.last_stats)
    block(torch.randn(B, T, D), mask)
    s = block.last_stats
    assert s["forwards"] == 2 and s["blocks_causal"] == 2 * one["blocks_causal"]
    assert s["skipped_fraction"] == pytest.approx(1 - s["blocks_computed"] / s["blocks_causal"])
    block.reset_stats()
    assert block.last_stats == {}


def test_registered_rebuilt_identically_and_bad_chunk():
    assert BLOCKS["hashattn"] is HashAttnBlock
    cfg = ModelConfig(d_model=D, n_heads=H, seq_len=T, n_layers=2, block="hashattn")
    a, b = (build_layer(LayerSpec("t", 2), cfg, seed=7) for _ in range(2))
    assert torch.equal(a.attn.planes, b.attn.planes)  # a migrated layer rebuilt from its spec hashes the same
    assert a.opts == HashAttnOptions()
    with pytest.raises(ValueError, match="must divide"):
        HashAttnBlock(cfg_with(chunk=5))(torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool))


def test_bf16_sums_in_float32_under_either_autocast_policy(monkeypatch):
    """CUDA's autocast runs exp (and sum) in float32, CPU's keeps bf16: the softmax's pieces then
    met in index_add with different dtypes on a GPU only. Both policies, the CUDA one emulated
    here, give the same float32 sums; the output is in the compute dtype, close to float32."""
    torch.manual_seed(0)
    attn = HashSparseAttention(cfg_with(), HashAttnOptions(n_buckets=4, chunk=8))
    x = torch.randn(B, T, D)
    with torch.no_grad():
        ref, _ = attn(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cpu_policy, _ = attn(x)
        exp = torch.exp
        monkeypatch.setattr(torch, "exp", lambda t, *a, **k: exp(t.float(), *a, **k))  # CUDA's policy
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cuda_policy, _ = attn(x)
    assert cpu_policy.dtype == cuda_policy.dtype == torch.bfloat16
    assert torch.equal(cpu_policy, cuda_policy)
    torch.testing.assert_close(cpu_policy.float(), ref, atol=2e-2, rtol=2e-2)


def test_mixed_dtype_heads():
    """Queries and keys in float32 (what rotary makes of bf16 heads), values in bf16: the output
    is in the values' dtype and equals the all-float32 one up to bf16 rounding."""
    from dynmo.model.hashattn import hash_sparse_attention

    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D // H) for _ in range(3))
    planes = torch.randn(H, D // H, 4)
    ref, _ = hash_sparse_attention(q, k, v, planes, 8)
    y, _ = hash_sparse_attention(q, k, v.bfloat16(), planes, 8)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
