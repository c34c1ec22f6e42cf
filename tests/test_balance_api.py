"""Validation, infeasibility messages, re-packing, the CLI, and the no-torch import rule."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo.balance import BalanceError, Problem, balance, repack
from dynmo.balance.cli import main as cli_main


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(costs=[1, -1], stages=1), r"costs\[1\]"),
        (dict(costs=[1, float("nan")], stages=1), r"costs\[1\]"),
        (dict(costs=[1, 2], stages=0), "at least 1 stage"),
        (dict(costs=[1, 2], stages=3), "non-empty"),
        (dict(costs=[], stages=1), "empty"),
        (dict(costs=[1, 2], stages=1, memory=[1]), "memory has 1"),
        (dict(costs=[1, 2], stages=2, speeds=[1]), "speeds has 1"),
        (dict(costs=[1, 2], stages=2, speeds=[1, 0]), r"speeds\[1\]"),
        (dict(costs=[1, 2], stages=2, memory=[1, 1], capacity=[1]), "capacity has 1"),
        (dict(costs=[1, 2], stages=2, capacity=3), "memory is not"),
        (dict(costs=[1, 2], stages=2, current=[0, 2]), "current layout"),
        (dict(costs=[1, 2], stages=2, current=[0, 2, 2]), "current layout"),
        (dict(costs=[1, 2], stages=2, transfer=[1, 2]), "transfer has 2"),
        (dict(costs="abc", stages=1), "list of numbers"),
    ],
)
def test_bad_input_is_a_clear_error(kw, msg):
    with pytest.raises(BalanceError, match=msg):
        Problem(**kw)


def test_infeasible_memory_names_the_tightest_constraint():
    with pytest.raises(BalanceError, match="layer 1 needs 9"):
        balance(Problem(costs=[1, 1, 1], stages=2, memory=[1, 9, 1], capacity=5))
    with pytest.raises(BalanceError, match="in total"):
        balance(Problem(costs=[1, 1, 1], stages=2, memory=[3, 3, 3], capacity=4))
    # totals fit (8 <= 8) but no contiguous split does: [2 | 2 2 2] needs 6 > 5, [2 2 | 2 2] 4 > 3
    with pytest.raises(BalanceError, match="contiguous"):
        balance(Problem(costs=[1, 1, 1, 1], stages=2, memory=[2, 2, 2, 2], capacity=[3, 5]))


def test_memory_blind_balancers_refuse_to_overfill():
    pr = Problem(costs=[1, 1, 1, 1], stages=2, memory=[4, 4, 1, 1], capacity=6)
    with pytest.raises(BalanceError, match="over its capacity"):
        balance(pr, "uniform")
    r = balance(pr, "optimal")
    assert r.boundaries == [0, 1, 4] and max(r.stage_memory) <= 6


def test_speeds_and_transfer_enter_the_load():
    pr = Problem(costs=[2, 2, 2, 2, 2, 2], stages=2, speeds=[2, 1], transfer=[1])
    r = balance(pr, "optimal")
    # stage 0: 8/2 + 1 = 5, stage 1: 4/1 = 4
    assert r.boundaries == [0, 4, 6] and r.stage_loads == [5.0, 4.0]
    # the gradient's send back is charged to its sender, stage 1: 6/2 + 1 = 4 vs 6/1 + 1.5
    pr = Problem(costs=[2, 2, 2, 2, 2, 2], stages=2, speeds=[2, 1], transfer=[1], transfer_back=[1.5])
    r = balance(pr, "optimal")
    assert r.boundaries == [0, 4, 6] and r.stage_loads == [5.0, 5.5]
    assert Problem(costs=[1] * 4, stages=3, transfer=[1, 2], transfer_back=[3, 4]).t.tolist() == [1, 5, 4]
    # a sub-pipeline keeps each kept worker's outgoing link, both ways
    sub = Problem(costs=[1] * 4, stages=3, transfer=[1, 2], transfer_back=[3, 4]).with_stages([0, 2])
    assert sub.t.tolist() == [1, 3]


def test_repack_releases_workers_within_tolerance():
    costs = [1.0] * 8
    pr = Problem(costs=costs, stages=8, current=list(range(9)))
    r = repack(pr, tolerance=0.0)
    assert r.released == [] and r.bottleneck == 1
    # total work shrank: 8 layers of 0.1 on 8 workers, bottleneck 0.1; tolerance 1.0 allows 0.2
    pr = Problem(costs=[0.1] * 8, stages=8, current=list(range(9)))
    r = repack(pr, tolerance=1.0)
    assert len(r.workers) == 4 and r.released == [4, 5, 6, 7]
    assert r.bottleneck == pytest.approx(0.2)
    assert {m.src for m in r.moves} >= {4, 5, 6, 7}


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 9), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.05, 0.5]))
def test_repack_is_the_fewest_workers_within_tolerance(p, seed, tol):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(p, 14))
    costs = rng.uniform(0.1, 2, n).tolist()
    mem = rng.integers(1, 4, n).tolist()
    pr = Problem(costs=costs, stages=p, memory=mem, capacity=float(sum(mem)) / p * 2.5)
    try:
        full = balance(pr).bottleneck
    except BalanceError:
        return
    r = repack(pr, tolerance=tol)
    k = len(r.workers)
    assert r.bottleneck <= full * (1 + tol) + 1e-9
    assert sorted(r.workers + r.released) == list(range(p))
    for j, w in enumerate(r.workers):
        assert r.stage_memory[j] <= pr.cap[w] + 1e-9
    if k > 1:  # one worker fewer is not good enough (identical workers: any k-1 subset)
        try:
            fewer = balance(pr.with_stages(list(range(k - 1)))).bottleneck
        except BalanceError:
            fewer = math.inf
        assert fewer > full * (1 + tol) + 1e-9
    try:  # first-fit starts from the current (uniform) layout, which may already over-fill
        ff = repack(pr, tolerance=tol, method="firstfit")
    except BalanceError as e:
        assert "over its capacity" in str(e)
        return
    assert sorted(ff.workers + ff.released) == list(range(p))
    for j, w in enumerate(ff.workers):
        assert ff.stage_memory[j] <= pr.cap[w] + 1e-9


def test_cli_prints_one_json_object(tmp_path, capsys):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"costs": [1, 2, 3, 4, 5, 6], "stages": 2, "current": [0, 3, 6]}))
    assert cli_main(["--input", str(f)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("balancer", "boundaries", "stage_loads", "bottleneck", "imbalance", "moves", "released", "seconds"):
        assert key in out
    assert out["boundaries"] == [0, 4, 6] and out["moves"] == [{"layer": 3, "from": 1, "to": 0}]
    assert cli_main(["--input", str(f), "--repack", "--tolerance", "1.0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["released"] == [1]


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"costs": [1, 2], "stages": 3}))
    assert cli_main(["--input", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-empty" in err and err.startswith("dynmo balance: error: ")
    assert cli_main(["--input", str(tmp_path / "missing.json")]) == 2
    f.write_text(json.dumps({"costs": [1, 2], "stages": 1}))
    assert cli_main(["--input", str(f), "--balancer", "nope"]) == 2
    assert "unknown balancer" in capsys.readouterr().err


def test_cli_verb_through_dynmo_entry_point(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"costs": [1, 1, 1, 1], "stages": 2}))
    out = subprocess.run([sys.executable, "-m", "dynmo.cli", "balance", "--input", str(f)],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["boundaries"] == [0, 2, 4]


def test_import_does_not_pull_in_torch():
    code = "import sys, dynmo.balance, dynmo.balance.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
