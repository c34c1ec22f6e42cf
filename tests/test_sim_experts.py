"""dynmo.sim.replay.experts: the expert-parallel replay's split, loads, policies and refusals."""

import copy
from pathlib import Path

import numpy as np
import pytest

from dynmo.balance.experts import static_placement
from dynmo.engine import SimInputError
from dynmo.sim.replay import experts as X
from dynmo.sim.replay.expert_policies import replay_experts
from dynmo.sim.trace import load_trace
from tests.conftest import load_benchmark

TRACES = Path(__file__).resolve().parents[1] / "docs" / "bench" / "traces"


@pytest.fixture(scope="module")
def moe():
    t = load_trace(TRACES / "moe-static.jsonl")
    t.steps = t.steps[:12]  # short: the tests are about behaviour
    return t


def test_refuses_a_trace_without_routing():
    with pytest.raises(SimInputError, match="moe_tokens_per_expert"):
        replay_experts(load_trace(TRACES / "dense-80.jsonl"), 2, 2, 2)


@pytest.mark.parametrize("ep, dp, match", [(3, 3, "does not divide the 8 experts"), (4, 2, "does not divide dp"),
                                           (0, 2, "ep must be")])
def test_refuses_bad_ep(moe, ep, dp, match):
    with pytest.raises(SimInputError, match=match):
        replay_experts(moe, 2, dp, ep)


@pytest.mark.parametrize("ep, opts, match", [(2, dict(extra_slots=1, copies=3), "copies = 3 do not fit: the 2 ranks have 2"),
                                             (8, dict(extra_slots=1, copies=9), "copies = 9 do not fit"),
                                             (2, dict(extra_slots=5, copies=1), "room for copies of at most 4 others")])
def test_refuses_copies_the_ranks_cannot_hold(moe, ep, opts, match):
    with pytest.raises(SimInputError, match=match):
        replay_experts(moe, 2, 8, ep, X.ExpertOptions(**opts))


@pytest.mark.parametrize("opts, match", [(dict(copies=2), "extra_slots"), (dict(split="x"), "split"),
                                         (dict(a2a_bandwidth=0), "a2a_bandwidth"), (dict(window=0), "window")])
def test_refuses_bad_options(moe, opts, match):
    with pytest.raises(SimInputError, match=match):
        replay_experts(moe, 2, 2, 2, X.ExpertOptions(**opts))


def test_fit_recovers_a_linear_cost():
    t = load_trace(TRACES / "moe-static.jsonl")
    t = copy.deepcopy(t)
    a, b = 0.004, 2e-6
    layers = X.moe_layers(t)
    for s in t.steps:
        for i in layers:
            c = a + b * X._rows_per_mb(s.stats, i)[0]
            s.fwd[i], s.bwd[i] = c / 3, 2 * c / 3
    fit = X.fit_split(t, layers)
    assert fit["usable"] and fit["a"] == pytest.approx(a) and fit["b"] == pytest.approx(b)
    assert fit["r2"] == pytest.approx(1.0)


def test_split_of_the_committed_traces_is_the_fit(moe):
    m = X._Model(moe, 2, 2, 2, X.ExpertOptions())
    assert m.split["used"] == "fit"
    assert 0 < m.split["expert_share_fit"] < 1 and 0 < m.split["expert_share_flops"] < 1
    assert np.all((m.share > 0) & (m.share < 1))
    forced = X._Model(moe, 2, 2, 2, X.ExpertOptions(split="flops"))
    assert forced.split["used"] == "flops" and not np.allclose(forced.share, m.share)


def test_one_rank_computes_the_real_rows_without_padding(moe):
    m = X._Model(moe, 2, 2, 1, X.ExpertOptions())
    k = 3
    f, bw, _ = m.layer_times(k, [static_placement(m.n, 1)] * len(m.layers), 0)
    for j, i in enumerate(m.layers):
        real = m.loads[k, j, 0].sum()  # one replica's assignments: no padding
        sh = m.share[k, j]
        want = m.fwd[k][i] * (1 - sh) + m.fwd[k][i] * sh * real / m.padded[k, j]
        assert f[i] == pytest.approx(want)
        assert f[i] < m.fwd[k][i]  # the traced layer was padded to its busiest expert
    others = [i for i in range(moe.num_layers) if i not in m.layers]
    assert np.allclose(f[others], m.fwd[k][others]) and np.allclose(bw[others], m.bwd[k][others])


