"""`dynmo bench`: argument errors, and what it says when it has nothing to measure."""

import json
from pathlib import Path

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
    assert doc["experts"] == []  # no routing in its trace: no expert-parallel row
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


def test_whole_against_half_blocks_replays_every_sublayer_trace_and_is_kept(tmp_path, monkeypatch):
    import numpy as np

    import dynmo.bench.sim as bench_sim
    from dynmo.sim.replay import load_sublayer_trace, replay_units
    from tests.test_sim_units import sublayer_trace

    shape = {"UNITS_BLOCKS": 6, "UNITS_STAGES": 4, "UNITS_DP": 2, "UNITS_MICROBATCHES": 8}
    for name, value in shape.items():  # a small shape: the replay's numbers, not the machine's speed, are tested
        monkeypatch.setattr(bench_sim, name, value)
    folder = tmp_path / "traces" / "sublayer"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(5)
    sub = sublayer_trace(rng, 4, 6)
    sub.write(folder / "sub.jsonl")
    from dynmo.sim.trace import merge_units
    merge_units(sub).write(folder / "whole.jsonl")  # whole blocks: said in Missing, not replayed
    argv = ["--out", str(tmp_path), "--cases", "moe", "--no-real"]
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = doc["units"]
    assert [(r["trace"], r["units"], r["layers"]) for r in rows] == [("sub", "block", 8), ("sub", "sublayer", 14)]
    block, half = rows
    assert half["gap"] <= block["gap"] * (1 + 1e-12)  # every block layout is a sublayer layout
    assert any(m.startswith("units: whole.jsonl: ") and "is not a sublayer trace" in m for m in doc["missing"])
    # the rows are the library's replay, at the benchmark's shape
    ref = replay_units(load_sublayer_trace(folder / "sub.jsonl"), 6, 4, 2, 8)
    for r in rows:
        want = ref[r["units"]]
        assert (r["best_static"], r["best_static_s"], r["gap"]) == (want["best_static"], want["best_static_s"], want["gap"])
        assert r["dynmo_s"] > 0 and r["oracle_s"] <= r["best_static_s"] * (1 + 1e-12)
        assert r["oracle_vs_best_static"] == pytest.approx(r["best_static_s"] / r["oracle_s"])
        assert r["run"] == {"command": argv, "started": doc["started"]}
    text = (tmp_path / "bench.md").read_text()
    assert "## Whole blocks against half blocks (replay)" in text
    table = {c[2]: c for c in (line.split(" | ") for line in text.splitlines() if line.startswith("| sub |"))}
    assert table["block"][-1] == "reference |" and table["block"][6] == f"{block['gap']:.3f}"
    speedups = [block[k] / half[k] for k in ("best_static_s", "dynmo_s", "oracle_s")]
    assert table["sublayer"][-1] == ", ".join(f"{x:.3f}" for x in speedups) + " |"
    # an invocation that does not simulate keeps the section, naming the invocation that replayed it
    assert bench.main(["--out", str(tmp_path), "--cases", "moe", "--no-real", "--no-sim"]) == 0
    doc2 = json.loads((tmp_path / "bench.json").read_text())
    assert doc2["units"] == rows
    text2 = (tmp_path / "bench.md").read_text()
    assert (f"Kept from an earlier invocation, `dynmo bench {' '.join(argv)}` (started {doc['started']}): "
            "whole blocks against half blocks (simulated).") in text2
    assert [line for line in text2.splitlines() if line.startswith("| sub |")] == \
        [line for line in text.splitlines() if line.startswith("| sub |")]
    # one that simulates replays it again: without sublayer traces, a one-line note
    for path in folder.iterdir():
        path.unlink()
    assert bench.main(argv) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["units"] == []
    section = (tmp_path / "bench.md").read_text().split("## Whole blocks against half blocks (replay)\n")[1]
    assert section.lstrip().startswith("Skipped: no sublayer trace in `traces/sublayer/` was replayed")
    assert "| sub |" not in section


