"""The nominal FLOP model (dynmo.flops) against the models' own parameter counts, and the
`flops` layout."""

import pytest

from dynmo.balance import Problem, balance
from dynmo.config import Config, apply_dict
from dynmo.flops import block_halves_macs, forward_flops_per_token, unit_macs
from dynmo.layout import Layout
from dynmo.model.layers import layer_param_counts
from dynmo.plan import initial_layout, layer_flops, num_layers
from tests.reference import tiny_config


def _config(model: dict) -> Config:
    cfg = Config()
    apply_dict(cfg, {"model": model})
    return cfg


LLAMA = {"family": "llama", "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 3, "seq_len": 16,
         "vocab_size": 100, "intermediate_size": 96}


def _attention(m) -> float:
    return 2 * m.n_heads * (m.d_model // m.n_heads) * (m.seq_len + 1) / 2


def test_llama_counts_are_the_matmul_parameters_plus_causal_attention():
    """Without biases a token's multiply-adds in the projections, the MLP and the head are the
    parameters of those matrices; each block's attention adds scores and weighted sum over
    (T + 1) / 2 keys."""
    m = _config(LLAMA).model
    counts = layer_param_counts(m)  # E, blocks, L (each block has 2 RMSNorm weights, the head 1)
    macs = unit_macs(m)
    assert macs[0] == 0
    for c, u in zip(counts[1:-1], macs[1:-1]):
        assert u == pytest.approx(c - 2 * m.d_model + _attention(m))
    assert macs[-1] == counts[-1] - m.d_model
    assert forward_flops_per_token(m) == pytest.approx(2 * sum(macs))


def test_moe_counts_top_k_experts_and_the_router_not_every_expert():
    m = _config({**LLAMA, "family": "mixtral", "block": "moe", "moe": {"num_experts": 8, "top_k": 2}}).model
    dense = _config(LLAMA).model
    attn_d, mlp_d = block_halves_macs(dense, 0)
    attn, mlp = block_halves_macs(m, 0)
    assert attn == attn_d
    assert mlp == pytest.approx(2 * mlp_d + m.d_model * 8)
    # the parameters hold all 8 experts: a params layout would weigh the blocks 4x more than their work
    assert layer_param_counts(m)[1] > 3 * layer_param_counts(dense)[1]


def test_mixture_of_depths_counts_its_capacity_and_routing():
    gpt = {"d_model": 64, "n_heads": 4, "n_layers": 4, "seq_len": 64, "vocab_size": 100, "block": "mod",
           "mod": {"capacities": [1.0, 1.0, 0.125, 0.125]}}
    m = _config(gpt).model
    full, low = sum(block_halves_macs(m, 0)), sum(block_halves_macs(m, 2))
    k = 8  # 12.5 % of 64 tokens, attending among themselves
    dense = _config({**gpt, "block": "dense"}).model
    a_k = block_halves_macs(dense, 0)[0] - _attention(dense) + 2 * 4 * 16 * (k + 1) / 2
    # routing: router and predictor on every token, the router again on the k chosen; at
    # capacity 1.0 the router alone
    assert low == pytest.approx(k / 64 * (a_k + block_halves_macs(dense, 0)[1]) + (2 + k / 64) * m.d_model)
    assert full == pytest.approx(sum(block_halves_macs(dense, 0)) + m.d_model)
    assert low < full / 7


@pytest.mark.parametrize("model", [LLAMA, {**LLAMA, "family": "gpt", "block": "mod"},
                                   {**LLAMA, "family": "mixtral", "block": "moe"}])
def test_sublayer_units_split_each_block(model):
    m = _config(model).model
    whole, halves = unit_macs(m), unit_macs(m, sublayer=True)
    assert len(halves) == 2 * m.n_layers + 2
    assert halves[0] == whole[0] and halves[-1] == whole[-1]
    for b in range(m.n_layers):
        assert halves[1 + 2 * b] + halves[2 + 2 * b] == pytest.approx(whole[1 + b])


def test_flops_layout_is_the_optimal_partition_of_the_flop_model():
    for unit in ("block", "sublayer"):
        cfg = tiny_config("--model.n_layers", "10", "--model.vocab_size", "4096", "--model.block", "moe",
                          "--parallel.layout", "flops", "--parallel.unit", unit)
        flops = layer_flops(cfg)
        assert len(flops) == num_layers(cfg)
        lay = initial_layout(cfg, 3, layer_param_counts(cfg.model))
        assert list(lay.boundaries) == list(balance(Problem(costs=flops, stages=3), "optimal").boundaries)
    # the head's projection weighs as much as its FLOPs, the embedding's lookup nothing
    cfg = tiny_config("--model.n_layers", "10", "--model.vocab_size", "4096", "--parallel.layout", "flops")
    lay = initial_layout(cfg, 3)
    assert lay != Layout.uniform(12, 3) and lay.boundaries[1] > 12 // 3
