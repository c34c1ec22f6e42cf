"""`dynmo bench`: argument errors, and what it says when it has nothing to measure."""

import json

from dynmo import bench


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


def test_repeats_alternate_and_report_medians_and_the_paired_range(tmp_path, monkeypatch):
    calls = []
    tps = iter([100.0, 110.0, 90.0, 108.0, 100.0, 95.0])  # static, dynmo, static, dynmo, ...

    def fake_train(out, config, *extra):
        calls.append((out.name, extra[1]))
        rec = {"layout": [0, 2, 4], "layer_cost_s": [1.0] * 4, "profile_s": 0.0, "events": [],
               "tokens_per_s": next(tps), "step_s": 1.0, "bubble_ratio": 0.25}
        return [rec, rec]

    monkeypatch.setattr(bench, "train", fake_train)
    row = bench.real_row(bench.CASES[0], tmp_path, steps=None, repeats=3)
    assert calls == [("skewed-static", "never"), ("skewed-dynmo", "auto"), ("skewed-static-1", "never"),
                     ("skewed-dynmo-1", "auto"), ("skewed-static-2", "never"), ("skewed-dynmo-2", "auto")]
    assert row["static_tokens_per_s"] == 100.0 and row["dynmo_tokens_per_s"] == 108.0
    assert row["speedup"] == 1.08 and row["speedup_min"] == 0.95 and row["speedup_max"] == 1.2
    assert "0.950–1.200" in bench.render([row], [], [], [])