def test_bench_without_sublayer_traces_says_so_in_one_line(tmp_path):
    assert bench.main(["--out", str(tmp_path), "--cases", "moe", "--no-real"]) == 0
    text = (tmp_path / "bench.md").read_text()
    assert text.count("Skipped: no sublayer trace") == 1
    assert bench.render([], [], [], []).count("Whole blocks against half blocks") == 0  # never replayed: no section


def test_half_block_units_reach_every_real_run_and_one_out_holds_one_kind(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_train(out, config, *extra):
        calls.append(extra)
        return [_rec(100.0, step=k) for k in range(8)]

    monkeypatch.setattr(bench.run, "train", fake_train)
    monkeypatch.setattr(bench.run, "write_real_plots", lambda *a: None)
    out = tmp_path / "b"
    assert bench.main(["--out", str(out), "--cases", "moe", "--steps", "8", "--pairs", "1", "--no-sim",
                       "--unit", "sublayer"]) == 0
    # every run, the dense model's too, once each
    assert calls and all(list(extra).count("--parallel.unit") == 1
                         and extra[list(extra).index("--parallel.unit") + 1] == "sublayer" for extra in calls)
    assert json.loads((out / "bench.json").read_text())["unit"] == "sublayer"
    assert bench.main(["--out", str(out), "--cases", "moe", "--no-sim"]) == 2
    assert "holds runs with parallel.unit = 'sublayer'" in capsys.readouterr().err


def test_moe_cases_are_replayed_with_expert_parallelism_and_the_rows_kept(tmp_path, monkeypatch):
    """A MoE case's trace also gets the expert-parallel replay (E = dp, layout and placement
    decided together): its row is the library's replay at the case's shape, kept by an
    invocation that does not simulate; a case without routing gets none."""
    import dataclasses

    import dynmo.bench.cli as cli
    from dynmo.sim import load_trace, scale_trace
    from dynmo.sim.replay.expert_policies import replay_experts
    from dynmo.sim.replay.experts import ExpertOptions

    small = [dataclasses.replace(c, stages=2, dp=2, blocks=4) if c.name == "moe" else c for c in bench.CASES]
    monkeypatch.setattr(cli, "CASES", small)
    (tmp_path / "traces").mkdir()
    src = Path(__file__).resolve().parents[1] / "docs" / "bench" / "traces" / "moe-static.jsonl"
    t = load_trace(src)
    t.steps = t.steps[:24]
    t.write(tmp_path / "traces" / "moe-static.jsonl")
    argv = ["--out", str(tmp_path), "--cases", "moe", "--no-real"]
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = doc["experts"]
    assert [(r["case"], r["ep"], r["experts"], r["extra_slots"]) for r in rows] == [("moe", 2, 8, 0), ("moe", 2, 8, 1)]
    scaled = scale_trace(load_trace(tmp_path / "traces" / "moe-static.jsonl"), 4, noise=0.05)
    for row in rows:
        s = row["extra_slots"]
        want = replay_experts(scaled, 2, 2, 2, ExpertOptions(microbatches=8, extra_slots=s, copies=2 * s),
                              layouts="dynmo").results
        assert row["static_s"] == pytest.approx(want["static"].total_s)
        assert row["dynmo"] == pytest.approx(want["dynmo"].speedup)
        assert row["oracle"] == pytest.approx(want["oracle"].speedup) and row["oracle"] >= 1.0
    assert rows[0]["static_s"] == rows[1]["static_s"]  # static never copies
    text = (tmp_path / "bench.md").read_text()
    assert "## Expert parallelism at paper scale" in text
    assert len([line for line in text.splitlines() if line.startswith("| moe | 6 layers, 2x2 | 2 (8) |")]) == 2
    assert bench.main(["--out", str(tmp_path), "--cases", "moe", "--no-real", "--no-sim"]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["experts"] == rows
    # a MoE trace without the routing (recorded before it was): no row, and the output says why
    for st in t.steps:
        st.stats.pop("moe_tokens_per_expert", None)
    t.write(tmp_path / "traces" / "moe-static.jsonl")
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["experts"] == [] and any(m.startswith("moe: no expert-parallel replay: ") and "moe_tokens_per_expert" in m
                                        for m in doc["missing"]), doc["missing"]
