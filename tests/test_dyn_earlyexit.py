"""Early exit: active tokens get exactly the dense block's output (exited ones serve as keys and
values), exited tokens pass bit for bit, compute falls with the active fraction (counted
FLOPs), the classifier learns through the aux loss, and end to end through the real launcher
later blocks process fewer tokens (also after a migration)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dynmo.config import ConfigError, EarlyExitConfig, ModelConfig, load_config
from dynmo.dynamics.earlyexit import check_options, install_gate
from dynmo.model.layers import LayerSpec, build_layer
from tests.conftest import metrics, run_train

B, T, D = 3, 16, 32


def block(seed=1):
    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2)
    return build_layer(LayerSpec("t", 1), cfg, seed=seed)


def test_active_tokens_get_the_dense_output_and_exited_tokens_pass_bitwise():
    torch.manual_seed(0)
    b, x = block(), torch.randn(B, T, D)
    mask = torch.rand(B, T) > 0.4
    mask[2] = False  # a sequence with no active token
    dense = b(x, mask)[0]
    b.skip_inactive = True
    out = b(x, mask)[0]
    assert torch.equal(out[~mask], x[~mask])
    torch.testing.assert_close(out[mask], dense[mask], rtol=1e-5, atol=1e-6)


def test_gated_block_is_the_dense_block_while_all_tokens_are_active_and_exits_confident_tokens():
    torch.manual_seed(1)
    b, x = block(), torch.randn(B, T, D)
    full = torch.ones(B, T, dtype=torch.bool)
    g = install_gate(b, EarlyExitConfig(threshold=0.5), can_exit=False)
    out, m = b(x, full)
    assert torch.equal(out, b.dense_forward(x, full)[0]) and m.all()
    g.remove()
    b.exit_head = torch.nn.Linear(D, 1)
    with torch.no_grad():
        b.exit_head.weight.zero_()
        b.exit_head.bias.fill_(10.0)  # every token is confident
    r = install_gate(b, EarlyExitConfig(threshold=0.5, aux_loss_coef=1.0), can_exit=True)
    _, m = b(x, full)
    assert m.all()  # not exiting yet (before start_step), but the classifier trains:
    r.exiting = True
    xg = x.clone().requires_grad_(True)
    out, m = b(xg, full)
    assert not m.any()
    out.sum().backward()
    assert b.exit_head.bias.grad is not None and b.exit_head.bias.grad.abs() > 0
    assert r.summary()["tokens"] == B * T and r.summary()["rate"] == 0.5  # two forwards, one exiting


def test_compute_falls_with_the_active_fraction():
    b, x = block(), torch.randn(B, T, D)
    install_gate(b, EarlyExitConfig(), can_exit=False)
    flops = []
    for frac in (1.0, 0.5, 0.25):
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[:, : int(frac * T)] = True
        with FlopCounterMode(display=False) as fc:
            b(x.clone().requires_grad_(True), mask)[0].sum().backward()
        flops.append(fc.get_total_flops())
    assert flops[0] > flops[1] > flops[2]
    assert flops[2] < 0.5 * flops[0]  # only K/V projections stay per token


def test_options_are_validated():
    cfg = load_config(None, ["--model.n_layers", "4"])
    with pytest.raises(ConfigError, match="first_block"):
        check_options(EarlyExitConfig(first_block=4), cfg)
    cfg.model.block = "mod"
    with pytest.raises(ConfigError, match="dense"):
        check_options(EarlyExitConfig(first_block=1), cfg)


@pytest.mark.dist
def test_later_blocks_process_fewer_tokens_end_to_end_and_after_migration(tmp_path):
    # classifiers start near confidence 0.5: with threshold 0.5 about half the active tokens
    # leave after each block from block 1 on; step 4 moves blocks 1 and 2 to the other rank
    run_train(tmp_path, "--steps", "6", "--early_exit.enabled", "true", "--early_exit.first_block", "1",
              "--early_exit.threshold", "0.5", "--early_exit.start_step", "2", "--parallel.relayout", "4:0,1,6")
    recs = metrics(tmp_path)
    tokens = 8 * 32  # global batch x sequence length per step
    for r in recs:
        active = r["exit_active_tokens"]
        assert active[0] is None and active[-1] is None
        if r["step"] < 2:  # no exits yet: every block computes every token
            assert active[1:-1] == [tokens] * 4 and r["exit_tokens"][2:-1] == [0, 0, 0]
            continue
        a = active[1:-1]
        assert a[0] == a[1] == tokens and a[1] > a[2] > a[3] > 0  # block 0 cannot exit
        exited = r["exit_tokens"]
        assert exited[1] is None and [a[k] - exited[k + 1] for k in (1, 2)] == [a[2], a[3]]
        rows = r["exit_rows"][1:-1]
        assert rows[3] < rows[1]  # padded rows computed also fall
    assert recs[-1]["layout"] == [0, 1, 6]
    assert [e["type"] for e in recs[2]["events"]] == ["dynamism"]


def test_resume_restores_the_exit_classifiers(tmp_path):
    args = ["--early_exit.enabled", "true", "--early_exit.first_block", "1", "--early_exit.threshold", "0.5",
            "--early_exit.start_step", "2"]
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(a, "--steps", "6", *args, "--checkpoint.every", "4")
    run_train(b, "--steps", "6", *args, "--checkpoint.resume", str(a / "checkpoint-4"))
    full, resumed = metrics(a), metrics(b)
    assert [r["step"] for r in resumed] == [4, 5]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full[4:]], rel=1e-6)
    assert [r["exit_active_tokens"] for r in resumed] == [r["exit_active_tokens"] for r in full[4:]]


class _DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a device value back to the host (on a GPU, a synchronisation)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_gated_block_reads_the_device_once_a_forward_and_its_stats_are_the_counts(family):
    """Forward and backward of an exiting block over two microbatches: one host read a forward
    (how many rows to gather: the data's), none in the gate or the backward; the sums, read once
    after, are the brute-force counts."""
    torch.manual_seed(3)
    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2, family=family)
    b = build_layer(LayerSpec("t", 1), cfg, seed=1)
    b.exit_head = torch.nn.Linear(D, 1)
    g = install_gate(b, EarlyExitConfig(threshold=0.5, aux_loss_coef=1.0), can_exit=True)
    g.exiting = True
    masks = [torch.rand(B, T) > 0.3 for _ in range(2)]
    masks[1][0] = False  # a sequence with no active token
    afters = []
    with _DeviceReads() as spy:
        for mask in masks:
            x = torch.randn(B, T, D, requires_grad=True)
            out, after = b(x, mask)
            out.square().sum().backward()
            afters.append(after)
    assert len(spy.reads) == len(masks), spy.reads
    want = {"active_tokens": 0, "rows": 0, "tokens": 0}
    for mask, after in zip(masks, afters):
        assert not (after & ~mask).any()  # a token never comes back
        want["active_tokens"] += int(mask.sum())
        want["rows"] += B * int(mask.sum(1).max())
        want["tokens"] += int((mask & ~after).sum())
    s = g.summary()
    assert {k: s[k] for k in want} == want
    assert s["rate"] == pytest.approx(want["tokens"] / want["active_tokens"])
