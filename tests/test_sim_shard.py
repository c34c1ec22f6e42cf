"""Sharded optimizer state (`parallel.shard = "optimizer"`) in the simulator and the trace replay:
migrations ship the sharded bytes, each step adds the parameter all-gather after the optimizer
step (only where the data-parallel all-reduce is modelled), and `shard = "none"` replays as before."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynmo.cli import main as dynmo_main
from dynmo.layout import Layout
from dynmo.loop import BYTES_PER_PARAM, bytes_per_param
from dynmo.sim import StageTimes, build_plan, ring_allgather_time, simulate_plan
from dynmo.sim.engine import SimInputError
from dynmo.sim.replay import ReplayOptions, replay, replay_balance
from dynmo.sim.replay.runner import Runner
from dynmo.sim.trace import Trace, TraceHeader, TraceStep, TraceWriter

PARAMS = [4096] + [1024 * (i + 1) for i in range(8)] + [4096]  # multiples of 16: every factor below is exact


def make_trace(measured: bool = False, dp: int = 1, shard: str | None = None) -> Trace:
    """10 layers, 8 steps: blocks 0-2 four times as costly from step 2, block 5 three times from
    step 5 (both announced as dynamism); with `measured`, each step carries state bytes as a run
    records them, bytes_per_param x params + 16 (AdamW's step counts); `shard`, `dp`: the traced run's."""
    costs = np.ones((8, 10)) * 0.01
    costs[2:, 1:4] *= 4
    costs[5:, 6] *= 3
    par = {"schedule": "1f1b"} | ({"shard": shard} if shard else {})
    cfg = {"model": {"n_layers": 8, "seq_len": 16}, "train": {"global_batch": 32, "microbatches": 4}, "parallel": par}
    h = TraceHeader.from_config(cfg, PARAMS, 2, dp)
    sb = None
    if measured:
        sb = [bytes_per_param(shard or "none", dp) * p + 16 for p in PARAMS]
    steps = [TraceStep(k, (c / 3).tolist(), (2 * c / 3).tolist(), state_bytes=sb,
                       events=[{"type": "dynamism"}] if k in (2, 5) else []) for k, c in enumerate(costs)]
    return Trace(h, steps)


def options(**kw) -> ReplayOptions:
    return ReplayOptions(**({"balance": replay_balance(when="dynamism"), "migration_bandwidth": 1e8,
                             "migration_fixed_s": 0.05, "charge_decide": False} | kw))


# What the replay gave before sharding existed (the same code with no `shard`), per (measured state
# bytes, allreduce bandwidth), policy: total seconds, migration seconds, migrations, final layout.
BEFORE = {
    (False, None): {"uniform": (3.539999999999999, 0.0, 0, [0, 4, 7, 10]),
                    "optimal": (3.3629491200000006, 0.05294912, 1, [0, 3, 4, 10]),
                    "oracle": (2.9500000000000006, 0.0, 0, [0, 2, 4, 10])},
    (False, 1e9): {"uniform": (3.5412915199999997, 0.0, 0, [0, 4, 7, 10]),
                   "optimal": (3.3641853439999996, 0.05294912, 1, [0, 3, 4, 10]),
                   "oracle": (2.9511440640000006, 0.0, 0, [0, 2, 4, 10])},
    (True, None): {"uniform": (3.539999999999999, 0.0, 0, [0, 4, 7, 10]),
                   "optimal": (3.3629497600000007, 0.052949760000000005, 1, [0, 3, 4, 10]),
                   "oracle": (2.9500000000000006, 0.0, 0, [0, 2, 4, 10])},
    (True, 1e9): {"uniform": (3.5412915199999997, 0.0, 0, [0, 4, 7, 10]),
                  "optimal": (3.3641859839999997, 0.052949760000000005, 1, [0, 3, 4, 10]),
                  "oracle": (2.9511440640000006, 0.0, 0, [0, 2, 4, 10])},
}


@pytest.mark.parametrize("measured,bandwidth", list(BEFORE))
def test_shard_none_replays_exactly_as_before(measured, bandwidth):
    for kw in ({}, {"shard": "none"}):
        results = replay(make_trace(measured), 3, 4, ["uniform", "optimal", "oracle"],
                         options(allreduce_bandwidth=bandwidth, allreduce_latency=1e-4, **kw))
        got = {r.policy: (r.total_s, r.migration_s, r.migrations, r.layouts[-1]) for r in results}
        assert got == BEFORE[(measured, bandwidth)]


@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_sharding_lowers_migration_bytes_by_the_expected_factor(measured, dp):
    """(8 + 8/dp) / 16 of the bytes: weights and gradients whole, the AdamW moments split over dp.
    Migrations are nearly free (2^40 B/s, no fixed cost), so both replays decide the same moves and
    their seconds are bytes / 2^40 exactly."""
    factor = bytes_per_param("optimizer", dp) / BYTES_PER_PARAM
    assert factor == 0.5 + 0.5 / dp
    t = make_trace(measured)
    kw = dict(migration_bandwidth=2.0**40, migration_fixed_s=0.0)
    (plain,) = replay(t, 3, dp, ["optimal"], options(**kw))
    (sharded,) = replay(t, 3, dp, ["optimal"], options(shard="optimizer", **kw))
    assert plain.migrations >= 1 and sharded.layouts == plain.layouts
    assert sharded.migration_s == plain.migration_s * factor
    lays = [Layout(tuple(b)) for b in plain.layouts]
    moved = [m for old, new in zip(lays, lays[1:]) for m in old.moves_to(new)]
    unsharded = sum(16 * PARAMS[m.layer] + (16 if measured else 0) for m in moved)
    assert plain.migration_s * 2.0**40 == unsharded
    # the per-layer bytes the DynmoLoop and the migrations see
    runner = Runner(t, dp, ReplayOptions(shard="optimizer"), 3)
    assert runner.prior_bytes == [int((8 + 8 / dp) * p) for p in PARAMS]
    want = [(16 * p + 16) * factor for p in PARAMS] if measured else runner.prior_bytes
    assert runner.layer_bytes(0) == want


def test_one_replica_or_no_sharding_ships_everything():
    t = make_trace()
    assert Runner(t, 1, ReplayOptions(shard="optimizer"), 3).prior_bytes == t.header.layer_bytes
    assert Runner(t, 4, ReplayOptions(), 3).prior_bytes == t.header.layer_bytes


def test_a_sharded_runs_measured_bytes_are_taken_as_recorded():
    """A trace of a sharded run at dp 4 already holds sharded state bytes: replayed sharded at dp 4
    they ship as recorded, unsharded 16/10 of them, sharded at dp 8 9/10 of them."""
    t = make_trace(measured=True, dp=4, shard="optimizer")
    recorded = t.steps[0].state_bytes
    assert recorded == [10 * p + 16 for p in PARAMS]
    assert Runner(t, 4, ReplayOptions(shard="optimizer"), 3).layer_bytes(0) == recorded
    assert Runner(t, 4, ReplayOptions(), 3).layer_bytes(0) == [x * 1.6 for x in recorded]
    assert Runner(t, 8, ReplayOptions(shard="optimizer"), 3).layer_bytes(0) == [x * 0.9 for x in recorded]
    # the header's layer_bytes stays the unsharded prior whatever the run's sharding
    assert t.header.layer_bytes == [16 * p for p in PARAMS]


@pytest.mark.parametrize("dp", [2, 4])
def test_the_all_gather_adds_its_modelled_time_after_the_all_reduce(dp):
    """With --allreduce-bandwidth, every step of a sharded replay is longer by the slowest rank's
    all-gather: (dp-1)/dp x 4 B per parameter of its stage / bandwidth + latency; nothing else moves."""
    t = make_trace()
    bw, lat = 1e9, 1e-4
    plain = {r.policy: r for r in replay(t, 3, dp, ["uniform", "optimal"], options(allreduce_bandwidth=bw,
                                                                                    allreduce_latency=lat))}
    sharded = {r.policy: r for r in replay(t, 3, dp, ["uniform", "optimal"],
                                           options(allreduce_bandwidth=bw, allreduce_latency=lat, shard="optimizer",
                                                   migration_bandwidth=float("inf")))}
    for policy in ("uniform", "optimal"):
        a, b = plain[policy], sharded[policy]
        for k, lay in enumerate(b.layouts):
            stage_params = [sum(PARAMS[lay[j]:lay[j + 1]]) for j in range(len(lay) - 1)]
            ag = max((dp - 1) / dp * 4 * n / bw + lat for n in stage_params)
            if lay == a.layouts[k]:
                assert b.iteration_s[k] == pytest.approx(a.iteration_s[k] + ag, rel=1e-12)
    # uniform never moves: the same layout every step, so every step grows
    lay = plain["uniform"].layouts[0]
    assert plain["uniform"].layouts == sharded["uniform"].layouts == [lay] * 8


def test_no_all_gather_without_allreduce_bandwidth_or_replicas():
    t = make_trace()
    for dp, bw in ((4, None), (1, 1e9)):
        (a,) = replay(t, 3, dp, ["uniform"], options(allreduce_bandwidth=bw))
        (b,) = replay(t, 3, dp, ["uniform"], options(allreduce_bandwidth=bw, shard="optimizer"))
        assert b.iteration_s == a.iteration_s


@pytest.mark.parametrize("mode", ["overlap", "blocking"])
def test_engine_all_gather_starts_after_every_all_reduce(mode):
    """Two stages per rank (Interleaved1F1B, 2 ranks): a rank's stages' all-gathers run back to back,
    all starting when the last all-reduce of any rank has ended."""
    plan = build_plan("Interleaved1F1B", 2, 4, stages_per_rank=2)
    ar = [0.05, 0.02, 0.03, 0.04]
    base = StageTimes.build([0.01, 0.02, 0.01, 0.03], [0.02, 0.04, 0.02, 0.06], 4, allreduce=ar)
    ag = [0.010, 0.020, 0.040, 0.005]  # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    with_ag = StageTimes.build([0.01, 0.02, 0.01, 0.03], [0.02, 0.04, 0.02, 0.06], 4, allreduce=ar, allgather=ag)
    t0 = simulate_plan(plan, base, dp=2, allreduce_mode=mode).iteration_time
    r = simulate_plan(plan, with_ag, dp=2, allreduce_mode=mode)
    assert r.iteration_time == pytest.approx(t0 + max(0.010 + 0.040, 0.020 + 0.005), rel=1e-12)
    assert r.compute_time == simulate_plan(plan, base, dp=2, allreduce_mode=mode).compute_time
    zero = StageTimes.build([0.01, 0.02, 0.01, 0.03], [0.02, 0.04, 0.02, 0.06], 4, allreduce=ar, allgather=0.0)
    assert simulate_plan(plan, zero, dp=2, allreduce_mode=mode).iteration_time == t0


def test_ring_allgather_time():
    assert ring_allgather_time([4e8], 4, 1e9, 0.01).tolist() == pytest.approx([0.75 * 0.4 + 0.01], rel=1e-15)
    assert ring_allgather_time([4e8, 2e8], 1, 1e9, 0.01).tolist() == [0.0, 0.0]
    with pytest.raises(SimInputError):
        ring_allgather_time([1.0], 2, 0.0)


def test_bad_shard_is_refused():
    t = make_trace()
    for bad in ("full", "params", ""):
        with pytest.raises(SimInputError, match="shard"):
            replay(t, 3, 2, ["uniform"], ReplayOptions(shard=bad))


def test_cli_shard(tmp_path, capsys):
    t = make_trace()
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, t.header) as w:
        for s in t.steps:
            w.write_trace_step(s)
    base = ["simulate", "--trace", str(path), "--stages", "3", "--dp", "4", "--policies", "uniform,optimal",
            "--when", "dynamism", "--no-decide-time"]
    assert dynmo_main(base + ["--shard", "optimizer"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state sharded over the 4 replicas" in out
    assert "not modelled: data-parallel gradient all-reduce and the sharded optimizer's parameter all-gather" in out
    assert "reduce-scatter" in out
    assert dynmo_main(base + ["--allreduce-bandwidth", "1e9"]) == 0
    plain = capsys.readouterr().out
    assert "sharded" not in plain and "reduce-scatter" not in plain
    assert dynmo_main(base + ["--shard", "optimizer", "--json", "--indent", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["replay"]["shard"] == "optimizer"
    for bad, msg in (("full", "not modelled"), ("zero3", "--shard must be one of none, optimizer")):
        assert dynmo_main(base + ["--shard", bad]) == 2
        assert msg in capsys.readouterr().err
