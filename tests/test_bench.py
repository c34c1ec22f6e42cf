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
