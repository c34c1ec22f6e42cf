"""`train.compile`: each placement unit compiled on its own (dynmo.runtime.compiled).

Every block kind of every family, whole and as halves, compiles with fullgraph=True (a graph
break raises) and gives eager's loss and gradients; a unit built later (one arriving by
migration) reuses the compiled code; inductor's code equals eager's to rounding; the real
launcher trains a compiled pipeline through a migration with eager's losses; settings that
cannot compile are refused before anything starts."""

import re

import pytest
import torch
from torch._dynamo.utils import counters

from dynmo.checks import check_compile
from dynmo.config import Config, ConfigError, HashAttnConfig, ModelConfig, MoDConfig, MoEConfig
from dynmo.model.gpt import loss_fn
from dynmo.model.layers import build_layer, layer_specs
from dynmo.runtime.compiled import compile_unit, eager, is_compiled
from dynmo.runtime.stage import StageModule
from tests.conftest import ROOT, metrics, run_train
from tests.reference import reference_run, tiny_config

KINDS = [("gpt", "dense"), ("gpt", "moe"), ("gpt", "mod"), ("gpt", "hashattn"),
         ("llama", "dense"), ("llama", "mod"), ("llama", "hashattn"), ("mixtral", "moe")]
# every kind whole; as halves, one of each family (the halves run the same code as the whole)
UNITS = [(f, b, "block") for f, b in KINDS] + [("gpt", "moe", "sublayer"), ("llama", "hashattn", "sublayer"),
                                                ("mixtral", "moe", "sublayer")]


def tiny(family: str, block: str, **kw) -> ModelConfig:
    args = dict(family=family, block=block, d_model=64, n_heads=4, seq_len=32, n_layers=2, vocab_size=128)
    if family != "gpt":
        args.update(n_kv_heads=2, intermediate_size=96)
    args.update(moe=MoEConfig(num_experts=4, top_k=2), mod=MoDConfig(capacity=0.5),
                hashattn=HashAttnConfig(n_buckets=4, chunk=8))
    return ModelConfig(**{**args, **kw})


def stage(cfg: ModelConfig, unit: str, dtype: torch.dtype, seed: int = 0) -> tuple[StageModule, list]:
    specs = layer_specs(cfg, unit)
    layers = [build_layer(s, cfg, seed) for s in specs]
    return StageModule([s.name for s in specs], layers, list(range(len(specs))), dtype=dtype), layers


def loss_and_grads(module: StageModule, tokens: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss = loss_fn(module(tokens), tokens)
    loss.backward()
    return [loss.detach()] + [p.grad.float() for p in module.parameters() if p.grad is not None]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family,block,unit", UNITS)
def test_every_unit_compiles_whole_and_equals_eager(family, block, unit):
    """fullgraph=True: any graph break would raise. MoE in bf16 (torch compiles its grouped
    matmul in bf16 only); the others in fp32, where the eager backend's graph is eager's ops."""
    dtype = torch.bfloat16 if block == "moe" else torch.float32
    cfg = tiny(family, block)
    ref, _ = stage(cfg, unit, dtype)
    got, layers = stage(cfg, unit, dtype)
    for layer in layers:
        compile_unit(layer, dtype, backend="eager")
        assert is_compiled(layer)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second call runs the cached graphs
        a, b = loss_and_grads(ref, tokens), loss_and_grads(got, tokens)
    assert len(a) == len(b) == 1 + sum(1 for _ in ref.parameters())
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile


@pytest.mark.parametrize("family,block", [("gpt", "mod"), ("llama", "mod"), ("gpt", "moe"), ("gpt", "hashattn")])
def test_checkpointed_compiled_units_equal_eager_and_count_one_forward(family, block):
    """A checkpointed unit recomputes its compiled forward with the step statistics paused; the
    pause must not reach into the graph (a compiled guard on it made the recomputation run
    another graph, which saved other tensors than the forward: backward failed for Mixture of
    Depths). aot_eager: the saved tensors are the compiled graph's, as inductor's."""
    dtype = torch.bfloat16 if block == "moe" else torch.float32
    cfg = tiny(family, block)
    ref, _ = stage(cfg, "block", dtype)
    specs = layer_specs(cfg, "block")
    layers = [build_layer(s, cfg, 0) for s in specs]
    blocks = frozenset(range(1, len(specs) - 1))
    got = StageModule([s.name for s in specs], layers, list(range(len(specs))), dtype=dtype, recompute=blocks)
    for layer in layers:
        compile_unit(layer, dtype, backend="aot_eager")
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for layer in layers:
            getattr(layer, "reset_stats", lambda: None)()
        a, b = loss_and_grads(ref, tokens), loss_and_grads(got, tokens)
        assert all(layers[i]._stats.forwards == 1 for i in blocks)  # the recomputation counts none
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_a_split_backward_schedule_runs_compiled_units_with_a_retained_graph(monkeypatch):
    """The zero-bubble schedules run a unit's backward in two passes, the first with
    retain_graph=True; a compiled backward that donates its saved buffers refuses that, so
    compiling for such a schedule turns donation off (hash attention's block donated one)."""
    monkeypatch.setattr(torch._functorch.config, "donated_buffer", True)  # restored after the test
    cfg = tiny("gpt", "hashattn")
    specs = layer_specs(cfg, "block")
    layers = [build_layer(s, cfg, 0) for s in specs]
    for layer in layers:
        compile_unit(layer, torch.float32, backend="aot_eager", split_backward=True)
    module = StageModule([s.name for s in specs], layers, list(range(len(specs))), dtype=torch.float32)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = loss_fn(module(tokens), tokens)
    params = [p for p in module.parameters()]
    torch.autograd.grad(loss, params[:1], retain_graph=True)  # the input-gradient pass, then the rest
    torch.autograd.grad(loss, params[1:], allow_unused=True)
    assert torch._functorch.config.donated_buffer is False


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_mixture_of_depths_blocks_of_one_capacity_share_their_graphs(family):
    """Per-block capacities are read once before compiling: four blocks of two capacities
    compile two graphs, not one per block (a guard on each block's index ran past the compile
    cache's limit with half blocks and validation), and give eager's outputs."""
    caps = [1.0, 0.5, 1.0, 0.5]
    cfg = tiny(family, "mod", n_layers=4, mod=MoDConfig(capacities=caps))
    specs = [s for s in layer_specs(cfg, "block") if s.index >= 1 and s.index <= 4]
    blocks = [build_layer(s, cfg, 0) for s in specs]
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 32, dtype=torch.bool)
    with torch.no_grad():
        want = [b(x, mask)[0] for b in blocks]
        for b in blocks:
            compile_unit(b, torch.float32, backend="eager")
        got = [b(x, mask)[0] for b in blocks]
    assert [b.capacity for b in blocks] == caps
    assert counters["stats"]["unique_graphs"] == 2
    for a, c in zip(want, got):
        torch.testing.assert_close(a, c, atol=0, rtol=0)


