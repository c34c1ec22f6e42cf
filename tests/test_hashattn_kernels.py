"""The kernels of hash-sparse attention (`hash_sparse_attention(kernel=...)`) against the tiles
reference: the same output and the same gradients for q, k and v on ragged and empty buckets,
queries with no allowed key (zero output), grouped-query heads through the llama block and
bf16 autocast; one bucket is dense causal SDPA; no tensor grows as T x T; the statistics stay
on the device until the metrics read them; a kernel that cannot run says so before any work.

Tolerances: float32 1e-5 absolute and relative (the kernels sum the same terms in another
order); bf16 autocast 3e-2 against float32 (bf16 keeps 8 bits of mantissa).
"""

from __future__ import annotations

import math
import resource

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dynmo.model.hashattn as ha
import dynmo.model.hashkernels as hk
from dynmo.config import HashAttnConfig, ModelConfig
from dynmo.model import llama
from dynmo.model.hashattn import HashAttnBlock, LlamaHashAttnBlock, check_kernel, hash_sparse_attention
from dynmo.model.layers import LayerSpec, build_layer
from dynmo.model.stats import StepStats, as_numbers

F32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=3e-2, rtol=3e-2)


def eager_flex(monkeypatch):
    """The flex kernel with FlexAttention uncompiled: the same BlockMask and mask_mod, seconds
    instead of a compilation per test (the compiled kernel has its own test below)."""
    from torch.nn.attention import flex_attention as fa

    monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # no "uncompiled" warning
    monkeypatch.setattr(hk, "_compiled_flex", lambda: fa.flex_attention)


