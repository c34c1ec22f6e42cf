"""`dynmo simulate --input stages.json` and the purity of dynmo.sim."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dynmo.cli import main as dynmo_main


def _run(tmp_path, capsys, spec, *args):
    path = tmp_path / "stages.json"
    path.write_text(json.dumps(spec))
    rc = dynmo_main(["simulate", "--input", str(path), *args])
    out = capsys.readouterr()
    return rc, out


def test_simulate_prints_iteration_time_and_bubbles(tmp_path, capsys):
    spec = {"fwd": [1.0, 1.0, 1.0], "bwd": [2.0, 2.0, 2.0], "microbatches": 6, "schedule": "1F1B"}
    rc, out = _run(tmp_path, capsys, spec)
    assert rc == 0
    doc = json.loads(out.out)
    assert doc["iteration_time"] == pytest.approx((6 + 2) * 3.0)
    assert doc["bubble_ratio"] == pytest.approx(2 / 8)
    assert doc["bubble_imbalance"] == pytest.approx(0.0, abs=1e-12)
    assert len(doc["busy_s"]) == len(doc["idle_s"]) == 3
    for key in ("bubble_inherent", "stage_busy_s", "workers", "allreduce_s"):
        assert key in doc


def test_simulate_all_options(tmp_path, capsys):
    spec = {
        "schedule": "ZBVZeroBubble", "microbatches": 4,
        "fwd": [[1.0, 1.1, 0.9, 1.0]] * 4, "bwd": [[2.0] * 4] * 4, "wgrad": [[1.0] * 4] * 4,
        "comm": {"fwd": 0.1, "bwd": [0.1, 0.2, 0.1]}, "stages_per_rank": 2,
        "dp": 4, "grad_bytes": [1e6] * 4, "bandwidth": 1e8, "latency": 1e-4,
        "allreduce_mode": "blocking", "p2p": "rendezvous",
    }
    rc, out = _run(tmp_path, capsys, spec, "--ops", "--indent", "0")
    assert rc == 0, out.err
    doc = json.loads(out.out)
    assert doc["pipeline_ranks"] == 2 and doc["workers"] == 8
    assert len(doc["trace"]) == 2 and doc["trace"][0][0]["op"] == "0F0"
    assert doc["iteration_time"] > doc["compute_time"]


def test_flags_override_the_file(tmp_path, capsys):
    spec = {"fwd": [1.0, 1.0], "bwd": [2.0, 2.0], "microbatches": 2, "schedule": "GPipe"}
    rc, out = _run(tmp_path, capsys, spec, "--microbatches", "8", "--schedule", "1f1b")
    doc = json.loads(out.out)
    assert rc == 0 and doc["schedule"] == "1F1B" and doc["microbatches"] == 8


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"fwd": [1.0]}, "missing 'bwd'"),
        ({"fwd": [1.0], "bwd": [1.0], "microbatches": 2, "stage": 3}, "unknown keys"),
        ({"fwd": [1.0, 1.0], "bwd": [1.0, 1.0], "microbatches": 2, "schedule": "x"}, "unknown schedule"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, capsys, spec, match):
    rc, out = _run(tmp_path, capsys, spec)
    assert rc == 2 and match in out.err


def test_unreadable_input(tmp_path, capsys):
    assert dynmo_main(["simulate", "--input", str(tmp_path / "nope.json")]) == 2
    (tmp_path / "bad.json").write_text("{")
    assert dynmo_main(["simulate", "--input", str(tmp_path / "bad.json")]) == 2


def test_simulator_does_not_import_torch():
    code = (
        "import sys, dynmo.engine, dynmo.sim, dynmo.sim.cli, dynmo.sim.trace, "
        "dynmo.sim.replay, dynmo.sim.plots;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
