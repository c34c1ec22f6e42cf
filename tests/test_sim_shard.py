"""Sharding over the data-parallel replicas in the simulator and the trace replay. `parallel.shard =
"optimizer"`: migrations ship the sharded bytes, each step adds the parameter all-gather after the
optimizer step (only where the data-parallel all-reduce is modelled). `"full"`: migrations ship 16/dp
bytes a parameter, and (with a bandwidth) each forward op adds its units' all-gathers, each backward op
their all-gathers and reduce-scatters, with no all-reduce. `shard = "none"` replays as before."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynmo.cli import main as dynmo_main
from dynmo.engine import SimInputError
from dynmo.layout import Layout
from dynmo.loop import BYTES_PER_PARAM, bytes_per_param
from dynmo.sim import StageTimes, build_plan, ring_allgather_time, simulate_plan
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
    for bad in ("zero3", "params", "", None):
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
    assert dynmo_main(base + ["--shard", "zero3"]) == 2
    assert "--shard must be one of none, optimizer, full" in capsys.readouterr().err


# ---- parallel.shard = "full" ------------------------------------------------------------------


def fsdp_s(lay, dp, bw, lat) -> list[float]:
    """One FSDP collective per stage of `lay`: each unit (layer) its own, (dp-1)/dp x 4 B a parameter
    / bw + lat, summed over the stage's units."""
    return [sum((dp - 1) / dp * 4 * PARAMS[j] / bw + lat for j in range(lay[i], lay[i + 1]))
            for i in range(len(lay) - 1)]


