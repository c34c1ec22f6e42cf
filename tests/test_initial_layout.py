from dynmo.balance import Problem, balance
from dynmo.layout import Layout
from dynmo.model.layers import layer_param_counts
from dynmo.plan import initial_layout
from tests.reference import tiny_config


def test_uniform_params_and_explicit_initial_layouts():
    cfg = tiny_config("--model.n_layers", "10", "--model.vocab_size", "4096", "--parallel.layout", "uniform")
    assert initial_layout(cfg, 3) == Layout.uniform(12, 3)
    # the default: the FLOP model's layout (tests/test_flops.py)
    flops = initial_layout(tiny_config("--model.n_layers", "10", "--model.vocab_size", "4096"), 3)
    assert flops == initial_layout(tiny_config("--model.n_layers", "10", "--model.vocab_size", "4096",
                                               "--parallel.layout", "flops"), 3)
    counts = layer_param_counts(cfg.model)
    assert initial_layout(cfg, 3, counts) == Layout.uniform(12, 3)
    assert counts[0] > counts[1] and counts[-1] > counts[1]  # big embedding and head
    lay = initial_layout(tiny_config("--model.n_layers", "10", "--model.vocab_size", "4096", "--parallel.layout", "params"), 3, counts)
    expected = balance(Problem(costs=counts, stages=3), "deepspeed")
    assert list(lay.boundaries) == list(expected.boundaries)
    assert lay != Layout.uniform(12, 3)  # the heavy E and L get fewer blocks
    assert initial_layout(tiny_config("--model.n_layers", "10", "--parallel.layout", "2+5+5"), 3).boundaries == (0, 2, 7, 12)