def test_replica_loads_deterministic_under_a_seed(moe):
    a = X._Model(moe, 2, 4, 2, X.ExpertOptions(seed=5))
    b = X._Model(moe, 2, 4, 2, X.ExpertOptions(seed=5))
    c = X._Model(moe, 2, 4, 2, X.ExpertOptions(seed=6))
    assert np.array_equal(a.loads, b.loads) and not np.array_equal(a.loads, c.loads)
    # each replica draws one microbatch's assignments from the step's routing
    st = moe.steps[2].stats
    i = a.layers[0]
    assert a.loads[2, 0].sum(axis=1) == pytest.approx([st["moe_useful_rows"][i] / st["moe_forwards"][i]] * 4)
    r1 = replay_experts(moe, 2, 4, 2, X.ExpertOptions(seed=5))
    r2 = replay_experts(moe, 2, 4, 2, X.ExpertOptions(seed=5))
    assert r1.as_dict() == r2.as_dict()


def test_policies_and_their_bounds(moe):
    out = replay_experts(moe, 2, 4, 2, X.ExpertOptions(microbatches=4), variants={"every 1": {"every": 1}})
    s, d, o, w = (out.results[p] for p in ("static", "dynmo", "oracle", "every 1"))
    assert s.speedup == 1.0 and s.migrations == 0 and s.migration_s == 0
    # the oracle's step is never slower than static's, step by step, and costs nothing to move
    assert all(x <= y + 1e-12 for x, y in zip(o.iteration_s, s.iteration_s)) and o.migration_s == 0
    for r in (d, w):
        assert r.migrations == sum(1 for x in r.overhead_s if x > 0)
        assert (r.moved_bytes > 0) == (r.migrations > 0)
    assert out.layout[0] == 0 and out.layout[-1] == moe.num_layers


def test_one_decision_for_layout_and_placement(moe):
    """layouts = "dynmo": static runs the best static layout in hindsight, dynmo decides the layer
    layout (from the FLOP model's) and the placements, the oracle is never slower step by step
    than either, and dynmo's placements are the trainer's decisions (whole orders of the experts)."""
    from dynmo.sim.replay import expert_policies as P

    t = copy.deepcopy(moe)
    out = replay_experts(t, 4, 4, 2, X.ExpertOptions(microbatches=8), layouts="dynmo")
    s, d, o = (out.results[p] for p in ("static", "dynmo", "oracle"))
    assert out.shape["layouts"] == "dynmo" and len({tuple(x) for x in s.layouts}) == 1
    assert all(x <= min(y, z) + 1e-12 for x, y, z in zip(o.iteration_s, s.iteration_s, d.iteration_s))
    model = X._Model(t, 4, 4, 2, X.ExpertOptions(microbatches=8))
    static = P._static(model)
    best, _ = P.best_static_layout(model, 4)
    assert s.total_s == pytest.approx(P._total(model, static, best))
    assert d.layouts[0] == list(P.named_layout("flops", t.num_layers, 4, flops=P.trace_flops(t)).boundaries)
    assert all(sorted(e for r in p.rank_experts() for e in r) == list(range(8)) for step in d.orders for p in step)
    # held fixed, every policy runs the one layout
    fixed = replay_experts(t, 4, 4, 2, X.ExpertOptions(microbatches=8))
    assert all({tuple(x) for x in r.layouts} == {tuple(fixed.layout)} for r in fixed.results.values())
    with pytest.raises(SimInputError, match="layouts must be one of"):
        replay_experts(t, 4, 4, 2, layouts="both")