def heads(B, H, Hkv, T, hd, seed):
    """Random q [B, H, T, hd], k and v [B, Hkv, T, hd] (leaves)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g)
    k, v = torch.randn(B, Hkv, T, hd, generator=g), torch.randn(B, Hkv, T, hd, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


def lsh_planes(H, hd, n_buckets, seed, skew=1.0):
    """Random LSH directions; `skew` > 1 lengthens the first, which then wins most argmaxes:
    one big bucket, small and empty ones (ragged buckets, scores no larger)."""
    planes = torch.randn(H, hd, n_buckets, generator=torch.Generator().manual_seed(seed))
    planes[..., 0] *= skew
    return planes


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The staircase makes many small SDPA calls; on this shared machine two OpenMP threads wait
    on each other at every call's barrier, which makes them slower than one by far."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run(kernel, q, k, v, planes, chunk):
    """Output, gradients of q, k, v (for a fixed random output gradient; zero for an input
    the output does not use) and stats."""
    y, info = hash_sparse_attention(q, k, v, planes, chunk, kernel)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(y, (q, k, v), dy, allow_unused=True, materialize_grads=True)
    return y, grads, info


def allowed_mask(q, k, planes):
    """Dense [B, H, T, T] rule (same bucket, causal) for small checks only."""
    bq, bk = ha.lsh_buckets(q, planes), ha.lsh_buckets(k, planes)
    T = q.shape[2]
    return (bq.unsqueeze(-1) == bk.unsqueeze(-2)) & torch.ones(T, T, dtype=torch.bool).tril()


@settings(max_examples=8, deadline=None)
@given(
    shape=st.sampled_from([(1, 2, 2, 32, 8), (2, 4, 2, 48, 8), (1, 4, 1, 64, 16), (2, 2, 2, 24, 4)]),
    n_buckets=st.sampled_from([2, 3, 8, 16]),
    chunk=st.sampled_from([4, 8]),
    skew=st.sampled_from([1.0, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_staircase_equals_tiles_output_and_gradients(shape, n_buckets, chunk, skew, seed):
    B, H, Hkv, T, hd = shape
    if T % chunk:
        chunk = 4
    q, k, v = heads(B, H, Hkv, T, hd, seed)
    planes = lsh_planes(H, hd, n_buckets, seed + 1, skew)
    y0, g0, i0 = run("tiles", q, k, v, planes, chunk)
    y1, g1, i1 = run("staircase", q, k, v, planes, chunk)
    torch.testing.assert_close(y1, y0, **F32)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, **F32)
    for key in ("blocks_computed", "tokens_per_bucket"):
        assert torch.equal(i1[key], i0[key])
    assert i1["blocks_causal"] == i0["blocks_causal"]
    with torch.no_grad():  # rows with no allowed key are exactly zero
        keyless = ~allowed_mask(q, k, planes).any(-1)
        assert torch.all(y1[keyless] == 0)


def sorted_hashes(q, k, planes):
    bq, bk = ha.lsh_buckets(q, planes), ha.lsh_buckets(k, planes)
    return (*torch.sort(bq, dim=-1, stable=True), *torch.sort(bk, dim=-1, stable=True))


def test_staircase_is_bitwise_the_same_with_two_threads():
    """The caller's two intra-op threads sort and un-sort, the chunks run on one: output and
    gradients are bitwise those of one thread throughout."""
    q, k, v = heads(2, 4, 2, 256, 8, seed=5)
    planes = lsh_planes(4, 8, 4, 5, skew=2.0)
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            y, grads, _ = run("staircase", q, k, v, planes, 16)
        finally:
            torch.set_num_threads(1)
        runs.append((y, *grads))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("n_buckets,chunk,skew", [(4, 8, 1.0), (16, 4, 1.0), (8, 4, 3.0), (3, 16, 3.0)])
def test_flex_block_mask_holds_every_allowed_pair(n_buckets, chunk, skew):
    """Every allowed (query, key) pair of the sorted sequences lies in a tile the BlockMask
    lists, and every pair of a tile it lists as full is allowed (its mask is skipped there)."""
    q, k, _ = heads(2, 4, 2, 128, 8, seed=n_buckets)
    sbq, oq, sbk, ok = sorted_hashes(q, k, lsh_planes(4, 8, n_buckets, 0, skew))
    mask = hk.flex_block_mask(sbq, oq, sbk, ok, chunk)
    c = hk.flex_tile(128, chunk)
    allowed = (sbq.unsqueeze(-1) == sbk.unsqueeze(-2)) & (ok.unsqueeze(-2) <= oq.unsqueeze(-1))
    tiles = allowed.unflatten(-1, (-1, c)).unflatten(-3, (-1, c))  # [B, H, n, c, n, c]
    any_allowed, all_allowed = tiles.any(-1).any(-2), tiles.all(-1).all(-2)

    def dense(num, idx):  # the listed tiles, [B, H, n, n]
        n = idx.shape[-1]
        listed = torch.arange(n) < num.unsqueeze(-1)
        return torch.zeros(*idx.shape[:-1], n, dtype=torch.bool).scatter(-1, idx.long(), listed)

    partial, full = dense(mask.kv_num_blocks, mask.kv_indices), dense(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (any_allowed & ~(partial | full)).any()
    assert all_allowed[full].all() and not (partial & full).any()


@pytest.mark.parametrize("n_buckets,chunk,skew", [(4, 8, 1.0), (16, 4, 1.0), (8, 4, 3.0)])
def test_flex_mask_mod_forward_equals_tiles(monkeypatch, n_buckets, chunk, skew):
    """The flex kernel's rule (`mask_mod`), through uncompiled FlexAttention, which applies it
    to every pair (it does not skip by the BlockMask; the compiled kernel does, below)."""
    eager_flex(monkeypatch)
    q, k, v = heads(2, 4, 2, 64, 8, seed=n_buckets)
    planes = lsh_planes(4, 8, n_buckets, 0, skew)
    with torch.no_grad():
        y0, i0 = hash_sparse_attention(q, k, v, planes, chunk, "tiles")
        y1, i1 = hash_sparse_attention(q, k, v, planes, chunk, "flex")
        torch.testing.assert_close(y1, y0, **F32)
        assert torch.all(y1[~allowed_mask(q, k, planes).any(-1)] == 0)
    assert torch.equal(i1["blocks_computed"], i0["blocks_computed"])


def test_queries_with_no_allowed_key_output_zero_and_pass_no_gradient(monkeypatch):
    """Keys all in bucket 0, queries all in bucket 1 (and half the queries of a mixed case
    before their bucket's first key): every such row is 0, its gradients 0, nothing NaN."""
    hd, T = 4, 32
    planes = torch.zeros(1, hd, 2)
    planes[0, 0, 0], planes[0, 0, 1] = 1.0, -1.0  # bucket by the sign of the first coordinate
    q = torch.randn(1, 1, T, hd).abs().neg().requires_grad_()  # first coordinate < 0: bucket 1
    k = torch.randn(1, 1, T, hd).abs().requires_grad_()  # > 0: bucket 0
    v = torch.randn(1, 1, T, hd).requires_grad_()
    for kernel in ("staircase", "tiles"):
        y, (gq, gk, gv), _ = run(kernel, q, k, v, planes, 8)
        assert torch.equal(y, torch.zeros_like(y))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in (gq, gk, gv))
    eager_flex(monkeypatch)
    with torch.no_grad():
        assert torch.equal(hash_sparse_attention(q, k, v, planes, 8, "flex")[0], torch.zeros(1, 1, T, hd))
    # keys of bucket 1 only from position 16 on: queries of bucket 1 before it get 0
    k2 = k.detach().clone()
    k2[..., 16:, 0] *= -1
    k2.requires_grad_()
    y0, g0, _ = run("tiles", q, k2, v, planes, 8)
    y1, g1, _ = run("staircase", q, k2, v, planes, 8)
    assert torch.equal(y1[..., :16, :], torch.zeros(1, 1, 16, hd)) and y1[..., 16:, :].abs().sum() > 0
    torch.testing.assert_close(y1, y0, **F32)
    for a, b in zip(g1, g0):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **F32)


