"""`dynmo bench`: argument errors, and what it says when it has nothing to measure."""

import json

import pytest

from dynmo import bench
from dynmo.sim.replay import PROFILE_STEPS


def test_unknown_case_is_an_error(capsys):
    assert bench.main(["--out", "/tmp/unused-bench", "--cases", "nope"]) == 2
    assert "unknown case" in capsys.readouterr().err


def test_missing_traces_are_reported_not_hidden(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--cases", "moe,mod", "--no-real"]) == 0
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["real"] == [] and out["sim"] == []
    assert len(out["missing"]) == 2 and all("no static trace" in m for m in out["missing"])
    assert "## Missing" in (tmp_path / "bench.md").read_text()


def test_oracle_bound_and_overhead_from_records():
    recs = [
        {"layout": [0, 2, 4], "layer_cost_s": [1.0, 1.0, 1.0, 1.0], "profile_s": 0.0, "events": []},
        {"layout": [0, 2, 4], "layer_cost_s": [3.0, 1.0, 1.0, 1.0], "profile_s": 0.5,
         "events": [{"type": "migration", "seconds": 0.25, "decide_s": 0.25}]},
    ]
    # the second step: static bottleneck 4, best contiguous 3 ([3 | 1 1 1])
    assert bench.oracle_bound(recs) == 4.0 / 3.0
    assert bench.overhead_s(recs) == 1.0


def _rec(tps, costs=(1.0, 1.0, 1.0, 1.0), layout=(0, 2, 4), workers=2, step=0):
    return {"step": step, "layout": list(layout), "layer_cost_s": list(costs), "profile_s": 0.0, "events": [],
            "tokens_per_s": tps, "step_s": 1.0, "bubble_ratio": 0.25, "workers": workers,
            "stage_compute_s": [1.0, 1.0]}


def test_profile_once_is_the_optimal_layout_of_the_first_steps_after_warm_up():
    warm = _rec(1.0, costs=(1.0, 1.0, 1.0, 9.0))  # step 0: left out
    early = [_rec(1.0, costs=(3.0, 1.0, 1.0, 1.0)) for _ in range(PROFILE_STEPS)]
    late = _rec(1.0, costs=(1.0, 1.0, 1.0, 3.0))  # after the profile: never looked at
    assert bench.profile_once_of([warm, *early, late]) == [0, 1, 4]


def test_per_worker_figures_credit_released_workers():
    recs = [_rec(100.0), _rec(100.0, workers=2), _rec(100.0, workers=1)]
    assert bench.worker_seconds(recs) == 3.0
    assert bench.per_worker(recs) == 200.0 / 3.0


def test_the_headline_is_paired_runs_apart_from_the_runs_that_chose_the_best_static_layout(tmp_path, monkeypatch):
    calls = []
    # the selection runs: uniform, params, profile-once, dynmo; then 6 alternating pairs
    tps = iter([100.0, 120.0, 110.0, 126.0,
                118.0, 125.0,   # pair 0: static first
                130.0, 120.0,   # pair 1: dynmo first
                121.0, 121.0, 124.0, 120.0, 119.0, 128.0, 131.0, 122.0])

    def fake_train(out, config, *extra):
        args = dict(zip(extra[::2], extra[1::2]))
        calls.append((out.name, args["--balance.when"], args.get("--parallel.layout")))
        t = next(tps)
        return [_rec(t, costs=(3.0, 1.0, 1.0, 1.0), step=k) for k in range(8)]

    monkeypatch.setattr(bench.run, "train", fake_train)
    monkeypatch.setattr(bench.run, "write_real_plots", lambda *a: None)
    row = bench.real_row(bench.CASES[0], tmp_path, steps=8, pairs=6)
    assert calls[:4] == [("skewed-uniform", "never", "uniform"), ("skewed-params", "never", "params"),
                         ("skewed-profile-once", "never", "0,1,4"), ("skewed-dynmo", "auto", None)]
    # params won the selection; the pairs alternate their order and run apart from it
    assert [c[0] for c in calls[4:8]] == ["skewed-pair0-static", "skewed-pair0-dynmo", "skewed-pair1-dynmo",
                                          "skewed-pair1-static"]
    assert all(c[2] == "params" for c in calls[4:] if c[0].endswith("static"))
    assert row["tokens_per_s"] == {"uniform": 100.0, "params": 120.0, "profile-once": 110.0, "dynmo": 126.0}
    assert row["best_static"] == "params"
    ratios = [125 / 118, 130 / 120, 121 / 121, 124 / 120, 128 / 119, 131 / 122]
    assert row["paired_ratios"] == ratios
    assert row["speedup_vs_best_static"] == pytest.approx(sorted(ratios)[2] / 2 + sorted(ratios)[3] / 2)
    # 6 pairs: the interval is (min, max), covering 1 - 2 / 64 of the median's distribution
    assert row["interval"] == [1.0, 130 / 120] and row["interval_coverage"] == 1 - 2 / 64
    assert row["verdict"] == "no measurable difference"  # the interval holds 1.0
    assert row["speedup_vs_uniform"] == 1.26
    text = bench.render([row], [], [], [])
    assert "(1.000–1.083, 97%, 6 pairs) | no measurable difference |" in text and "| params |" in text


def test_median_interval_and_verdict():
    from dynmo.bench.measures import median_interval, verdict

    med, lo, hi, cov = median_interval([float(x) for x in range(1, 21)])
    assert (med, lo, hi) == (10.5, 6.0, 15.0) and 0.95 <= cov < 0.96  # the textbook order statistics for n = 20
    assert median_interval([1.1, 1.2, 1.3])[1:3] == (1.1, 1.3)  # too few pairs: (min, max), coverage 75%
    assert verdict(1.01, 1.2) == "faster" and verdict(0.8, 0.99) == "slower"
    assert verdict(0.99, 1.01) == "no measurable difference"


def test_shrinking_cases_run_repack_and_the_dense_model_once(tmp_path, monkeypatch):
    calls = []

    def fake_train(out, config, *extra):
        calls.append(out.name)
        workers = 1 if "repack" in out.name else 2
        return [_rec(100.0, workers=workers if k > 3 else 2, step=k) for k in range(8)]

    monkeypatch.setattr(bench.run, "train", fake_train)
    monkeypatch.setattr(bench.run, "write_real_plots", lambda *a: None)
    dense: dict = {}
    pruning = next(c for c in bench.CASES if c.name == "pruning")
    freezing = next(c for c in bench.CASES if c.name == "freezing")
    a = bench.real_row(pruning, tmp_path, steps=8, dense=dense)
    bench.real_row(freezing, tmp_path, steps=8, dense=dense)
    assert calls.count("dense-8") == 1 and "pruning-repack" in calls
    assert a["workers_final"] == {"uniform": 2, "params": 2, "profile-once": 2, "dynmo": 2, "repack": 1}
    assert a["tokens_per_worker_s"]["repack"] > a["tokens_per_worker_s"]["dynmo"]
    assert a["technique_alone"] == 1.0
    assert "Re-packing: the same training on fewer workers" in bench.render([a], [], [], [])


def test_no_real_keeps_the_real_rows_and_compares_with_the_dense_trace_at_paper_scale(tmp_path, monkeypatch):
    import numpy as np

    from dynmo.sim.trace import TraceWriter
    from tests.test_sim_replay import make_trace

    monkeypatch.setattr(bench.run, "train", lambda out, config, *extra: [_rec(100.0, step=k) for k in range(8)])
    monkeypatch.setattr(bench.run, "write_real_plots", lambda *a: None)
    skewed = bench.CASES[0]
    row = bench.real_row(skewed, tmp_path, steps=8)
    (tmp_path / "bench.json").write_text(json.dumps({"command": ["--out", "x"], "started": "2026-01-01 00:00 UTC",
                                                     "duration_s": 600, "real": [row]}))
    (tmp_path / "traces").mkdir()
    costs = np.ones((6, 10)) * 0.01
    costs[:, 1:3] *= 3  # skewed: two heavy blocks
    for name, c in (("skewed-static", costs), (f"dense-{skewed.steps}", np.ones((4, 10)) * 0.01)):
        t = make_trace(c)
        with TraceWriter(tmp_path / "traces" / f"{name}.jsonl", t.header) as w:
            for s in t.steps:
                w.write_trace_step(s)
    assert bench.main(["--out", str(tmp_path), "--cases", "skewed", "--no-real"]) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    earlier = {"command": ["--out", "x"], "started": "2026-01-01 00:00 UTC"}
    assert doc["real"] == [row | {"run": earlier}]
    by = {r["policy"]: r for r in doc["sim"]}
    assert by["uniform"]["dense_trace"] == f"dense-{skewed.steps}.jsonl"
    # the technique's model is heavier than the dense one; balancing wins some of it back
    assert by["uniform"]["vs_dense"] < by["optimal"]["vs_dense"] < 1.0
    text = (tmp_path / "bench.md").read_text()
    assert "Kept from an earlier invocation, `dynmo bench --out x` (started 2026-01-01 00:00 UTC): skewed (real)." in text
    assert "Technique alone and with dynmo at paper scale" in text
    # another case measured later keeps skewed's rows, real and simulated, with their origin
    moe = bench.CASES[1]
    assert moe.name == "moe"
    assert bench.main(["--out", str(tmp_path), "--cases", "moe", "--no-sim"]) == 0
    doc2 = json.loads((tmp_path / "bench.json").read_text())
    assert [r["case"] for r in doc2["real"]] == ["skewed", "moe"]
    assert doc2["real"][0] == doc["real"][0] and doc2["sim"] == [r | {"run": r["run"]} for r in doc["sim"]]
    assert doc2["real"][1]["run"]["command"] == ["--out", str(tmp_path), "--cases", "moe", "--no-sim"]


def test_each_block_kind_is_compared_with_its_own_dense_model(tmp_path, monkeypatch):
    calls = []

    def fake_train(out, config, *extra):
        calls.append((out.name, config, extra[:2]))
        return [_rec(200.0 if out.name.startswith("dense") else 100.0, step=k) for k in range(8)]

    monkeypatch.setattr(bench.run, "train", fake_train)
    monkeypatch.setattr(bench.run, "write_real_plots", lambda *a: None)
    moe = next(c for c in bench.CASES if c.name == "moe")
    assert bench.dense_name(moe, 8) == "dense-moe-8" and bench.dense_name(bench.CASES[0], 8) == "dense-8"
    row = bench.real_row(moe, tmp_path, steps=8, dense={})
    assert ("dense-moe-8", "configs/moe.toml", ("--model.block", "dense")) in calls
    assert row["dense"]["name"] == "dense-moe-8" and row["technique_alone"] == 0.5
    # a row measured against another model's dense run loses that comparison, and --dense-only
    # measures the right one without training the case's variants again
    stale = row | {"dense": {"tokens_per_s": 50.0}, "technique_alone": 2.0, "steps": moe.steps}
    (tmp_path / "bench.json").write_text(json.dumps({"command": ["x"], "started": "s", "real": [stale]}))
    assert "technique_alone" not in bench.cli._latest_dense([stale], {})[0]
    calls.clear()
    assert bench.main(["--out", str(tmp_path), "--cases", "moe", "--dense-only", "--no-sim"]) == 0
    assert [c[0] for c in calls] == [f"dense-moe-{moe.steps}"]
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["real"][0]["technique_alone"] == 0.5 and doc["real"][0]["dense"]["name"] == f"dense-moe-{moe.steps}"