def test_a_migrating_moe_layer_ships_only_each_ranks_experts(moe):
    """Under expert parallelism a rank holds N / E experts of a MoE layer (and `extra_slots`
    copies): a layer migration ships the rest of the layer and those, from every rank at once,
    counted as the header counts a layer (16 B a parameter)."""
    for ep, slots in ((1, 0), (2, 0), (4, 0), (4, 1)):
        m = X._Model(moe, 2, 4, ep, X.ExpertOptions(extra_slots=slots))
        got, whole = m.layer_bytes(), moe.header.layer_bytes
        for i, b in enumerate(whole):
            want = b - (8 - 8 // ep - slots) * 16 * m.expert_params if i in m.layers else b
            assert got[i] == pytest.approx(want)
        assert all(g > 0 for g in got)
    assert m.expert_bytes == 12 * m.expert_params  # a re-placement ships weights and moments, no gradients


def test_the_replay_moves_experts_as_the_trainer_decides():
    """dynmo's re-placements in the replay are `ExpertBalancer`'s: at most one look every `every`
    steps, none before 2 x max(5, window) steps of evidence."""
    out = replay_experts(load_trace(TRACES / "moe-static.jsonl"), 2, 4, 2, X.ExpertOptions(microbatches=4, every=3))
    d = out.results["dynmo"]
    moved = [k for k, x in enumerate(d.overhead_s) if x > 0]
    assert moved and all(k % 3 == 0 and k >= 10 for k in moved) and len(moved) == d.migrations


def test_one_expert_per_rank_without_copies_ties():
    t = load_trace(TRACES / "moe-static.jsonl")
    t.steps = t.steps[:6]
    out = replay_experts(t, 2, 8, 8, X.ExpertOptions(microbatches=4))
    tot = [r.total_s for r in out.results.values()]
    assert max(tot) == pytest.approx(min(tot))  # every placement is a renaming: nothing to gain
    with_copies = replay_experts(t, 2, 8, 8, X.ExpertOptions(microbatches=4, extra_slots=1, copies=8))
    assert with_copies.results["oracle"].total_s < with_copies.results["static"].total_s


def test_all_to_all_counts_only_off_rank_rows(moe):
    m = X._Model(moe, 2, 2, 2, X.ExpertOptions(a2a_bandwidth=1.0))
    reps = np.array([[4, 0, 1, 0, 0, 0, 0, 3], [0, 2, 0, 0, 5, 0, 0, 0]], dtype=float)
    p = static_placement(8, 2)  # experts 0-3 on rank 0, 4-7 on rank 1
    # replica 0 sends 3 rows (expert 7) to rank 1; replica 1 sends 2 (expert 1) to rank 0
    assert m.a2a_s(reps, p) == pytest.approx(3 * m.d_model * m.elem_bytes)


def _bench():
    return load_benchmark("replay_experts")


def test_the_benchmark_prints_a_row_per_trace_and_degree(moe, tmp_path, capsys):
    moe.write(tmp_path / "moe.jsonl")
    bench = _bench()
    args = [str(tmp_path / "moe.jsonl"), "--ep", "2,4", "--blocks", "8", "--stages", "2", "--dp", "4",
            "--microbatches", "4"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "python benchmarks/replay_experts.py " + " ".join(args)
    rows = [line.split(" | ") for line in out if line.startswith("| moe |")]
    assert [r[1] for r in rows] == ["2", "4"]
    assert all(r[5] == "1.000" or float(r[5]) > 0 for r in rows)
    assert bench.main(args + ["--json"]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    assert [d["ep"] for d in doc] == [2, 4] and set(doc[0]["policies"]) == {"static", "dynmo", "oracle"}


@pytest.mark.parametrize("args, match", [
    ([str(TRACES / "dense-60.jsonl"), "--blocks", "8", "--stages", "2", "--dp", "2", "--ep", "2"], "moe_tokens_per_expert"),
    ([str(TRACES / "moe-static.jsonl"), "--blocks", "8", "--stages", "2", "--dp", "6", "--ep", "3"], "does not divide the 8"),
])
def test_the_benchmark_refuses_bad_input_in_one_line(args, match, capsys):
    assert _bench().main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]


def test_dynmo_simulate_replays_a_trace_with_expert_parallelism(moe, tmp_path, capsys):
    """`dynmo simulate --trace T --ep E`: the expert replay's table, or with --json its figures,
    the library's replay at that shape; the layer replay's options and a bad E are one line, exit 2."""
    from dynmo.sim.cli import main

    moe.write(tmp_path / "moe.jsonl")
    args = ["--trace", str(tmp_path / "moe.jsonl"), "--ep", "2", "--dp", "4", "--stages", "2", "--microbatches", "4",
            "--layouts", "dynmo"]
    assert main(args) == 0
    out = capsys.readouterr().out
    want = replay_experts(moe, 2, 4, 2, X.ExpertOptions(microbatches=4), layouts="dynmo")
    (row,) = [line.split(" | ") for line in out.splitlines() if line.startswith(f"| {tmp_path / 'moe.jsonl'} |")]
    assert row[1] == "2" and float(row[5]) == pytest.approx(want.results["dynmo"].speedup, abs=5e-4)
    assert main(args + ["--json"]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    assert doc["ep"] == 2 and doc["policies"]["static"]["total_s"] == pytest.approx(want.results["static"].total_s)
    for bad, match in ((["--policies", "uniform"], "--policies does not apply with --ep"),
                       (["--shard", "full"], "--shard does not apply with --ep"),
                       (["--ep", "3", "--dp", "6"], "does not divide the 8 experts"),
                       (["--copies", "5", "--extra-slots", "1"], "copies = 5 do not fit")):
        assert main(args + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0], err
    assert main(["--input", "x.json", "--ep", "2"]) == 2
    assert "--ep replays a trace: give --trace" in capsys.readouterr().err