def llama_block(kernel: str, n_buckets: int) -> tuple[LlamaHashAttnBlock, ModelConfig]:
    cfg = ModelConfig(family="llama", d_model=32, n_heads=4, n_kv_heads=2, seq_len=32, n_layers=2, mlp_ratio=2,
                      block="hashattn", hashattn=HashAttnConfig(n_buckets=n_buckets, chunk=4, kernel=kernel))
    return build_layer(LayerSpec("t", 2), cfg, seed=5), cfg


@pytest.mark.parametrize("n_buckets", [1, 4])
def test_llama_grouped_heads_equal_tiles_and_dense(n_buckets):
    """Grouped key/value heads (4 query heads, 2 kv heads) read by each query head they serve:
    the block's output and every parameter gradient equal the tiles kernel's (which expands
    them first); with one bucket, the dense llama block's."""
    x = torch.randn(2, 32, 32)
    mask = torch.ones(2, 32, dtype=torch.bool)
    outs, grads = [], []
    for kernel in ("tiles", "staircase"):
        block, cfg = llama_block(kernel, n_buckets)
        out = block(x, mask)[0]
        out.square().sum().backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in block.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], **F32)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], **F32)
    if n_buckets == 1:
        dense = llama.Block(cfg)
        dense.load_state_dict({k: v for k, v in block.state_dict().items() if k != "self_attn.planes"})
        torch.testing.assert_close(outs[1], dense(x, mask)[0], **F32)


def gpt_attn(kernel: str, n_buckets: int, chunk: int = 8):
    cfg = ModelConfig(d_model=32, n_heads=2, seq_len=32, n_layers=2, mlp_ratio=2, block="hashattn",
                      hashattn=HashAttnConfig(n_buckets=n_buckets, chunk=chunk, kernel=kernel))
    torch.manual_seed(0)
    return HashAttnBlock(cfg), cfg


def test_one_bucket_is_dense_causal_sdpa_and_the_dense_block():
    from dynmo.model.gpt import Block, CausalSelfAttention

    x = torch.randn(2, 32, 32)
    mask = torch.ones(2, 32, dtype=torch.bool)
    block, cfg = gpt_attn("auto", 1)
    dense = Block(cfg)
    dense.load_state_dict({k: v for k, v in block.state_dict().items() if k != "attn.planes"})
    y, info = block.attn(x)
    assert torch.equal(y, CausalSelfAttention.forward(dense.attn, x))  # the same SDPA call
    torch.testing.assert_close(block(x, mask)[0], dense(x, mask)[0], atol=0, rtol=0)
    assert int(info["blocks_computed"]) == info["blocks_causal"]
    tiles, _ = gpt_attn("tiles", 1)
    torch.testing.assert_close(tiles.attn(x)[0], y, **F32)