def test_a_unit_built_later_reuses_the_compiled_code():
    """Blocks of one class with the same settings share one graph, and a block built afterwards
    (what a migration hands a rank) runs without compiling again; the state dict is unchanged."""
    cfg = tiny("gpt", "mod", n_layers=4)
    module, layers = stage(cfg, "block", torch.float32)
    keys = list(module.state_dict())
    for layer in layers:
        compile_unit(layer, torch.float32, backend="eager")
    tokens = torch.randint(0, 128, (2, 32))
    loss_and_grads(module, tokens)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 3  # embedding, block, head: not one per block
    arrived = compile_unit(build_layer(layer_specs(cfg)[2], cfg, seed=7), torch.float32, backend="eager")
    x = torch.randn(2, 32, 64, requires_grad=True)
    arrived(x, torch.ones(2, 32, dtype=torch.bool))[0].sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
    assert list(module.state_dict()) == keys
    assert not is_compiled(eager(arrived))


def test_inductor_equals_eager_to_rounding():
    """The real compiler (inductor's C++ on CPU) on a whole tiny model, fp32."""
    cfg = tiny("llama", "dense")
    ref, _ = stage(cfg, "block", torch.float32)
    got, layers = stage(cfg, "block", torch.float32)
    for layer in layers:
        compile_unit(layer, torch.float32)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    for x, y in zip(loss_and_grads(ref, tokens), loss_and_grads(got, tokens)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("setting,message", [
    ({"train": {"compile_backend": "tvm"}}, "train.compile_backend='tvm': choose one of inductor, aot_eager, eager"),
    ({"model": {"block": "moe", "moe": {"dispatch": "padded"}}}, "needs model.moe.dispatch = \"grouped\""),
    ({"model": {"block": "moe"}}, "needs train.dtype = \"bf16\""),
])
def test_settings_that_cannot_compile_are_refused(setting, message):
    from dynmo.config import apply_dict

    cfg = Config()
    apply_dict(cfg, {"train": {"compile": True}})
    apply_dict(cfg, setting)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_compile(cfg)
    apply_dict(cfg, {"train": {"compile": False, "compile_backend": "inductor"}})
    check_compile(cfg)  # without train.compile the block settings are fine


@pytest.mark.parametrize("setting,message", [
    ({"train": {"compile": False}}, "set train.compile = true too"),
    ({"train": {"compile_backend": "aot_eager"}}, "only Inductor records CUDA graphs"),
    ({"parallel": {"schedule": "zbv"}}, "runs each backward in two passes"),
    ({"train": {"activation_checkpointing": "all"}}, "set train.activation_checkpointing = \"none\""),
    ({"early_exit": {"enabled": True}}, "leave early_exit off"),
    ({"model": {"block": "mod", "mod": {"routing": "predictor"}}}, "use model.mod.routing = \"topk\""),
    ({"parallel": {"ep": 2}}, "leave parallel.ep at 1"),
    ({"parallel": {"backend": "gloo"}}, "this run has no GPU"),
])
def test_cuda_graphs_are_refused_where_a_recorded_graph_cannot_replay(setting, message):
    """`train.cuda_graphs` names the setting that keeps a unit from replaying as a CUDA graph."""
    from dynmo.config import apply_dict

    cfg = Config()
    apply_dict(cfg, {"train": {"compile": True, "cuda_graphs": True}})
    apply_dict(cfg, setting)
    with pytest.raises(ConfigError, match="train.cuda_graphs: .*" + re.escape(message)):
        check_compile(cfg)


def test_cuda_graphs_without_a_gpu_is_one_line_before_launch(tmp_path, monkeypatch):
    """On a machine without CUDA the option is refused by the launcher: one line, exit 2."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.chdir(ROOT)
    import contextlib
    import io

    from dynmo import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["train", "--config", "configs/default.toml", "--out", str(tmp_path / "run"),
                         "--train.compile", "true", "--train.cuda_graphs", "true"])
    assert code == 2, err.getvalue()
    (line,) = err.getvalue().strip().splitlines()
    assert "train.cuda_graphs: CUDA graphs record GPU kernel launches and this run has no GPU" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_launcher_trains_compiled_through_a_migration(tmp_path):
    """Two ranks, Mixture of Depths, a forced migration at step 3 (a block arrives compiled on
    the other rank): the losses equal the single-process eager reference's, every layer is still
    timed, and the final checkpoint is written."""
    args = ["--steps", "5", "--model.block", "mod"]
    run_train(tmp_path, *args, "--parallel.relayout", "3:0,4,6", "--train.compile", "true",
              "--train.compile_backend", "aot_eager", "--checkpoint.final", "true")
    ref_losses, _ = reference_run(tiny_config("--train.steps", "5", "--model.block", "mod"), 5)
    got = metrics(tmp_path)
    assert got[-1]["layout"] != got[0]["layout"]
    assert [m["loss"] for m in got] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for m in got:
        assert len(m["layer_fwd_s"]) == 6 and all(t > 0 for t in m["layer_fwd_s"])
    assert (tmp_path / "checkpoint-final").is_dir()


def test_hash_attention_on_cpu_compiles_with_the_tile_kernel():
    """At 512 tokens eager CPU runs the staircase, which plans on the host; compiled, `auto` is
    the tile kernel: one graph, the same attention to rounding."""
    cfg = tiny("gpt", "hashattn", seq_len=512, hashattn=HashAttnConfig(n_buckets=4, chunk=64))
    ref, _ = stage(cfg, "block", torch.float32)
    got, layers = stage(cfg, "block", torch.float32)
    for layer in layers:
        compile_unit(layer, torch.float32, backend="eager")
    tokens = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(3))
    for x, y in zip(loss_and_grads(ref, tokens), loss_and_grads(got, tokens)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family,unit", [("gpt", "block"), ("llama", "block"), ("gpt", "sublayer")])
def test_early_exit_blocks_compile_whole_and_equal_eager(family, unit):
    """Blocks that compute their active tokens only (early exit's gate on, tokens exiting): the
    rows to gather are read before the compiled forward, so fullgraph holds; one graph per
    distinct width (rounded to seq_len / WIDTH_BUCKETS), the same loss and gradients as eager."""
    from dynmo.config import EarlyExitConfig
    from dynmo.dynamics.earlyexit import install_gate
    from dynmo.model.gpt import SkipsInactive

    WIDTH_BUCKETS = SkipsInactive.WIDTH_BUCKETS

    cfg = tiny(family, "dense")
    opts = EarlyExitConfig(threshold=0.5, aux_loss_coef=0.1)
    mods = []
    for compiled in (False, True):
        module, layers = stage(cfg, unit, torch.float32)
        for layer in layers:
            if hasattr(layer, "width_buckets"):
                can_exit = getattr(layer, "part", None) != "attn"
                if can_exit:
                    layer.exit_head = torch.nn.Linear(64, 1)
                    torch.nn.init.normal_(layer.exit_head.weight, 0.0, 1.0, generator=torch.Generator().manual_seed(4))
                    torch.nn.init.zeros_(layer.exit_head.bias)
                install_gate(layer, opts, can_exit).exiting = True
            if compiled:
                compile_unit(layer, torch.float32, backend="eager")
        mods.append(module)
    widths = []
    for layer in (m for m in mods[1].modules() if hasattr(m, "width_buckets")):
        layer.register_forward_hook(lambda m, args, out: widths.append(m.active_width))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # token sets that differ: several widths
        tokens = torch.randint(0, 128, (2, 32), generator=gen)
        a, b = loss_and_grads(mods[0], tokens), loss_and_grads(mods[1], tokens)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    assert any(w is not None and 0 < w < 32 for w in widths)  # tokens had exited: rows skipped
    assert counters["stats"]["unique_graphs"] <= 2 + 3 * 2 * (WIDTH_BUCKETS + 1)
