"""Per-layer cost traces: format round trip, conversion of a real run, scaling to paper depth."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynmo.record import StepRecord
from dynmo.sim.trace import (
    BYTES_PER_PARAM, Trace, TraceError, TraceHeader, TraceStep, TraceWriter, block_map, load_trace,
    scale_trace, trace_from_metrics,
)
from dynmo.sim.trace.relevel import relevel
from tests.conftest import metrics, param_counts, run_train

CFG = {
    "model": {"n_layers": 3, "d_model": 64, "seq_len": 32, "vocab_size": 512, "block": "moe",
              "moe": {"num_experts": 4, "top_k": 2}},
    "train": {"global_batch": 8, "microbatches": 4, "steps": 3},
    "parallel": {"schedule": "1f1b", "virtual_stages": 1},
    "skew": {"factor": 1},
}


def _record(step: int, n: int, rng) -> dict:
    """A metrics.jsonl line as the runtime writes it (the fields the trace keeps and some it drops)."""
    return {
        "step": step, "loss": 5.0, "tokens_per_s": 1e3, "step_s": 0.2, "iteration_s": 0.15,
        "layout": [0, 2, n], "layout_str": "E t | t t L", "stage_compute_s": [0.1, 0.1],
        "layer_fwd_s": rng.uniform(0.001, 0.01, n).tolist(), "layer_bwd_s": rng.uniform(0.002, 0.02, n).tolist(),
        "bubble_ratio": 0.1, "imbalance": 0.0, "grad_norm": 1.0, "lr": 1e-3,
        "events": [{"type": "dynamism", "case": "moe"}] if step == 1 else [],
        "moe_tokens_per_expert": [None] + [[1.0, 2.0, 3.0, 2.0]] * (n - 2) + [None],
        "layer_cost_s": rng.uniform(0.003, 0.03, n).tolist(), "microbatches": 4,
        "layer_state_bytes": [16.0 * 1000] * n, "profile_s": 0.001,
    }


def test_writer_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    params = param_counts(CFG["model"])
    header = TraceHeader.from_config(CFG, params, pp=2, dp=1)
    assert header.kinds == ["E", "t", "t", "t", "L"] and header.case == "moe"
    assert header.layer_bytes == [BYTES_PER_PARAM * p for p in params]
    assert header.tokens_per_microbatch == 2 * 32
    recs = [_record(k, 5, rng) for k in range(3)]
    with TraceWriter(tmp_path / "t.jsonl", header) as w:
        for r in recs:
            w.write_step(StepRecord.from_json(r))
    t = load_trace(tmp_path / "t.jsonl")
    assert t.header == header
    assert len(t.steps) == 3 and t.dynamism_steps() == [1]
    assert np.array_equal(t.fwd(), [r["layer_fwd_s"] for r in recs])
    assert np.array_equal(t.costs(), np.add([r["layer_fwd_s"] for r in recs], [r["layer_bwd_s"] for r in recs]))
    assert t.steps[0].stats["moe_tokens_per_expert"][1] == [1.0, 2.0, 3.0, 2.0]
    assert list(t.steps[0].stats) == ["moe_tokens_per_expert"]  # runtime fields are not case stats
    assert np.array_equal(t.controller_costs(), [r["layer_cost_s"] for r in recs])
    assert t.steps[2].microbatches == 4 and t.steps[2].state_bytes == recs[2]["layer_state_bytes"]
    assert "loss" not in json.loads((tmp_path / "t.jsonl").read_text().splitlines()[1])
    t.write(tmp_path / "u.jsonl")
    assert load_trace(tmp_path / "u.jsonl") == t


def test_bad_traces_say_what_is_wrong(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"format": "other"}) + "\n")
    with pytest.raises(TraceError, match="not a dynmo trace"):
        load_trace(p)
    header = TraceHeader.from_config(CFG, param_counts(CFG["model"]), 2, 1)
    w = TraceWriter(p, header)
    with pytest.raises(TraceError, match="4 values for 5 layers"):
        w.write_trace_step(TraceStep(0, [0.1] * 4, [0.1] * 4))
    with pytest.raises(TraceError, match="lacks"):
        w.write_step(StepRecord(step=0, layout=[0, 5]))
    w.close()
    with pytest.raises(TraceError, match="no steps"):
        load_trace(p)
    with pytest.raises(TraceError, match="not a run folder"):
        trace_from_metrics(tmp_path)


def test_trace_from_a_real_run(tmp_path):
    """Convert a real 2-rank run (skewed from step 2) and replay it through the CLI.

    Once `dynmo train --trace FILE` exists (log.trace), the run also writes a trace, which
    must hold the same steps as the converted metrics."""
    from dynmo.config import LogConfig

    writes_trace = "trace" in LogConfig.__dataclass_fields__
    out = tmp_path / "run"
    extra = ["--trace", str(tmp_path / "run.trace.jsonl")] if writes_trace else []
    run_train(out, "--train.steps", "4", "--skew.blocks", "0", "--skew.factor", "3", "--skew.start_step", "2", *extra)
    recs = metrics(out)
    t = trace_from_metrics(out)
    assert t.header.source == "metrics" and t.header.case == "skew"
    assert (t.header.pp, t.header.dp, t.header.microbatches) == (2, 1, 4)
    assert t.header.kinds == ["E", "t", "t", "t", "t", "L"]
    assert t.header.tokens_per_microbatch == 8 // 4 * 32
    assert t.header.params == param_counts({"n_layers": 4, "d_model": 64, "n_heads": 2, "seq_len": 32, "vocab_size": 512})
    assert len(t.steps) == 4 and t.dynamism_steps() == [2]
    for s, r in zip(t.steps, recs):
        assert s.fwd == r["layer_fwd_s"] and s.bwd == r["layer_bwd_s"] and s.layout == r["layout"]
        assert s.iteration_s == r["iteration_s"]
    assert np.all(t.costs() > 0)
    assert load_trace(out) == t  # a run folder is accepted wherever a trace is
    if writes_trace:
        w = load_trace(tmp_path / "run.trace.jsonl")
        assert w.header.source == "train" and w.steps == t.steps
        assert (w.header.params, w.header.kinds, w.header.pp, w.header.dp) == (t.header.params, t.header.kinds, 2, 1)

    from dynmo.cli import main as dynmo_main

    plots = tmp_path / "plots"
    assert dynmo_main(["simulate", "--trace", str(out), "--plots", str(plots), "--policies",
                       "uniform,optimal,oracle", "--scale-blocks", "12", "--stages", "4", "--dp", "2"]) == 0
    for name in ("stage_loads.png", "bubble.png", "layout.png", "iteration.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _random_trace(rng, blocks: int, steps: int, wgrad: bool = False) -> Trace:
    n = blocks + 2
    cfg = {"model": {"n_layers": blocks, "d_model": 32, "seq_len": 16, "vocab_size": 64},
           "train": {"global_batch": 4, "microbatches": 2}, "parallel": {"schedule": "1f1b"}}
    header = TraceHeader.from_config(cfg, param_counts(cfg["model"]), 2, 1)
    out = []
    for k in range(steps):
        f = rng.uniform(0.0, 1.0, n).tolist()
        b = rng.uniform(0.0, 2.0, n).tolist()
        out.append(TraceStep(k, f, b, layout=[0, n // 2, n], wgrad=[x / 3 for x in b] if wgrad else None,
                             events=[{"type": "dynamism"}] if k % 3 == 1 else [],
                             cost=[0.9 * (x + y) for x, y in zip(f, b)]))
    return Trace(header, out)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 60), st.floats(0.0, 0.5), st.booleans(), st.integers(0, 2**31))
def test_scale_trace_invariants(blocks, new_blocks, noise, wgrad, seed):
    rng = np.random.default_rng(seed)
    t = _random_trace(rng, blocks, 4, wgrad)
    s = scale_trace(t, new_blocks, noise=noise, seed=seed, cost_scale=2.0)
    assert s.num_layers == new_blocks + 2 and s.header.kinds == ["E"] + ["t"] * new_blocks + ["L"]
    assert len(s.header.params) == len(s.header.layer_bytes) == new_blocks + 2
    assert s.dynamism_steps() == t.dynamism_steps() and len(s.steps) == len(t.steps)
    for a, b in ((t.fwd(), s.fwd()), (t.bwd(), s.bwd()), (t.controller_costs(), s.controller_costs())):
        # the mean block cost per step is preserved (x cost_scale); E and L keep theirs
        np.testing.assert_allclose(b[:, 1:-1].sum(1), 2.0 * a[:, 1:-1].sum(1) * new_blocks / blocks, rtol=1e-9)
        np.testing.assert_allclose(b[:, [0, -1]], 2.0 * a[:, [0, -1]])
        assert np.all(b >= 0)
    if wgrad:
        assert all(np.all(np.asarray(x.wgrad) <= np.asarray(x.bwd) + 1e-12) for x in s.steps)
    m = block_map(blocks, new_blocks)
    assert np.all(np.diff(m) >= 0) and m[0] == 0 and m[-1] <= blocks - 1
    if new_blocks >= blocks:
        assert set(m.tolist()) == set(range(blocks))  # every traced block is used


def test_scale_trace_keeps_a_region_where_it_was():
    """A skew on the first 3 of 8 blocks covers the first 3/8 of 48 blocks, at the same steps."""
    rng = np.random.default_rng(1)
    t = _random_trace(rng, 8, 3)
    for s in t.steps:
        s.fwd = [0.1] + [4.0 if i < 3 else 1.0 for i in range(8)] + [0.2]
    big = scale_trace(t, 48)
    blocks = np.asarray(big.steps[0].fwd[1:-1])
    assert np.all(blocks[:18] == blocks[0]) and np.all(blocks[18:] == blocks[-1])
    assert blocks[0] == pytest.approx(4 * blocks[-1])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(6, 20), st.booleans(), st.integers(0, 2**31))
def test_relevel_sets_each_phase_level_and_keeps_the_rest(blocks, steps, wgrad, seed):
    rng = np.random.default_rng(seed)
    t = _random_trace(rng, blocks, steps, wgrad)
    starts = sorted(rng.choice(np.arange(1, steps), size=min(2, steps - 1), replace=False).tolist())
    levels = {p: {int(u): float(rng.uniform(0.2, 1.5)) for u in rng.choice(np.arange(1, blocks + 1), size=blocks,
                                                                          replace=False)[:max(1, blocks // 2)]}
              for p in starts}
    r = relevel(t, levels)
    before, after = t.fwd() + t.bwd(), r.fwd() + r.bwd()
    idx = np.array([s.step for s in t.steps])
    ref = before[idx < starts[0]].mean(0)
    bounds = starts + [idx.max() + 1]
    for p, end in zip(starts, bounds[1:]):
        rows = (idx >= p) & (idx < end)
        for u in range(t.num_layers):
            if u in levels[p]:
                assert after[rows, u].mean() == pytest.approx(levels[p][u] * ref[u], rel=1e-9)
                # the step-to-step variation inside the phase is the traced one
                np.testing.assert_allclose(after[rows, u] / after[rows, u].mean(),
                                           before[rows, u] / before[rows, u].mean(), rtol=1e-9)
            else:
                np.testing.assert_allclose(after[rows, u], before[rows, u])
    np.testing.assert_allclose(after[idx < starts[0]], before[idx < starts[0]])
    if wgrad:  # one factor per unit and step: wgrad stays the same share of bwd
        np.testing.assert_allclose(r.wgrad() / r.bwd(), t.wgrad() / t.bwd(), rtol=1e-9)
    assert r.dynamism_steps() == t.dynamism_steps()


def test_relevel_says_what_is_wrong():
    t = _random_trace(np.random.default_rng(0), 3, 5)
    for levels, msg in (({0: {1: 0.5}}, "no step before"), ({9: {1: 0.5}}, "not a step"),
                        ({2: {7: 0.5}}, "units 0..4"), ({2: {1: 0.0}}, "> 0"), ({2: {1: float("nan")}}, "> 0")):
        with pytest.raises(TraceError, match=msg):
            relevel(t, levels)