def test_bf16_autocast_close_to_float32():
    """Under CPU bf16 autocast each kernel's output is bf16 and within bf16 rounding of the
    float32 reference; so are the parameter gradients."""
    x = torch.randn(2, 32, 32)
    ref, _ = gpt_attn("tiles", 4)
    out_ref = ref.attn(x)[0]
    out_ref.square().mean().backward()
    for kernel in ("staircase", "tiles"):
        block, _ = gpt_attn(kernel, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block.attn(x)[0]
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), out_ref, **BF16)
        out.float().square().mean().backward()
        for (n, p), (_, p0) in zip(block.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, p0.grad, **BF16, msg=f"{kernel} {n}")


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes, forward and backward (autograd runs CPU
    backward on this thread, under the mode); what happens inside a fused kernel is not seen."""

    def __init__(self):
        super().__init__()
        self.most, self.ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_memory_is_linear_in_sequence_length():
    """T = 32768: a T x T float32 tensor would be 4.3 GB. Forward and backward of the staircase
    make no tensor larger than the hash projection (T x n_buckets elements, T / 256 of T x T),
    and the process's peak memory grows by well under 1 GB (a high-water mark: it can only miss
    a T x T tensor another test already exceeded, never flag one that is not there). The 128
    directions are spread evenly on a circle, so Gaussian tokens fill the buckets evenly: each
    query has about 128 allowed keys, under a second of work. What autograd keeps for the
    backward is a few copies of the heads (O(T hd)), not the chunks' masks."""
    T, hd, n_buckets, chunk = 32768, 4, 128, 256
    q, k, v = heads(1, 1, 1, T, hd, seed=0)
    angle = torch.arange(n_buckets) * (2 * math.pi / n_buckets)
    planes = torch.zeros(1, hd, n_buckets)
    planes[0, 0], planes[0, 1] = angle.cos(), angle.sin()
    saved = []
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with LargestTensor() as seen:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            y, info = hash_sparse_attention(q, k, v, planes, chunk, "staircase")
        forward_ops = seen.ops
        y.backward(torch.ones_like(y))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert seen.ops > forward_ops  # the backward ran under the mode too
    assert seen.most <= T * n_buckets, seen.most
    assert sum(saved) <= 16 * T * hd, sum(saved)  # what the backward keeps: a few copies of the heads
    assert grown_kib < 1024 * 1024, grown_kib
    assert int(info["blocks_computed"]) < info["blocks_causal"] / 8


def test_stats_are_device_tensors_summed_without_reading_them(monkeypatch):
    block, _ = gpt_attn("staircase", 4)
    x, mask = torch.randn(2, 32, 32), torch.ones(2, 32, dtype=torch.bool)
    block(x, mask)
    block(x, mask)
    s = block.last_stats
    assert isinstance(s["blocks_computed"], torch.Tensor) and isinstance(s["tokens_per_bucket"], torch.Tensor)
    assert int(s["tokens_per_bucket"].sum()) == 2 * 2 * 2 * 32 and s["forwards"] == 2

    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    (n,) = as_numbers([s])
    assert len(reads) == 2  # one transfer for the integer counts, one for the fraction
    assert n["blocks_computed"] == int(s["blocks_computed"]) and isinstance(n["blocks_computed"], int)
    assert n["tokens_per_bucket"] == s["tokens_per_bucket"].tolist()
    assert n["skipped_fraction"] == pytest.approx(1 - n["blocks_computed"] / n["blocks_causal"])
    assert n["forwards"] == 2 and n["blocks_causal"] == s["blocks_causal"]
    plain = StepStats()
    plain.add(rows=3, loads=[1, 2])
    plain.add(rows=4, loads=[1, 1])
    assert as_numbers([plain.sums]) == [{"rows": 7, "loads": [2, 3]}]


