"""benchmarks/gpu_check.py: its case table, arguments, FLOP count and crash bookkeeping (pure), and a
tiny CPU run of a few cases whose report is written and whose traces replay (`dynmo simulate`)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynmo import cli
from dynmo.config import load_config
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


gpu_check = load_benchmark("gpu_check")


def test_cases_cover_every_family_and_dynamic_case_config():
    shipped = {p.name for p in (ROOT / "configs").glob("*.toml") if not p.name.startswith("tensor-")}  # training configs
    assert set(gpu_check.CASES.values()) | set(gpu_check.NOT_CHECKED) == shipped
    for case, config in gpu_check.CASES.items():
        assert case.split("-")[0] == load_config(ROOT / "configs" / config).model.family, case
    assert {c.split("-")[0] for c in gpu_check.CASES} == {"gpt", "llama", "mixtral"}


@pytest.mark.parametrize("args, says", [
    ([], "--out DIR is required"),
    (["--device", "cpu", "--cases", "gpt-dense,nope"], "unknown case(s) nope"),
    (["--device", "cpu", "--stagings", "3stage"], "--stagings"),
    (["--device", "cpu", "--tiny", "--steps", "1"], "--steps must be > 1"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--device", "cpu", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--device", "cpu", "--peak-tflops", "0"], "--peak-tflops must be > 0"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, says):
    out = tmp_path / "out"
    argv = args if not args else ["--out", str(out), *args]
    assert gpu_check.main(argv) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith("gpu_check: error:") and says in line
    assert not out.exists()  # nothing started


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("")
    assert gpu_check.main(["--out", str(f), "--device", "cpu"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_cuda_requested_without_a_gpu_is_refused(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--out", str(tmp_path / "o")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "no CUDA device" in line and "--device cpu" in line


def test_peak_table_matches_device_names():
    assert gpu_check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_check.peak_tflops("NVIDIA H200") == 989.0
    assert gpu_check.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_check.peak_tflops("NVIDIA GeForce RTX 4090") is None


def test_a_crashed_worker_is_named_and_the_rest_run_in_a_new_one(tmp_path, monkeypatch):
    runs = gpu_check.plan_runs(["gpt-dense", "gpt-moe"], gpu_check.TINY, "cpu", "bf16", tmp_path)
    calls = []

    def fake_worker(cmd, **kw):
        """First worker: finishes run 0, dies inside run 1. Second: runs what it is given."""
        plan = json.loads(Path(cmd[-1]).read_text())
        results = Path(plan["results"])
        calls.append([r["name"] for r in plan["runs"]])
        for k, r in enumerate(plan["runs"]):
            gpu_check.append_json(results, {"run": r["name"], "event": "start"})
            if len(calls) == 1 and k == 1:
                return subprocess.CompletedProcess(cmd, -11)
            gpu_check.append_json(results, {"run": r["name"], "event": "end", "status": 0, "seconds": 0.1})
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_worker)
    done = gpu_check.run_all(runs, "cpu", tmp_path)
    names = [r.name for r in runs]
    assert calls == [names, names[2:]]
    assert done[names[1]] == {"run": names[1], "status": -11, "crashed": True}
    assert all(done[n]["status"] == 0 for n in names if n != names[1])


@pytest.mark.dist
def test_tiny_cpu_run_writes_report_and_replayable_traces(tmp_path):
    out = tmp_path / "check"
    cases = ["gpt-pruning", "llama-mod", "mixtral-moe"]  # the three families; pruning changes the model mid-run
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out),
                        "--cases", ",".join(cases)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    names = [f"{c}-{s}" for c in cases for s in ("1stage", "2stage")]
    for k, name in enumerate(names, 1):
        assert f"[{k}/{len(names)}] {name}: ok" in p.stderr

    report = json.loads((out / "report.json").read_text())
    assert [r["run"] for r in report["runs"]] == names
    assert report["meta"]["dtype"] == "bf16" and report["meta"]["peak_tflops"] is None
    md = (out / "report.md").read_text()
    for r in report["runs"]:
        assert r["status"] == 0 and f"| {r['run']} | ok |" in md
        n = len(r["layers"])
        assert r["layers"][0] == "embed" and r["layers"][-1] == "head" and n == 6
        assert len(r["layer_fwd_ms"]) == len(r["layer_bwd_ms"]) == n
        assert all(x > 0 for x in r["layer_fwd_ms"][1:-1] + r["layer_bwd_ms"][1:-1])
        assert r["tokens_per_s"] > 0 and r["model_tflops"] > 0 and r["mfu"] is None
        assert r["estimated_memory_bytes"] > 0
        assert r["trace_error"] is None and r["trace_steps"] == r["steps"] == gpu_check.TINY.steps
        assert (len(r["layouts"][0].split("|")), r["stages"]) in ((1, 1), (2, 2))
    assert [r["dynamism_events"] for r in report["runs"]][:2] == [2, 2]  # two pruning steps within the run

    for name in names:  # `dynmo simulate --trace FILE`, in this process (a process each costs seconds)
        assert cli.main(["simulate", "--trace", str(out / "traces" / f"{name}.trace.jsonl")]) == 0, name