@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_full_sharding_ships_one_dp_th_of_the_bytes(measured, dp):
    """Weights, gradients and both moments split over dp: 16/dp bytes a parameter, 1/dp of the
    unsharded bytes (nearly free migrations, so both replays decide the same moves)."""
    assert bytes_per_param("full", dp) == BYTES_PER_PARAM / dp
    t = make_trace(measured)
    kw = dict(migration_bandwidth=2.0**40, migration_fixed_s=0.0)
    (plain,) = replay(t, 3, dp, ["optimal"], options(**kw))
    (full,) = replay(t, 3, dp, ["optimal"], options(shard="full", **kw))
    assert plain.migrations >= 1 and full.layouts == plain.layouts
    assert full.migration_s == plain.migration_s / dp
    runner = Runner(t, dp, ReplayOptions(shard="full"), 3)
    assert runner.prior_bytes == [16 * p // dp for p in PARAMS]
    want = [(16 * p + 16) / dp for p in PARAMS] if measured else runner.prior_bytes
    assert runner.layer_bytes(0) == want


def test_a_fully_sharded_runs_measured_bytes_are_taken_as_recorded():
    """A full run at dp 4 records 16/4 B a parameter: replayed full at dp 4 as recorded, unsharded
    4 times them, full at dp 8 half of them, optimizer-sharded at dp 4 (8 + 2) / 4 of them."""
    t = make_trace(measured=True, dp=4, shard="full")
    recorded = t.steps[0].state_bytes
    assert recorded == [4 * p + 16 for p in PARAMS]
    assert Runner(t, 4, ReplayOptions(shard="full"), 3).layer_bytes(0) == recorded
    assert Runner(t, 4, ReplayOptions(), 3).layer_bytes(0) == [x * 4.0 for x in recorded]
    assert Runner(t, 8, ReplayOptions(shard="full"), 3).layer_bytes(0) == [x * 0.5 for x in recorded]
    assert Runner(t, 4, ReplayOptions(shard="optimizer"), 3).layer_bytes(0) == [x * 2.5 for x in recorded]
    assert Runner(t, 1, ReplayOptions(shard="full"), 3).prior_bytes == t.header.layer_bytes


@pytest.mark.parametrize("dp", [2, 4])
def test_full_one_stage_grows_by_the_collectives_and_drops_the_all_reduce(dp):
    """One stage (no bubble): a step is m x (fwd + bwd), plus the all-reduce unsharded, plus per
    microbatch an all-gather in the forward and an all-gather and a reduce-scatter in the backward
    with full sharding -- and no all-reduce."""
    t = make_trace()
    bw, lat = 1e9, 1e-4
    lay = Layout((0, 10))

    def sim(**kw):
        return Runner(t, dp, options(allreduce_latency=lat, **kw), 1).simulate(3, lay)[0]

    compute = sim().iteration_time
    ar = 2 * (dp - 1) / dp * 4 * sum(PARAMS) / bw + lat
    (one,) = fsdp_s([0, 10], dp, bw, lat)
    assert sim(allreduce_bandwidth=bw).iteration_time == pytest.approx(compute + ar, rel=1e-12)
    full = sim(allreduce_bandwidth=bw, shard="full")
    assert full.iteration_time == pytest.approx(compute + 4 * 3 * one, rel=1e-12)
    assert full.compute_time == full.iteration_time  # nothing after the last backward: no all-reduce
    assert sim(shard="full").iteration_time == compute  # no bandwidth: nothing added


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
@pytest.mark.parametrize("dp", [2, 4])
def test_full_charges_the_collectives_inside_the_ops(schedule, dp):
    """Every replayed step equals the engine's run of the same stage times with each forward op
    longer by its stage's all-gather, each backward op by an all-gather and a reduce-scatter, and no
    all-reduce; each rank is busy m x 3 x its stages' collective longer than without them."""
    t = make_trace()
    bw, lat, m = 1e9, 1e-4, 4
    stages = 4 if schedule == "interleaved" else 3
    kw = dict(schedule=schedule, allreduce_latency=lat, migration_bandwidth=float("inf"))
    results = {r.policy: r for r in replay(t, stages, dp, ["uniform", "optimal"],
                                           options(allreduce_bandwidth=bw, shard="full", **kw))}
    runner = Runner(t, dp, options(**kw), stages)  # no bandwidth, unsharded: compute only
    fwd, bwd = t.fwd(), t.bwd()
    grew = False
    for res in results.values():
        for k, lay in enumerate(res.layouts):
            ag = np.asarray(fsdp_s(lay, dp, bw, lat))
            f = np.add.reduceat(fwd[k], lay[:-1])
            b = np.add.reduceat(bwd[k], lay[:-1])
            plan = runner.plan(stages)
            want = simulate_plan(plan, StageTimes.build(f + ag, b + 2 * ag, m), dp=dp, p2p="eager", split_bubble=False)
            assert res.iteration_s[k] == pytest.approx(want.iteration_time, rel=1e-12)
            base = runner.simulate(k, Layout(tuple(lay)))[0]
            per_rank = [sum(3 * m * ag[s] for s in range(stages) if plan.stage_rank[s] == r)
                        for r in range(plan.num_ranks)]
            full = Runner(t, dp, options(allreduce_bandwidth=bw, shard="full", **kw), stages).simulate(
                k, Layout(tuple(lay)))[0]
            assert full.busy_s == pytest.approx([x + y for x, y in zip(base.busy_s, per_rank)], rel=1e-12)
            grew |= full.iteration_time > base.iteration_time
    assert grew


def test_full_adds_nothing_without_bandwidth_or_replicas():
    t = make_trace()
    for dp, bw in ((4, None), (1, 1e9)):
        (a,) = replay(t, 3, dp, ["uniform"], options(allreduce_bandwidth=bw))
        (b,) = replay(t, 3, dp, ["uniform"], options(allreduce_bandwidth=bw, shard="full"))
        assert b.iteration_s == a.iteration_s
    assert Runner(t, 4, options(shard="full"), 3).fsdp_collective_s([0, 4, 7]) == 0.0


@pytest.mark.parametrize("schedule", ["zbv", "interleavedzb"])
def test_full_with_zero_bubble_schedules_is_refused(schedule):
    """As the runtime refuses them: their separate weight-gradient pass runs after FSDP's reduce-scatter."""
    with pytest.raises(SimInputError, match="zero-bubble"):
        replay(make_trace(), 4, 2, ["uniform"], options(shard="full", schedule=schedule))


def simulate_full(tmp_path, t, *args: str) -> list[str]:
    """`dynmo simulate` arguments replaying trace `t` (written under tmp_path) on 3 x 4, fully sharded."""
    path = tmp_path / "t.jsonl"
    t.write(path)
    return ["simulate", "--trace", str(path), "--stages", "3", "--dp", "4", *args, "--no-decide-time", "--shard", "full"]


def test_cli_shard_full(tmp_path, capsys):
    base = simulate_full(tmp_path, make_trace(), "--policies", "uniform,optimal", "--when", "dynamism")
    assert dynmo_main(base) == 0
    out = capsys.readouterr().out
    assert "weights, gradients and optimizer state sharded over the 4 replicas (FSDP2)" in out
    assert ("not modelled: FSDP collectives: each unit's parameter all-gathers before its forward and its "
            "backward and its gradient reduce-scatter, per microbatch (give --allreduce-bandwidth bytes/s)") in out
    assert "all-reduce" not in out and "per-worker memory" in out
    assert dynmo_main(base + ["--allreduce-bandwidth", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "FSDP collectives:" not in out and "overlap of the FSDP collectives with compute" in out
    assert "what-if" not in out and "the traced run sharded fully" not in out
    assert dynmo_main(base + ["--json", "--indent", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["replay"]["shard"] == "full"
    assert dynmo_main(base + ["--schedule", "zbv", "--stages", "4"]) == 2
    assert "zero-bubble" in capsys.readouterr().err


def test_cli_shard_full_notes_what_the_runtime_refuses_and_a_full_trace(tmp_path, capsys):
    t = make_trace(dp=4, shard="full")
    t.header.case = "prune+freeze"
    base = simulate_full(tmp_path, t, "--policies", "uniform", "--allreduce-bandwidth", "1e9")
    assert dynmo_main(base) == 0
    out = capsys.readouterr().out
    assert "pruning and freezing with parallel.shard = \"full\": the runtime does not run it yet (a what-if)" in out
    assert "the traced run sharded fully at dp 4" in out
