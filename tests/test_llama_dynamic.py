"""The dynamic variants on the llama family: Mixture of Depths (chosen tokens at their original
rotary positions), hash-sparse attention on the rotated grouped-query heads, and early exit's
active-token path. Each equals the dense llama computation where it should, its compute falls
with capacity / active fraction (counted FLOPs), and end to end through the real launcher its
stats reach metrics.jsonl and a forced re-layout leaves the loss trajectory bitwise unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dynmo.config import ConfigError, EarlyExitConfig, HashAttnConfig, ModelConfig, MoDConfig, load_config
from dynmo.dynamics.earlyexit import check_options, install_gate
from dynmo.model import llama
from dynmo.model.hashattn import LlamaHashAttnBlock, LlamaHashSparseAttention
from dynmo.model.layers import FAMILIES, LayerSpec, build_layer
from dynmo.model.mod import LlamaMoDBlock
from tests.conftest import metrics, run_train
from tests.test_dyn_mod import SdpaShapes

B, T, D, H, KV = 3, 16, 32, 4, 2
HD = D // H
INTER = 2 * D  # mlp_ratio 2


def cfg_with(block: str = "dense", **kw) -> ModelConfig:
    cfg = ModelConfig(family="llama", d_model=D, n_heads=H, n_kv_heads=KV, seq_len=T, n_layers=2,
                      mlp_ratio=2, block=block)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def dense_twin(block, cfg: ModelConfig) -> llama.Block:
    """A dense llama Block with the dynamic block's attention and MLP weights."""
    dense = llama.Block(cfg)
    skip = ("router", "predictor", "self_attn.planes")
    dense.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith(skip)})
    return dense


def matmul_flops(counter: FlopCounterMode) -> int:
    return sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))


# ---- Mixture of Depths ----

def make_mod(**opts) -> tuple[LlamaMoDBlock, ModelConfig]:
    cfg = cfg_with("mod", mod=MoDConfig(**opts))
    block = build_layer(LayerSpec("t", 1), cfg, seed=3)
    with torch.no_grad():  # non-trivial router scores, so top-k is well defined
        block.router.weight.normal_(0.0, 1.0)
    return block, cfg


def test_mod_full_capacity_equals_dense_block_update_and_chosen_tokens_keep_their_positions():
    torch.manual_seed(0)
    block, cfg = make_mod(capacity=1.0)
    dense = dense_twin(block, cfg)
    x, mask = torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        out, m = block(x, mask)
        ref = x + torch.sigmoid(block.router(x)) * (dense(x, mask)[0] - x)
    assert m is mask
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

    # capacity 1/4: a chosen token attends to the chosen tokens up to it, each rotated at its
    # place in the full sequence (the dense attention restricted to the chosen keys)
    block, cfg = make_mod(capacity=0.25)
    dense = dense_twin(block, cfg)
    with torch.no_grad():
        out, _ = block(x, mask)
        r = block.router(x).squeeze(-1)
        chosen = torch.zeros_like(mask).scatter(1, r.topk(T // 4, dim=1).indices, True)
        a = dense.self_attn
        h = dense.input_layernorm(x)
        q, k, v = (t.view(B, T, -1, HD).transpose(1, 2) for t in (a.q_proj(h), a.k_proj(h), a.v_proj(h)))
        cos, sin = llama.rotary(cfg, T, x.device, x.dtype)
        q, k = llama.apply_rotary(q, cos, sin), llama.apply_rotary(k, cos, sin)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        sees = torch.ones(T, T, dtype=torch.bool).tril() & chosen.unsqueeze(1)  # [B, T, T]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=sees.unsqueeze(1))
        s = x + a.o_proj(y.transpose(1, 2).reshape(B, T, D))
        ref = x + torch.sigmoid(r).unsqueeze(-1) * (s + dense.mlp(dense.post_attention_layernorm(s)) - x)
    torch.testing.assert_close(out[chosen], ref[chosen], atol=1e-5, rtol=0)
    assert torch.equal(out[~chosen], x[~chosen])


@pytest.mark.parametrize("capacity", [0.125, 0.25, 0.5, 1.0])
def test_mod_compute_scales_with_capacity(capacity):
    torch.manual_seed(1)
    block, _ = make_mod(capacity=capacity)
    x, mask = torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool)
    k = int(capacity * T)
    with FlopCounterMode(display=False) as flops, SdpaShapes() as sdpa:
        block(x, mask)
    # per chosen token: q and o D*D each, k and v D*KV*HD each, SwiGLU 3*D*INTER; router and
    # predictor D each on every token, the router again on the chosen ones (at capacity 1.0:
    # the router alone)
    per_token = 2 * D * D + 2 * D * KV * HD + 3 * D * INTER
    routing = D * B * T if capacity == 1.0 else 2 * D * B * T + D * B * k
    assert matmul_flops(flops) == 2 * per_token * B * k + 2 * routing
    assert sdpa.shapes == [(B, H, k, HD)]
    s = block.last_stats
    assert (s["rows"], s["attn_pairs"], s["capacity"]) == (B * k, B * k * (k + 1) // 2, capacity)


def test_mod_shares_the_gpt_routing_parameters_and_pruning_names():
    block, _ = make_mod()
    names = {n for n, _ in block.named_parameters()}
    assert {"router.weight", "predictor.weight", "predictor.bias"} <= names and "router.bias" not in names
    assert all(f"{p}.weight" in names for p in block.prunable)
    assert FAMILIES["llama"].blocks["mod"] is LlamaMoDBlock
    x = torch.randn(B, T, D, requires_grad=True)
    out, _ = block(x, torch.ones(B, T, dtype=torch.bool))
    out.sum().backward()
    assert block.predictor.weight.grad.abs().sum() > 0 and block.router.weight.grad.abs().sum() > 0


# ---- hash-sparse attention ----

def make_hash(n_buckets: int, chunk: int, kernel: str = "auto") -> tuple[LlamaHashAttnBlock, ModelConfig]:
    cfg = cfg_with("hashattn", hashattn=HashAttnConfig(n_buckets=n_buckets, chunk=chunk, kernel=kernel))
    return build_layer(LayerSpec("t", 2), cfg, seed=5), cfg


def rotated_heads(attn: LlamaHashSparseAttention, cfg: ModelConfig, x: torch.Tensor):
    q, k, v = (t.view(B, T, -1, HD).transpose(1, 2) for t in (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)))
    cos, sin = llama.rotary(cfg, T, x.device, x.dtype)
    q, k = llama.apply_rotary(q, cos, sin), llama.apply_rotary(k, cos, sin)
    return q, k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)