def test_flex_builds_its_mask_and_stats_without_reading_the_device(monkeypatch):
    """The flex kernel's BlockMask and the stats come from device tensors only: no value is
    read back (on a GPU, that would be a synchronisation per layer)."""
    eager_flex(monkeypatch)
    q, k, v = heads(1, 2, 2, 64, 8, seed=3)
    planes = torch.randn(2, 8, 4)

    def forbidden(*a, **kw):
        raise AssertionError("read a device value")

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    with torch.no_grad():
        bq, bk = ha.lsh_buckets(q, planes), ha.lsh_buckets(k, planes)
        (sbq, oq), (sbk, ok) = torch.sort(bq, dim=-1, stable=True), torch.sort(bk, dim=-1, stable=True)
        mask = hk.flex_block_mask(sbq, oq, sbk, ok, 8)
        hk.tile_test(sbq, oq, sbk, ok, 8).sum()
    monkeypatch.undo()
    assert mask.kv_num_blocks.shape == (1, 2, 64 // hk.flex_tile(64, 8))


def test_compiled_flex_forward_equals_tiles_and_does_not_recompile():
    """FlexAttention compiled for the CPU (forward only there), which computes only the tiles
    its BlockMask lists: equal to the tiles kernel on even and ragged buckets and keyless
    queries, and each call after the first (other hashes: a new mask, the same shapes) reuses
    the compiled kernel."""
    try:
        import torch._dynamo  # noqa: F401
    except ImportError:
        pytest.skip("torch.compile is unavailable")
    q, k, v = heads(1, 2, 2, 128, 16, seed=4)
    with torch.no_grad():
        try:
            hash_sparse_attention(q, k, v, lsh_planes(2, 16, 4, 0), 16, "flex")
        except Exception as e:  # no C++ compiler, or inductor cannot build here
            pytest.skip(f"torch.compile cannot build FlexAttention here: {type(e).__name__}")
        for n_buckets, skew in ((4, 1.0), (8, 3.0), (16, 1.0)):
            planes = lsh_planes(2, 16, n_buckets, n_buckets, skew)
            with torch._dynamo.config.patch(error_on_recompile=True):
                y, _ = hash_sparse_attention(q, k, v, planes, 16, "flex")
            torch.testing.assert_close(y, hash_sparse_attention(q, k, v, planes, 16, "tiles")[0], **F32)
            assert torch.all(y[~allowed_mask(q, k, planes).any(-1)] == 0)


def test_kernel_checks_say_what_to_use(monkeypatch):
    for kernel in ("auto", "staircase", "tiles"):
        assert check_kernel(kernel, "cpu") is None
    for kernel in ("auto", "flex", "tiles"):
        assert check_kernel(kernel, "cuda") is None
    assert check_kernel("flex", "cpu", needs_backward=False) is None
    msg = check_kernel("flex", "cpu")
    assert "no backward" in msg and "'staircase'" in msg and "\n" not in msg
    assert "runs on CPU only" in check_kernel("staircase", "cuda")
    assert "is not one of auto, staircase, flex, tiles" in check_kernel("fast", "cpu")
    assert ha.resolve_kernel("auto", "cpu", 8192) == "staircase" and ha.resolve_kernel("auto", "cuda") == "flex"
    assert ha.resolve_kernel("auto", "cpu", 128) == "tiles"  # the staircase's calls cost more there
    monkeypatch.setattr(hk, "has_flex", lambda: False)
    monkeypatch.setattr(hk, "flash_cpu", lambda: None)
    assert "torch>=2.5" in check_kernel("flex", "cuda") and "lacks" in check_kernel("staircase", "cpu")
    assert ha.resolve_kernel("auto", "cuda") == ha.resolve_kernel("auto", "cpu") == "tiles"
    monkeypatch.undo()

    q, k, v = heads(1, 1, 1, 16, 4, seed=0)
    with pytest.raises(ValueError, match="cannot train on cpu"):
        hash_sparse_attention(q, k, v, torch.randn(1, 4, 4), 4, "flex")
    with pytest.raises(ValueError, match="is not one of"):
        gpt_attn("fast", 4)
