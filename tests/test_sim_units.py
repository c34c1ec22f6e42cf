"""Sublayer traces: each block's attention half (a) and MLP half (m) as two units, merged into
whole blocks (`merge_units`), scaled (`scale_trace`), checked, and replayed by the benchmark."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynmo.balance import Problem, balance
from dynmo.sim.trace import (
    SUBLAYER, Trace, TraceError, TraceHeader, TraceStep, TraceWriter, block_map, load_trace, merge_units, scale_trace,
    unit_of,
)
from dynmo.sim.trace.kinds import unit_kinds, unit_names
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
TRACES = sorted((ROOT / "docs" / "bench" / "traces").rglob("*.jsonl"))


def config(blocks: int, unit: str = SUBLAYER) -> dict:
    return {"model": {"n_layers": blocks, "d_model": 32, "seq_len": 16, "vocab_size": 64},
            "train": {"global_batch": 4, "microbatches": 2}, "parallel": {"schedule": "1f1b", "unit": unit}}


def sublayer_trace(rng, blocks: int, steps: int, *, wgrad: bool = True, extras: bool = True) -> Trace:
    """A random trace of E, a m per block, L (with every optional per-unit field when `extras`)."""
    n = 2 * blocks + 2
    params = rng.integers(0, 10_000, n).tolist()
    header = TraceHeader.from_config(config(blocks), params, 2, 1)
    out = []
    for k in range(steps):
        f, b = rng.uniform(0.0, 1.0, n).tolist(), rng.uniform(0.0, 2.0, n).tolist()
        out.append(TraceStep(
            k, f, b, layout=[0, int(rng.integers(1, n)), n], wgrad=[x / 3 for x in b] if wgrad else None,
            events=[{"type": "dynamism"}] if k % 3 == 1 else [],
            cost=[0.9 * (x + y) for x, y in zip(f, b)] if extras else None,
            state_bytes=rng.uniform(0, 1e6, n).tolist() if extras else None,
            stats={"moe_tokens_per_expert": [None] + [None, [1.0, 2.0]] * blocks + [None]} if extras else {}))
    return Trace(header, out)


def halves_summed(v: list) -> list:
    return [v[0]] + [v[i] + v[i + 1] for i in range(1, len(v) - 1, 2)] + [v[-1]]


def test_a_sublayer_header_from_the_config_and_back_from_the_file(tmp_path):
    rng = np.random.default_rng(0)
    t = sublayer_trace(rng, 3, 4)
    h = t.header
    assert h.kinds == ["E", "a", "m", "a", "m", "a", "m", "L"]
    assert h.layers == ["embed", "block0_attn", "block0_mlp", "block1_attn", "block1_mlp", "block2_attn",
                        "block2_mlp", "head"]
    assert unit_of(h.kinds) == SUBLAYER and unit_of(["E", "t", "L"]) == "block" and unit_of(["E", "L"]) is None
    t.write(tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == t
    with pytest.raises(TraceError, match=r"^5 parameter counts for 8 units \(E, 3 blocks as attention and MLP halves"):
        TraceHeader.from_config(config(3), [1] * 5, 2, 1)
    with pytest.raises(TraceError, match="parallel.unit must be one of block, sublayer, got 'half'"):
        TraceHeader.from_config(config(3, "half"), [1] * 5, 2, 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.integers(1, 5), st.booleans(), st.booleans(), st.integers(0, 2**31))
def test_merge_units_sums_each_blocks_halves(blocks, steps, wgrad, extras, seed):
    t = sublayer_trace(np.random.default_rng(seed), blocks, steps, wgrad=wgrad, extras=extras)
    m = merge_units(t)
    h = m.header
    assert h.kinds == unit_kinds(blocks) and h.layers == unit_names(blocks) == ["embed", *(f"block{i}" for i in range(blocks)), "head"]
    assert h.params == halves_summed(t.header.params) and h.layer_bytes == halves_summed(t.header.layer_bytes)
    assert h.source == "merged" and h.config["merged"] == {"from_units": 2 * blocks + 2, "blocks": blocks}
    h.check()
    assert m.dynamism_steps() == t.dynamism_steps() and len(m.steps) == steps
    for s, ms in zip(t.steps, m.steps):
        for name in ("fwd", "bwd", "wgrad", "cost", "state_bytes"):
            v = getattr(s, name)
            assert getattr(ms, name) == (None if v is None else halves_summed(v))
        assert ms.events == s.events and ms.step == s.step
    np.testing.assert_allclose(m.costs().sum(1), t.costs().sum(1), rtol=1e-12)
    np.testing.assert_allclose(m.costs()[:, 1:-1], t.costs()[:, 1:-1:2] + t.costs()[:, 2:-1:2], rtol=1e-12)
    assert merge_units(m) is m  # whole blocks are whole already


def test_merge_units_keeps_layouts_between_blocks_and_merges_stats():
    t = sublayer_trace(np.random.default_rng(1), 3, 3)
    steps = [replace(t.steps[0], layout=[0, 3, 7, 8]), replace(t.steps[1], layout=[0, 2, 8]),
             replace(t.steps[2], stats={"prune_density": [None, 1.0, 0.5, 0.2, 0.2, None, None, None],
                                        "freeze_frozen": [None, True, False, True, True, False, False, None]})]
    m = merge_units(Trace(replace(t.header, params=[5, 1, 3, 2, 2, 4, 4, 5]), steps))
    assert m.steps[0].layout == [0, 2, 4, 5]  # a stage boundary at block1's attention half is block1's start
    assert m.steps[1].layout is None  # block0 split between two stages: no block layout has that
    assert m.steps[0].stats["moe_tokens_per_expert"] == [None, [1.0, 2.0], [1.0, 2.0], [1.0, 2.0], None]
    assert m.steps[2].stats["prune_density"] == [None, (1.0 * 1 + 0.5 * 3) / 4, 0.2, None, None]
    assert m.steps[2].stats["freeze_frozen"] == [None, [True, False], True, False, None]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.integers(1, 60), st.floats(0.0, 0.5), st.booleans(), st.integers(0, 2**31))
def test_scale_trace_keeps_the_halves(blocks, new_blocks, noise, wgrad, seed):
    """Attention halves and MLP halves scale as two series of whole blocks: each keeps its mean per
    step (so does their sum, the block total), E and L keep theirs, and params follow the block map."""
    t = sublayer_trace(np.random.default_rng(seed), blocks, 4, wgrad=wgrad)
    s = scale_trace(t, new_blocks, noise=noise, seed=seed, cost_scale=2.0)
    assert s.header.kinds == unit_kinds(new_blocks, SUBLAYER) and s.header.layers == unit_names(new_blocks, SUBLAYER)
    assert s.header.kinds[1:3] == ["a", "m"] and s.header.layers[-2] == f"block{new_blocks - 1}_mlp"
    s.header.check()
    assert s.dynamism_steps() == t.dynamism_steps() and all(x.layout is None for x in s.steps)
    ratio = 2.0 * new_blocks / blocks
    for a, b in ((t.fwd(), s.fwd()), (t.bwd(), s.bwd()), (t.controller_costs(), s.controller_costs())):
        np.testing.assert_allclose(b[:, 1:-1:2].sum(1), ratio * a[:, 1:-1:2].sum(1), rtol=1e-12)  # attention
        np.testing.assert_allclose(b[:, 2:-1:2].sum(1), ratio * a[:, 2:-1:2].sum(1), rtol=1e-12)  # MLP
        np.testing.assert_allclose(b[:, 1:-1].sum(1), ratio * a[:, 1:-1].sum(1), rtol=1e-12)  # whole blocks
        np.testing.assert_allclose(b[:, [0, -1]], 2.0 * a[:, [0, -1]])
    src = 1 + 2 * block_map(blocks, new_blocks)
    assert s.header.params[1:-1:2] == [t.header.params[i] for i in src]
    assert s.header.params[2:-1:2] == [t.header.params[i + 1] for i in src]
    if wgrad:
        assert all(np.all(np.asarray(x.wgrad) <= np.asarray(x.bwd)) for x in s.steps)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.integers(1, 8), st.integers(0, 2**31))
def test_merging_and_scaling_commute_where_every_traced_block_is_used_equally(blocks, copies, seed):
    """merge_units(scale_trace(T, k)) == scale_trace(merge_units(T), k) per block when k is a
    multiple of the traced blocks (noise-free): then each series' rescaling is 1. For other k the
    halves are rescaled by their own factors, not the block's, and only the per-step totals (and
    the parameters) agree; both are checked."""
    t = sublayer_trace(np.random.default_rng(seed), blocks, 3)
    for k, per_block in ((blocks * copies, True), (max(1, blocks * copies - 1), False), (copies, False)):
        a, b = merge_units(scale_trace(t, k)), scale_trace(merge_units(t), k)
        assert a.header.kinds == b.header.kinds and a.header.layers == b.header.layers
        assert a.header.params == b.header.params and a.header.layer_bytes == b.header.layer_bytes
        for x, y in ((a.fwd(), b.fwd()), (a.bwd(), b.bwd()), (a.wgrad(), b.wgrad()),
                     (a.controller_costs(), b.controller_costs())):
            np.testing.assert_allclose(x.sum(1), y.sum(1), rtol=1e-12)
            if per_block or k % blocks == 0:
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=0)


def test_finer_units_never_balance_worse():
    """Every block layout is a sublayer layout, so the optimal min-max stage load of the halves is at
    most that of the merged blocks (what the benchmark's balance gap measures)."""
    rng = np.random.default_rng(2)
    for _ in range(20):
        t = sublayer_trace(rng, int(rng.integers(2, 9)), 1)
        stages = int(rng.integers(2, t.num_layers // 2 + 1))
        fine = balance(Problem(costs=t.costs()[0].tolist(), stages=stages), "optimal").bottleneck
        coarse = balance(Problem(costs=merge_units(t).costs()[0].tolist(), stages=stages), "optimal").bottleneck
        assert fine <= coarse * (1 + 1e-12)


def _scale_blocks_before(trace: Trace, blocks: int, cost_scale: float = 1.0, params_scale: float = 1.0,
                         noise: float = 0.0, seed: int = 0) -> Trace:
    """scale_trace as it was before sublayer units (its checks left out): the reference whole-block
    traces must still scale to, bit for bit."""
    h = trace.header
    block_idx = [i for i, k in enumerate(h.kinds) if k == "t"]
    b = len(block_idx)
    src = np.asarray(block_idx)[(np.arange(blocks) * b) // blocks]
    rng = np.random.default_rng(seed)
    steps = []
    for s in trace.steps:
        arrays = [None if v is None else np.asarray(v, dtype=float) for v in (s.fwd, s.bwd, s.wgrad, s.cost)]
        factor = np.ones(blocks)
        if noise > 0:
            factor = rng.lognormal(-0.5 * noise * noise, noise, size=blocks)
        new = []
        for a in arrays:
            if a is None:
                new.append(None)
                continue
            nb = a[src] * factor
            want = a[block_idx].sum() * blocks / b
            have = nb.sum()
            nb = nb * (want / have) if have > 0 else nb
            new.append(np.concatenate(([a[0]], nb, [a[-1]])) * cost_scale)
        if new[2] is not None:
            new[2] = np.minimum(new[2], new[1])
        sb = None
        if s.state_bytes is not None:
            sb = [s.state_bytes[0]] + [s.state_bytes[i] * params_scale for i in src] + [s.state_bytes[-1]]
        stats = {k: [v[0]] + [v[i] for i in src] + [v[-1]] for k, v in s.stats.items()}
        steps.append(replace(s, fwd=new[0].tolist(), bwd=new[1].tolist(),
                             wgrad=None if new[2] is None else new[2].tolist(), layout=None, stats=stats,
                             state_bytes=sb, cost=None if new[3] is None else new[3].tolist()))
    params = [h.params[0]] + [int(round(h.params[i] * params_scale)) for i in src] + [h.params[-1]]
    lbytes = [h.layer_bytes[0]] + [int(round(h.layer_bytes[i] * params_scale)) for i in src] + [h.layer_bytes[-1]]
    config = dict(h.config)
    config["scaled"] = {"from_blocks": b, "blocks": blocks, "cost_scale": cost_scale,
                        "params_scale": params_scale, "noise": noise, "seed": seed}
    header = replace(h, layers=["embed"] + [f"block{j}" for j in range(blocks)] + ["head"],
                     kinds=["E"] + ["t"] * blocks + ["L"], params=params, layer_bytes=lbytes,
                     config=config, source="scaled")
    return Trace(header, steps)


@pytest.mark.parametrize("path", [*TRACES, None], ids=[p.stem for p in TRACES] + ["random-6-blocks"])
def test_whole_block_traces_scale_exactly_as_before(path):
    """The committed traces (8 blocks; a sublayer one merged into blocks), and 6 random blocks, where
    new / traced blocks is not a power of 2."""
    t = merge_units(load_trace(path) if path else sublayer_trace(np.random.default_rng(6), 6, 3))
    assert unit_of(t.header.kinds) == "block" and merge_units(t) is t
    for blocks, kw in ((48, {}), (7, {}), (33, {"noise": 0.3, "seed": 7, "cost_scale": 1.7, "params_scale": 2.5})):
        assert scale_trace(t, blocks, **kw) == _scale_blocks_before(t, blocks, **kw)


BAD_KINDS = [
    (["E", "t", "a", "m", "L"], r"kinds mix whole blocks \(t\) with half blocks \(a, m\); a trace holds one kind of unit$"),
    (["E", "a", "L"], r"kinds\[1\] is an attention half \(a\) not followed by its MLP half \(m\)"),
    (["E", "a", "a", "m", "L"], r"kinds\[1\] is an attention half \(a\) not followed"),
    (["E", "m", "a", "L"], r"kinds\[1\] is an MLP half \(m\) without its attention half \(a\) before it"),
    (["E", "a", "m", "m", "L"], r"kinds\[3\] is an MLP half \(m\) without"),
    (["E", "a", "m", "a"], r"kinds\[3\] is an attention half \(a\) not followed"),
]


@pytest.mark.parametrize("kinds, message", BAD_KINDS)
def test_bad_kinds_say_what_is_wrong_in_one_line(tmp_path, kinds, message):
    t = sublayer_trace(np.random.default_rng(3), 1, 1, extras=False)
    n = len(kinds)
    header = replace(t.header, layers=[f"u{i}" for i in range(n)], kinds=kinds, params=[1] * n, layer_bytes=[16] * n)
    bad = Trace(header, [replace(t.steps[0], fwd=[0.1] * n, bwd=[0.2] * n, wgrad=None, layout=None)])
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(header.as_dict()) + "\n" + json.dumps(bad.steps[0].as_dict()) + "\n")
    for call in (lambda: load_trace(p), lambda: TraceWriter(tmp_path / "w.jsonl", header.as_dict()),
                 lambda: scale_trace(bad, 4), lambda: merge_units(bad)):
        with pytest.raises(TraceError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


def test_scaling_and_merging_need_the_embedding_blocks_and_head():
    t = sublayer_trace(np.random.default_rng(4), 2, 1, extras=False)
    for kinds in (["E", "L", "a", "m", "a", "m"], ["E", "a", "m", "x", "L"], ["E", "L"]):
        bad = Trace(replace(t.header, kinds=kinds), t.steps)
        with pytest.raises(TraceError, match=r"^scale_trace needs a trace of E, t\.\.\., L layers \(or E, a m\.\.\., L units\)$"):
            scale_trace(bad, 3)
        with pytest.raises(TraceError, match=r"^merge_units needs a trace of E, t\.\.\., L layers"):
            merge_units(bad)


def test_the_units_benchmark_replays_both_unit_kinds(tmp_path, capsys):
    bench = load_benchmark("replay_units")
    rng = np.random.default_rng(5)
    sublayer_trace(rng, 4, 6).write(tmp_path / "sub.jsonl")
    args = [str(tmp_path / "sub.jsonl"), "--blocks", "6", "--stages", "4", "--dp", "2", "--microbatches", "8"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "python benchmarks/replay_units.py " + " ".join(args)
    rows = [line.split(" | ") for line in out if line.startswith("| sub |")]
    assert [r[1] for r in rows] == ["block", "sublayer"] and [r[2] for r in rows] == ["8", "14"]
    assert rows[0][-1] == "reference |" and len(rows[1][-1].split(", ")) == 3
    assert float(rows[1][5]) <= float(rows[0][5]) * (1 + 1e-9)  # finer units: never a larger balance gap
    assert bench.main([str(ROOT / "docs" / "bench" / "traces" / "dense-60.jsonl")]) == 2
    assert "is not a sublayer trace" in capsys.readouterr().err


def test_replay_units_needs_half_blocks_and_scales_both_kinds_alike():
    from dynmo.sim.replay import replay_units

    t = sublayer_trace(np.random.default_rng(6), 3, 4)
    with pytest.raises(TraceError, match="^replay_units needs a sublayer trace"):
        replay_units(merge_units(t), 6, 4, 2, 8)
    rows = replay_units(t, 6, 4, 2, 8)
    assert [rows[k]["layers"] for k in ("block", "sublayer")] == [8, 14]
    # the same scaled costs, merged: every block layout is also a sublayer layout
    assert rows["sublayer"]["gap"] <= rows["block"]["gap"] * (1 + 1e-12)
    assert rows["sublayer"]["vs_block"]["best_static_s"] == rows["sublayer"]["best_static_s"] / rows["block"]["best_static_s"]
    assert "vs_block" not in rows["block"]