@pytest.mark.parametrize("chunk", [4, 16])
def test_hash_one_bucket_equals_dense_attention(chunk):
    torch.manual_seed(2)
    block, cfg = make_hash(1, chunk)
    dense = dense_twin(block, cfg)
    x, mask = torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        y, info = block.self_attn(x)
        torch.testing.assert_close(y, dense.self_attn(x), atol=1e-5, rtol=0)
        out, m = block(x, mask)
        torch.testing.assert_close(out, dense(x, mask)[0], atol=1e-5, rtol=0)
    assert m is mask
    n = T // chunk
    assert info["blocks_computed"] == info["blocks_causal"] == B * H * n * (n + 1) // 2
    assert block.last_stats["skipped_fraction"] == 0.0


@pytest.mark.parametrize("n_buckets,chunk", [(4, 4), (4, 2), (8, 4)])
def test_hash_many_buckets_hash_the_rotated_heads_and_skip_tiles(n_buckets, chunk):
    torch.manual_seed(3)
    block, cfg = make_hash(n_buckets, chunk, "tiles")  # the kernel whose matmuls are the tiles
    attn = block.self_attn
    assert attn.planes.shape == (H, HD, n_buckets)
    x = torch.randn(B, T, D)
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        y, info = attn(x)
    with torch.no_grad():  # dense T x T attention under the mask (same bucket of rotated q, k; causal)
        q, k, v = rotated_heads(attn, cfg, x)
        bq, bk = (torch.matmul(t, attn.planes.unsqueeze(0)).argmax(-1) for t in (q, k))
        allowed = (bq.unsqueeze(-1) == bk.unsqueeze(-2)) & torch.ones(T, T, dtype=torch.bool).tril()
        s = (q @ k.transpose(-1, -2) / math.sqrt(HD)).masked_fill(~allowed, float("-inf"))
        ref = attn.o_proj((torch.softmax(s, -1).nan_to_num(0.0) @ v).transpose(1, 2).reshape(B, T, D))
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=0)
    assert info["blocks_computed"] < info["blocks_causal"]
    assert info["tokens_per_bucket"].tolist() == torch.bincount(bq.flatten(), minlength=n_buckets).tolist()
    bmm = sum(v for op, v in flops.get_flop_counts()["Global"].items() if "bmm" in str(op))
    hashing = 2 * (2 * B * H * T * HD * n_buckets)
    assert bmm == 2 * (2 * info["blocks_computed"] * chunk * chunk * HD) + hashing
    block(x, torch.ones(B, T, dtype=torch.bool))
    assert set(block.last_stats) == {"blocks_computed", "blocks_causal", "skipped_fraction",
                                     "tokens_per_bucket", "forwards"}


