"""The pure CLIs on bad and hostile input: one line on stderr and exit 2, never a traceback,
never invalid JSON, never unbounded work (`dynmo balance`, `dynmo simulate`)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import dynmo.jsonio as jsonio
import dynmo.sim.cli as sim_cli
import dynmo.sim.trace.limits as trace_mod
from dynmo.balance import BalanceError, Problem, balance
from dynmo.balance import cli as balance_cli
from dynmo.balance.static import DEEPSPEED_MAX_WORK
from dynmo.sim.trace import TraceHeader, TraceStep

ROOT = Path(__file__).resolve().parents[1]


def _strict(text: str):
    """json.loads that fails on NaN / Infinity, which json.dumps writes by default."""
    def bad(name):
        raise AssertionError(f"invalid JSON constant {name} in the output")
    return json.loads(text, parse_constant=bad)


def call(main, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def assert_bad(res, prog: str, *needles: str) -> str:
    """Exit 2, nothing on stdout, exactly one line `PROG: error: ...` on stderr."""
    rc, out, err = res
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


def balance_run(tmp_path: Path, doc, *args: str, raw: str | None = None):
    f = tmp_path / "problem.json"
    f.write_text(raw if raw is not None else json.dumps(doc))
    return call(balance_cli.main, ["--input", str(f), *args])


def simulate_run(tmp_path: Path, doc, *args: str, raw: str | None = None):
    f = tmp_path / "stages.json"
    f.write_text(raw if raw is not None else json.dumps(doc))
    return call(sim_cli.main, ["--input", str(f), *args])


def bal_bad(tmp_path, doc, *needles, args=(), raw=None):
    return assert_bad(balance_run(tmp_path, doc, *args, raw=raw), "dynmo balance", *needles)


def sim_bad(tmp_path, doc, *needles, args=(), raw=None):
    return assert_bad(simulate_run(tmp_path, doc, *args, raw=raw), "dynmo simulate", *needles)


# ---- dynmo balance --------------------------------------------------------------------------


def test_balance_good_input_prints_strict_json(tmp_path):
    rc, out, err = balance_run(tmp_path, {"costs": [1, 2, 3, 4], "stages": 2, "current": [0, 2, 4]})
    assert rc == 0 and err == ""
    assert _strict(out)["boundaries"] == [0, 3, 4]


@pytest.mark.parametrize("doc,needles", [
    ({"costs": [1e308, 1e308, 1e308], "stages": 1}, ["overflow", "rescale"]),
    ({"costs": [1e300, 1e300], "stages": 2, "speeds": [1e-10, 1.0]}, ["overflow"]),
    ({"costs": [1, 1], "stages": 1, "memory": [1e308, 1e308]}, ["memory", "overflow"]),
])
def test_balance_costs_that_overflow_are_an_error_not_infinity(tmp_path, doc, needles):
    bal_bad(tmp_path, doc, *needles)


@pytest.mark.parametrize("doc,needles", [
    ({"costs": [1, 2, 3, 4], "stages": 2, "current": [0, 2.5, 4]}, ["current[1] = 2.5", "not an integer"]),
    ({"costs": [1, 2, 3, 4], "stages": 2, "current": [0, 2.0, 4]}, ["current[1]", "not an integer"]),
    ({"costs": [1, 2, 3, 4], "stages": 2, "current": [False, True, 4]}, ["current[0]"]),
    ({"costs": [1, 2, 3, 4], "stages": 2, "current": "0,2,4"}, ["current"]),
    ({"costs": [1, 2, 3, 4], "stages": 2.5}, ["stages must be an integer"]),
    ({"costs": [1, 2, 3, 4], "stages": 2.0}, ["stages must be an integer"]),
    ({"costs": [1, 2, 3, 4], "stages": True}, ["stages must be an integer", "boolean"]),
    ({"costs": [1, 2, 3, 4], "stages": "2"}, ["stages must be an integer"]),
    ({"costs": [True, 2, 3, 4], "stages": 2}, ["costs[0]", "not a number"]),
    ({"costs": ["1", 2, 3, 4], "stages": 2}, ["costs[0]"]),
    ({"costs": [[1, 2], [3, 4]], "stages": 2}, ["flat list"]),
    ({"costs": [1, None, 3], "stages": 2}, ["costs[1]"]),
    ({"costs": 5, "stages": 1}, ["costs must be a list"]),
    ({"costs": [10**400, 1], "stages": 1}, ["too large"]),
    ({"costs": [1, -1], "stages": 1}, ["costs[1]", ">= 0"]),
    ({"costs": [1, 1], "stages": 2, "speeds": [1, 0]}, ["speeds[1]", "> 0"]),
    ({"costs": [1, 1], "stages": 2, "capacity": True, "memory": [1, 1]}, ["capacity"]),
    ({"costs": [1, 1], "stages": 2, "transfer": "fast"}, ["transfer"]),
    ({"costs": [1, 1], "stages": 0}, ["stages must be >= 1"]),
    ({"costs": [], "stages": 1}, ["empty"]),
    ({"costs": [1, 2], "stages": 1, "cost": [1]}, ["unknown problem keys"]),
    ({"stages": 1}, ["missing 'costs'"]),
    ([1, 2, 3], ["must be an object"]),
    ("costs", ["must be an object"]),
])
def test_balance_bad_values_name_the_field(tmp_path, doc, needles):
    bal_bad(tmp_path, doc, *needles)


@pytest.mark.parametrize("raw,needle", [
    ('{"costs": [NaN, 1], "stages": 1}', "NaN is not a JSON number"),
    ('{"costs": [Infinity, 1], "stages": 1}', "Infinity is not a JSON number"),
    ('{"costs": [1e400, 1], "stages": 1}', "overflows a 64-bit float"),
    ('{"costs": [1, 2], "stages": ', "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"costs": [' + "1" * 5000 + '], "stages": 1}', "too many digits"),
])
def test_balance_rejects_what_is_not_strict_json(tmp_path, raw, needle):
    bal_bad(tmp_path, None, needle, raw=raw)


def test_balance_unreadable_and_oversized_input(tmp_path, monkeypatch):
    assert_bad(call(balance_cli.main, ["--input", str(tmp_path / "nope.json")]), "dynmo balance", "cannot read")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    assert_bad(call(balance_cli.main, ["--input", str(tmp_path / "bin.json")]), "dynmo balance", "not UTF-8")
    bal_bad(tmp_path, None, "MAX_INPUT_ITEMS", raw="[" + "[]," * jsonio.MAX_INPUT_ITEMS + "0]")
    monkeypatch.setattr(jsonio, "MAX_INPUT_BYTES", 64)
    bal_bad(tmp_path, {"costs": [1.0] * 40, "stages": 2}, "MAX_INPUT_BYTES = 64")


def test_balance_limits_are_checked_before_any_work(tmp_path):
    n = balance_cli.MAX_LAYERS + 1
    bal_bad(tmp_path, {"costs": [1] * n, "stages": 2}, "MAX_LAYERS", str(n))
    bal_bad(tmp_path, {"costs": [1] * 10, "stages": balance_cli.MAX_STAGES + 1}, "MAX_STAGES")
    bal_bad(tmp_path, {"costs": [1] * 100_000, "stages": 1_000}, "MAX_LAYER_STAGES", "100000000")


def test_deepspeed_is_bounded_by_layers_squared_times_stages(tmp_path):
    # the 10^6-layer input that grew past 17 GB, and one just within MAX_LAYERS but not within DeepSpeed's work limit
    bal_bad(tmp_path, {"costs": [1.0] * 1_000_000, "stages": 4}, "MAX_LAYERS", args=("--balancer", "deepspeed"))
    err = bal_bad(tmp_path, {"costs": [1.0] * 40_000, "stages": 1}, "DEEPSPEED_MAX_WORK",
                  args=("--balancer", "deepspeed"))
    assert "1.6e+09" in err
    with pytest.raises(BalanceError, match="DEEPSPEED_MAX_WORK"):  # the Python API refuses it too
        balance(Problem(costs=[1.0] * 40_000, stages=1), "deepspeed")
    assert 1_000 ** 2 * 1_000 <= DEEPSPEED_MAX_WORK  # a thousand layers on a thousand stages is allowed


@pytest.mark.parametrize("args,needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--tolerance", "x"], "invalid float value"),
    (["--tolerance", "nan", "--repack"], "--tolerance must be a finite number"),
    (["--tolerance", "-1", "--repack"], "--tolerance must be >= 0"),
    (["--target", "2.5", "--repack", "--balancer", "firstfit"], "invalid int value"),
    (["--target", "0", "--repack", "--balancer", "firstfit"], "--target must be >= 1"),
    (["--target", "1"], "--target is for --repack --balancer firstfit"),
    (["--balancer", "nope"], "unknown balancer"),
    (["--repack", "--balancer", "uniform"], "--repack takes"),
])
def test_balance_bad_flags_are_one_line_too(tmp_path, args, needle):
    bal_bad(tmp_path, {"costs": [1, 2, 3, 4], "stages": 2}, needle, args=args)


def test_balance_missing_input_flag_and_help(tmp_path):
    assert_bad(call(balance_cli.main, []), "dynmo balance", "--input")
    rc, out, _ = call(balance_cli.main, ["--help"])
    assert rc == 0 and "--balancer" in out


def test_balance_reads_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"costs": [1, 1], "stages": 2}')))
    rc, out, _ = call(balance_cli.main, ["--input", "-"])
    assert rc == 0 and _strict(out)["boundaries"] == [0, 1, 2]


# ---- dynmo simulate --input ---------------------------------------------------------------

GOOD = {"fwd": [1.0, 1.0], "bwd": [2.0, 2.0], "microbatches": 4}


def test_simulate_good_input_prints_strict_json(tmp_path):
    rc, out, err = simulate_run(tmp_path, GOOD, "--indent", "0")
    assert rc == 0 and err == "" and _strict(out)["iteration_time"] > 0


@pytest.mark.parametrize("doc,needles", [
    (GOOD | {"microbatches": 1e8}, ["microbatches must be an integer", "100000000.0"]),
    (GOOD | {"microbatches": 100_000_000}, ["MAX_MICROBATCHES", "100000000"]),
    (GOOD | {"microbatches": 2.5}, ["microbatches must be an integer"]),
    (GOOD | {"microbatches": True}, ["microbatches must be an integer", "boolean"]),
    (GOOD | {"microbatches": 0}, ["microbatches must be >= 1"]),
    ({"fwd": [1.0] * 4000, "bwd": [1.0] * 4000, "microbatches": 1000}, ["MAX_STAGE_MICROBATCHES"]),
    ({"fwd": [1.0] * 5000, "bwd": [1.0] * 5000, "microbatches": 1}, ["MAX_STAGES"]),
    ({"fwd": [1.0] * 2000, "bwd": [1.0] * 2000, "microbatches": 2, "schedule": "ZBVZeroBubble",
      "stages_per_rank": 2}, ["ZBVZeroBubble plans", "MAX_STAGE_MICROBATCHES"]),
    (GOOD | {"fwd": [1e308, 1e308], "bwd": [1e308, 1e308]}, ["overflow", "rescale"]),
    (GOOD | {"fwd": ["1", 1.0]}, ["fwd[0] must be a number"]),
    (GOOD | {"fwd": [True, 1.0]}, ["fwd[0] must be a number", "boolean"]),
    (GOOD | {"fwd": [[1.0], 1.0]}, ["mixes numbers and lists"]),
    (GOOD | {"fwd": [[1.0, 1.0], [1.0]]}, ["per-microbatch times"]),
    (GOOD | {"fwd": "junk"}, ["fwd must be a non-empty list"]),
    (GOOD | {"fwd": []}, ["fwd must be a non-empty list"]),
    (GOOD | {"fwd": {"a": 1}}, ["fwd must be a non-empty list"]),
    (GOOD | {"bwd": [1.0, -1.0]}, ["bwd[1] must be >= 0"]),
    (GOOD | {"comm": {"fwd": "x"}}, ["comm.fwd"]),
    (GOOD | {"comm": [None]}, ["comm[0]"]),
    (GOOD | {"schedule": 5}, ["schedule must be a string"]),
    (GOOD | {"schedule": "pipedream"}, ["unknown schedule"]),
    (GOOD | {"dp": 0}, ["dp must be >= 1"]),
    (GOOD | {"dp": 10**9}, ["MAX_DP"]),
    (GOOD | {"dp": 2, "grad_bytes": [1, 1], "bandwidth": 0}, ["bandwidth must be > 0"]),
    (GOOD | {"latency": float("inf")}, ["Infinity is not a JSON number"]),
    (GOOD | {"p2p": ["eager"]}, ["p2p must be one of"]),
    (GOOD | {"allreduce_mode": "sometimes"}, ["allreduce_mode must be one of"]),
    (GOOD | {"stages_per_rank": 3}, ["stages_per_rank"]),
    ({"fwd": [1.0]}, ["missing 'bwd'"]),
    ({"fwd": [1.0], "bwd": [1.0]}, ["microbatches must be given"]),
    (GOOD | {"stage": 3}, ["unknown keys"]),
    ([1, 2], ["JSON object"]),
])
def test_simulate_bad_values_name_the_field(tmp_path, doc, needles):
    sim_bad(tmp_path, doc, *needles)


def test_simulate_ops_output_has_its_own_limit(tmp_path):
    doc = {"fwd": [1.0] * 1000, "bwd": [1.0] * 1000, "microbatches": 300}
    sim_bad(tmp_path, doc, "MAX_OPS_STAGE_MICROBATCHES", "--ops", args=("--ops",))


@pytest.mark.parametrize("args,needle", [
    (["--microbatches", "1e8"], "invalid int value"),
    (["--microbatches", "100000000"], "MAX_MICROBATCHES"),
    (["--indent", "100"], "--indent"),
    (["--p2p", "carrier-pigeon"], "invalid choice"),
    (["--nope"], "unrecognized arguments"),
])
def test_simulate_bad_flags_are_one_line(tmp_path, args, needle):
    sim_bad(tmp_path, GOOD, needle, args=args)


def test_simulate_needs_a_source():
    assert_bad(call(sim_cli.main, []), "dynmo simulate", "--input", "--trace")


# ---- dynmo simulate --trace -----------------------------------------------------------------


def _header(n: int = 6, **kw) -> dict:
    h = TraceHeader(layers=["embed"] + [f"block{i}" for i in range(n - 2)] + ["head"],
                    kinds=["E"] + ["t"] * (n - 2) + ["L"], params=[1000] * n, layer_bytes=[16000] * n,
                    microbatches=4, pp=2, dp=1, schedule="1f1b", tokens_per_microbatch=64,
                    config={"model": {"seq_len": 16}})
    return h.as_dict() | kw


def _steps(k: int = 4, n: int = 6) -> list[dict]:
    return [TraceStep(i, [0.01 + 0.001 * j for j in range(n)], [0.02] * n,
                      events=[{"type": "dynamism"}] if i == 2 else []).as_dict() for i in range(k)]


def write_trace(path: Path, header, steps) -> Path:
    path.write_text("\n".join(json.dumps(d) for d in [header, *steps]) + "\n")
    return path


def replay_run(path: Path, *args: str):
    return call(sim_cli.main, ["--trace", str(path), "--policies", "uniform,optimal,oracle", *args])


def replay_bad(path: Path, *needles: str, args=()):
    return assert_bad(replay_run(path, *args), "dynmo simulate", *needles)


def test_replay_good_trace(tmp_path):
    p = write_trace(tmp_path / "t.jsonl", _header(), _steps())
    rc, out, err = replay_run(p, "--json", "--indent", "0")
    assert rc == 0, err
    assert [r["policy"] for r in _strict(out)["policies"]] == ["uniform", "optimal", "oracle"]
    rc, out, err = replay_run(p)
    assert rc == 0 and "oracle" in out


@pytest.mark.parametrize("header,needles", [
    (_header(microbatches=0), ["line 1", "microbatches must be >= 1"]),
    (_header(microbatches=2.5), ["microbatches must be an integer"]),
    (_header(microbatches=10**9), ["microbatches", "over the limit"]),
    (_header(pp=True), ["pp must be an integer"]),
    (_header(dp=-1), ["dp must be >= 1"]),
    (_header(layers="abc"), ["layers must be a non-empty list"]),
    (_header(layers=[1, 2, 3, 4, 5, 6]), ["layer names"]),
    (_header(kinds=["E"]), ["kinds has 1 entries"]),
    (_header(params=[1.5] * 6), ["params[0]"]),
    (_header(params=[-1] * 6), ["params[0]"]),
    (_header(layer_bytes="x"), ["layer_bytes"]),
    (_header(schedule=3), ["schedule must be a string"]),
    (_header(config=[]), ["config must be a JSON object"]),
    (_header(config={"model": 3}), ["config.model"]),
    (_header(config={"model": {"seq_len": "long"}}), ["seq_len"]),
    (_header(tokens_per_microbatch=-5), ["tokens_per_microbatch"]),
    (_header(version="1"), ["version must be an integer"]),
    (_header(version=2), ["newer"]),
    (_header(format="other"), ["not a dynmo trace"]),
    ([1, 2], ["must be a JSON object"]),
])
def test_replay_bad_headers(tmp_path, header, needles):
    replay_bad(write_trace(tmp_path / "t.jsonl", header, _steps()), *needles)


def _mutate(k: int, **kw) -> list[dict]:
    steps = _steps()
    steps[k] = steps[k] | kw
    return steps


@pytest.mark.parametrize("steps,needles", [
    (_mutate(1, events="junk"), ["line 3", "events must be a list of JSON objects"]),
    (_mutate(1, events=[1, 2]), ["events must be a list of JSON objects"]),
    (_mutate(1, fwd="junk"), ["fwd must be a list"]),
    (_mutate(1, fwd=[0.1] * 5), ["fwd has 5 values for 6 layers"]),
    (_mutate(1, fwd=[True] * 6), ["fwd[0] = True is not a number"]),
    (_mutate(1, bwd=[-0.1] * 6), ["finite and >= 0"]),
    (_mutate(1, bwd=[10**400] * 6), ["finite and >= 0"]),
    (_mutate(1, step="x"), ["step must be an integer"]),
    (_mutate(1, microbatches=0), ["microbatches must be >= 1"]),
    (_mutate(1, microbatches=1.5), ["microbatches must be an integer"]),
    (_mutate(1, layout=[0, 2.5, 6]), ["layout"]),
    (_mutate(1, iteration_s="slow"), ["iteration_s"]),
    (_mutate(1, stats={"x": [1]}), ["stats"]),
    (_mutate(1, stats=[]), ["stats must be a JSON object"]),
    (_mutate(1, cost=[None] * 6), ["cost[0]"]),
    ([{"fwd": [0.1] * 6}], ["lacks ['bwd', 'step']"]),
    ([[0.1] * 6], ["a step must be a JSON object"]),
    ([], ["no steps"]),
])
def test_replay_bad_steps(tmp_path, steps, needles):
    replay_bad(write_trace(tmp_path / "t.jsonl", _header(), steps), *needles)


def test_replay_unreadable_and_malformed_files(tmp_path):
    replay_bad(tmp_path / "missing.jsonl", "cannot read trace")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    replay_bad(tmp_path / "empty.jsonl", "is empty")
    (tmp_path / "bad.jsonl").write_text(json.dumps(_header()) + "\n{not json\n")
    replay_bad(tmp_path / "bad.jsonl", "line 2 is not valid JSON")
    (tmp_path / "nan.jsonl").write_text(json.dumps(_header()) + "\n" + json.dumps(_mutate(0, fwd=[float("nan")] * 6)[0]) + "\n")
    replay_bad(tmp_path / "nan.jsonl", "NaN is not a JSON number")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\n")
    replay_bad(tmp_path / "bin.jsonl", "not UTF-8")


def test_replay_trace_limits(tmp_path, monkeypatch):
    p = write_trace(tmp_path / "t.jsonl", _header(), _steps(6))
    monkeypatch.setattr(trace_mod, "MAX_TRACE_BYTES", 500)
    replay_bad(p, "MAX_TRACE_BYTES = 500")
    monkeypatch.undo()
    monkeypatch.setattr(trace_mod, "MAX_TRACE_ITEMS", 30)
    replay_bad(p, "MAX_TRACE_ITEMS = 30")
    monkeypatch.undo()
    monkeypatch.setattr(trace_mod, "MAX_STEPS", 5)
    replay_bad(p, "MAX_STEPS = 5")
    monkeypatch.undo()
    monkeypatch.setattr(trace_mod, "MAX_TRACE_CELLS", 20)
    replay_bad(p, "MAX_TRACE_CELLS = 20")
    monkeypatch.undo()
    long = write_trace(tmp_path / "long.jsonl", _header(), _steps(50))
    replay_bad(long, "MAX_TRACE_CELLS", args=("--scale-blocks", str(trace_mod.MAX_LAYERS - 2)))
    replay_bad(p, "MAX_LAYERS", args=("--scale-blocks", str(trace_mod.MAX_LAYERS)))


def test_a_line_without_newlines_is_cut_at_the_byte_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_mod, "MAX_TRACE_BYTES", 1000)
    (tmp_path / "long.jsonl").write_text("[" + "0," * 10_000 + "0]")
    replay_bad(tmp_path / "long.jsonl", "MAX_TRACE_BYTES")


@pytest.mark.parametrize("args,needles", [
    (["--when", "every", "--every", "0"], ["--every must be >= 1"]),
    (["--when", "never"], ["--when must be one of"]),
    (["--window", "0"], ["--window must be >= 1"]),
    (["--window", str(10**12)], ["--window", "MAX_STEPS"]),
    (["--horizon", "0"], ["--horizon must be >= 1"]),
    (["--min-gain", "nan"], ["--min-gain must be a finite number"]),
    (["--repack-tolerance", "-1"], ["--repack-tolerance must be >= 0"]),
    (["--mig-bandwidth", "0"], ["--mig-bandwidth must be > 0"]),
    (["--mig-fixed", "inf"], ["--mig-fixed must be a finite number"]),
    (["--comm", "-1"], ["--comm must be >= 0"]),
    (["--op-overhead", "nan"], ["--op-overhead"]),
    (["--allreduce-bandwidth", "0"], ["--allreduce-bandwidth must be > 0"]),
    (["--allreduce-latency", "-1"], ["--allreduce-latency"]),
    (["--stages", "0"], ["--stages must be >= 1"]),
    (["--stages", "5000"], ["--stages", "MAX_STAGES"]),
    (["--stages", "7"], ["cannot split 6 layers into 7 stages"]),
    (["--stages-per-rank", "0"], ["--stages-per-rank must be >= 1"]),
    (["--dp", "0"], ["--dp must be >= 1"]),
    (["--microbatches", "0"], ["--microbatches must be >= 1"]),
    (["--microbatches", "100000000"], ["MAX_MICROBATCHES"]),
    (["--scale-blocks", "0"], ["--scale-blocks must be >= 1"]),
    (["--scale-blocks", "8", "--noise", "100"], ["--noise must be <= 5"]),
    (["--scale-blocks", "8", "--cost-scale", "0"], ["--cost-scale must be > 0"]),
    (["--scale-blocks", "8", "--params-scale", "1e300"], ["params_scale", "2^53"]),
    (["--scale-blocks", "8", "--cost-scale", "1.7e308"], ["overflow"]),
    (["--schedule", "pipedream"], ["unknown schedule"]),
    (["--policies", "bogus"], ["unknown policy"]),
    (["--policies", ","], ["--policies is empty"]),
    (["--indent", "-1"], ["--indent must be >= 0"]),
])
def test_replay_bad_flags(tmp_path, args, needles):
    replay_bad(write_trace(tmp_path / "t.jsonl", _header(), _steps()), *needles, args=args)


def test_replay_work_limits(tmp_path, monkeypatch):
    p = write_trace(tmp_path / "t.jsonl", _header(), _steps())
    monkeypatch.setattr(sim_cli, "MAX_REPLAY_OPS", 50)
    # uniform, optimal, oracle asked; params and profile-once replayed as best-static references
    replay_bad(p, "MAX_REPLAY_OPS", "5 policies x 4 steps x 2 stages x 4 microbatches")
    monkeypatch.undo()
    monkeypatch.setattr(sim_cli, "MAX_REPLAY_SERIES", 10)
    replay_bad(p, "MAX_REPLAY_SERIES")
    monkeypatch.undo()
    monkeypatch.setattr(sim_cli, "MAX_STAGE_MICROBATCHES", 4)
    replay_bad(p, "MAX_STAGE_MICROBATCHES")
    monkeypatch.undo()
    big = write_trace(tmp_path / "big.jsonl", _header(33_000), _steps(1, 33_000))
    assert_bad(call(sim_cli.main, ["--trace", str(big), "--policies", "params"]), "dynmo simulate",
               "DEEPSPEED_MAX_WORK", "leave it out of --policies")


def test_replay_output_files_that_cannot_be_written(tmp_path):
    p = write_trace(tmp_path / "t.jsonl", _header(), _steps())
    (tmp_path / "file").write_text("")
    replay_bad(p, "cannot write", args=("--save-trace", str(tmp_path / "file" / "t.jsonl")))


def _run_folder(tmp_path: Path, config: str, lines: list) -> Path:
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    (d / "config.toml").write_text(config)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return d


def _metrics(n: int = 6) -> dict:
    return {"step": 0, "layout": [0, 3, n], "layer_fwd_s": [0.01] * n, "layer_bwd_s": [0.02] * n,
            "layer_params": [100] * n, "events": [], "microbatches": 4}


CONFIG = '[model]\nn_layers = 4\nseq_len = 16\n[train]\nmicrobatches = 4\nglobal_batch = 8\n[parallel]\npp = 2\n'


@pytest.mark.parametrize("config,lines,needles", [
    (CONFIG, [_metrics()], []),
    ("[model\n", [_metrics()], ["not valid TOML"]),
    ('parallel = "x"\n[model]\nn_layers = 4\n', [_metrics()], ["config.toml", "wrong type"]),
    (CONFIG.replace("pp = 2", "pp = 0\nvirtual_stages = 0"), [_metrics()], ["config.toml"]),
    (CONFIG, [[1, 2]], ["metrics line must be a JSON object"]),
    (CONFIG, [_metrics() | {"layer_fwd_s": 5}], ["layer_fwd_s must be a list"]),
    (CONFIG, [_metrics() | {"layer_bwd_s": ["a"] * 6}], ["bwd[0]"]),
    (CONFIG, [_metrics() | {"events": "junk"}], ["events must be a list"]),
    (CONFIG, [_metrics() | {"step": "x"}], ["step must be an integer"]),
    (CONFIG, [_metrics() | {"microbatches": 2.5}], ["microbatches must be an integer"]),
    (CONFIG, [_metrics() | {"layer_params": [1.5] * 6}], ["layer_params[0]"]),
    (CONFIG.replace("n_layers = 4", "n_layers = 9"), [_metrics()], ["6 parameter counts for 11 layers"]),
])
def test_replay_of_a_run_folder_checks_its_files(tmp_path, config, lines, needles):
    d = _run_folder(tmp_path, config, lines)
    res = call(sim_cli.main, ["--trace", str(d), "--policies", "uniform,oracle"])
    if not needles:
        assert res[0] == 0, res
    else:
        assert_bad(res, "dynmo simulate", *needles)


# ---- through the `dynmo` entry point ----------------------------------------------------------


def _dynmo(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynmo.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_entry_point_exit_codes_and_one_line(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"costs": [1e308] * 3, "stages": 1}))
    p = _dynmo("balance", "--input", str(f))
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("dynmo balance: error: the costs overflow")
    p = _dynmo("simulate", "--input", "-", stdin='{"fwd": [1, 1], "bwd": [1, 1], "microbatches": 1e8}')
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.startswith("dynmo simulate: error: microbatches must be an integer")


# ---- properties: any JSON in, exit 0 with strict JSON or exit 2 with one line -----------------

_scalars = (st.none() | st.booleans() | st.integers(-3, 40) | st.sampled_from([2**63, -(2**70), 10**400])
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                     max_leaves=16)
_nums = st.lists(st.floats(0, 1e308) | st.integers(0, 10) | _scalars, min_size=0, max_size=6)
_PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli-limits")


def _outcome(res, prog: str) -> None:
    rc, out, err = res
    if rc == 0:
        _strict(out)
        assert "Traceback" not in err
    else:
        assert_bad(res, prog)


@_PROPS
@given(doc=st.one_of(
    _json,
    st.fixed_dictionaries({"costs": _nums, "stages": _scalars},
                          optional={k: _json | _nums for k in ("memory", "capacity", "speeds", "transfer", "current")}),
), balancer=st.sampled_from(["optimal", "deepspeed", "diffusion", "diffusion-contiguous", "uniform", "repack"]))
def test_balance_any_json_is_an_answer_or_one_line(scratch, doc, balancer):
    f = scratch / "problem.json"
    f.write_text(json.dumps(doc))
    args = ["--repack"] if balancer == "repack" else ["--balancer", balancer]
    _outcome(call(balance_cli.main, ["--input", str(f), *args]), "dynmo balance")


@_PROPS
@given(doc=st.one_of(
    _json,
    st.fixed_dictionaries({"fwd": _nums | st.lists(_nums, max_size=3), "bwd": _nums | st.lists(_nums, max_size=3)},
                          optional={k: _json | _nums for k in sorted(sim_cli.KEYS - {"fwd", "bwd"})}),
), ops=st.booleans())
def test_simulate_any_json_is_an_answer_or_one_line(scratch, doc, ops):
    f = scratch / "stages.json"
    f.write_text(json.dumps(doc))
    _outcome(call(sim_cli.main, ["--input", str(f), "--indent", "0", *(["--ops"] if ops else [])]), "dynmo simulate")


_HEADER_KEYS = sorted(_header())
_STEP_KEYS = ["step", "fwd", "bwd", "wgrad", "layout", "iteration_s", "step_s", "events", "stats", "microbatches",
              "state_bytes", "cost"]


@_PROPS
@given(where=st.sampled_from(["header", "step"]), key=st.sampled_from(_HEADER_KEYS + _STEP_KEYS), value=_json | _nums,
       drop=st.booleans())
def test_replay_any_corrupted_field_is_an_answer_or_one_line(scratch, where, key, value, drop):
    header, steps = _header(), _steps(3)
    target = header if where == "header" else steps[1]
    if drop:
        target.pop(key, None)
    else:
        target[key] = value
    p = write_trace(scratch / "t.jsonl", header, steps)
    res = call(sim_cli.main, ["--trace", str(p), "--policies", "uniform,optimal,params,optimal+repack,oracle",
                              "--json", "--indent", "0", "--no-decide-time"])
    _outcome(res, "dynmo simulate")