def test_hash_planes_are_rebuilt_identically():
    (a, _), (b, _) = make_hash(4, 4), make_hash(4, 4)
    assert torch.equal(a.self_attn.planes, b.self_attn.planes)
    assert FAMILIES["llama"].blocks["hashattn"] is LlamaHashAttnBlock


# ---- early exit ----

def dense_block(seed=1) -> llama.Block:
    return build_layer(LayerSpec("t", 1), cfg_with(), seed=seed)


def test_exit_active_tokens_get_the_dense_output_and_exited_tokens_pass_bitwise():
    torch.manual_seed(4)
    b, x = dense_block(), torch.randn(B, T, D)
    mask = torch.rand(B, T) > 0.4
    mask[2] = False  # a sequence with no active token
    mask[1, 0] = False  # the first position inactive: an active token still sees it as a key
    with torch.no_grad():
        ref = b(x, mask)[0]
        b.skip_inactive = True
        out = b(x, mask)[0]
        b.skip_inactive = False
    assert torch.equal(out[~mask], x[~mask])
    torch.testing.assert_close(out[mask], ref[mask], rtol=1e-5, atol=1e-5)
    g = install_gate(b, EarlyExitConfig(), can_exit=False)
    with torch.no_grad():
        gated, m = b(x, mask)
    assert torch.equal(gated, out) and m is mask and g.summary()["active_tokens"] == int(mask.sum())


def test_exit_compute_falls_with_the_active_fraction():
    b, x = dense_block(), torch.randn(B, T, D)
    install_gate(b, EarlyExitConfig(), can_exit=False)
    flops = []
    for frac in (1.0, 0.5, 0.25):
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[:, : int(frac * T)] = True
        with FlopCounterMode(display=False) as fc:
            b(x.clone().requires_grad_(True), mask)[0].sum().backward()
        flops.append(fc.get_total_flops())
    assert flops[0] > flops[1] > flops[2]
    assert flops[2] < 0.5 * flops[0]  # only the K/V projections stay per token


def test_exit_options_accept_llama_only_with_the_dense_block():
    cfg = load_config(None, ["--model.n_layers", "4", "--model.family", "llama"])
    check_options(EarlyExitConfig(first_block=1), cfg)
    cfg.model.block = "mod"
    with pytest.raises(ConfigError, match="dense"):
        check_options(EarlyExitConfig(first_block=1), cfg)
    cfg.model.family, cfg.model.block = "mixtral", "moe"
    with pytest.raises(ConfigError, match="family"):
        check_options(EarlyExitConfig(first_block=1), cfg)


# ---- end to end ----

LLAMA = ["--model.family", "llama", "--model.n_kv_heads", "1"]
CASES = {
    "mod": (["--model.block", "mod", "--model.mod.capacity", "0.5"], "mod_rows"),
    "hashattn": (["--model.block", "hashattn"], "hashattn_blocks_computed"),
    "earlyexit": (["--early_exit.enabled", "true", "--early_exit.first_block", "1",
                   "--early_exit.threshold", "0.5"], "exit_active_tokens"),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_llama_variants_train_report_stats_and_survive_a_relayout(tmp_path, case):
    args, stat = CASES[case]
    steps = ["--steps", "5", "--parallel.layout", "uniform"]
    run_train(tmp_path / "fixed", *steps, *LLAMA, *args)
    run_train(tmp_path / "moved", *steps, *LLAMA, *args, "--parallel.relayout", "3:0,2,6")
    fixed, moved = metrics(tmp_path / "fixed"), metrics(tmp_path / "moved")
    assert [r["loss"] for r in moved] == [r["loss"] for r in fixed]  # bitwise
    assert [r["layout"] for r in moved] == [[0, 3, 6]] * 3 + [[0, 2, 6]] * 2
    for recs in (fixed, moved):
        for r in recs:
            row = r[stat]
            assert row[0] is None and row[-1] is None and all(v > 0 for v in row[1:-1]), (case, r["step"])
    assert [r[stat] for r in moved] == [r[stat] for r in fixed]
    if case == "mod":  # capacity 1/2 of 32 tokens, 8 sequences per step
        assert all(r["mod_rows"][1:-1] == [8 * 16] * 4 for r in moved)
    if case == "earlyexit":  # tokens leave after block 1 on: the later blocks compute fewer
        a = moved[-1]["exit_active_tokens"][1:-1]
        assert a[0] == a[1] == 8 * 32 and a[1] > a[2] > a[3]
