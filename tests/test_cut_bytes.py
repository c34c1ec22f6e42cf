"""The bytes that cross each cut: a boundary between a block's halves ships the block's carry
beside the hidden state and the mask, and the balancers, the controller, the traces and the
replay charge each layout's cuts for it."""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo.balance import BALANCERS, EPS, BalanceError, Problem, balance, cut_factors, repack
from dynmo.balance.cuts import CutSolver
from dynmo.config import BalanceConfig, Config, apply_dict
from dynmo.controller import Controller
from dynmo.controller.steptime import StepModel
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.model.layers import half_carry, layer_specs
from dynmo.record import StepRecord
from dynmo.runtime.probe import boundary_bytes, edge_bytes
from dynmo.runtime.stage import example_io
from dynmo.sim.replay import ReplayOptions, replay
from dynmo.sim.replay.runner import Runner
from dynmo.sim.trace import Trace, TraceError, TraceHeader, TraceStep, load_trace, merge_units, scale_trace
from dynmo.sim.trace.from_metrics import recorded_boundary_bytes

from tests.conftest import metrics, run_train

MB, SEQ, D, ELEM = 2, 32, 64, 4
EDGE = MB * SEQ * (D + 1) * ELEM  # hidden state [mb, seq, d] + mask [mb, seq], fp32
HALVES = EDGE + MB * SEQ * D * ELEM  # ... + early exit's block input [mb, seq, d]


def sublayer_bytes(blocks: int) -> list[int]:
    """E, a m per block, L: the cut after each attention half carries the block input too."""
    return [EDGE] + [HALVES, EDGE] * blocks


# ---- the balancer --------------------------------------------------------------------------

# E, then 3 blocks of an attention half costing 3 and an MLP half costing 1, then L: the
# compute-balanced cut of 2 stages falls after block 1's attention half (8 | 6)
COSTS = [1, 3, 1, 3, 1, 3, 1, 1]
FACTORS = cut_factors(sublayer_bytes(3))


def test_cut_factors_are_bytes_over_the_smallest_cut():
    assert FACTORS == [1.0, HALVES / EDGE, 1.0, HALVES / EDGE, 1.0, HALVES / EDGE, 1.0]
    assert HALVES / EDGE == pytest.approx(2 * D / (D + 1) + 1 / (D + 1))  # an extra [mb, seq, d] tensor: ~2x
    assert cut_factors(None) is None


def test_a_cut_between_halves_costs_more_and_slow_links_move_it_to_a_block_edge():
    plain = balance(Problem(costs=COSTS, stages=2, transfer=2.0, transfer_back=2.0))
    assert plain.boundaries == [0, 4, 8]  # between block 1's halves: 8 + 2 | 6 + 2
    assert plain.bottleneck == 10.0
    slow = Problem(costs=COSTS, stages=2, transfer=2.0, transfer_back=2.0, cut_factor=FACTORS)
    rho = HALVES / EDGE
    # the same layout now pays its cut's bytes on both ends of the link
    assert slow.loads_of_assignment(Layout((0, 4, 8)).owner()) == [8 + 2 * rho, 6 + 2 * rho]
    r = balance(slow)
    assert r.boundaries in ([0, 3, 8], [0, 5, 8])  # a block edge: 5 + 2 | 9 + 2 (or 9 + 2 | 5 + 2)
    assert r.bottleneck == 11.0 < 8 + 2 * rho
    # fast links: the extra bytes cost less than the compute the block edge would unbalance
    fast = balance(Problem(costs=COSTS, stages=2, transfer=0.25, transfer_back=0.25, cut_factor=FACTORS))
    assert fast.boundaries == [0, 4, 8]
    assert fast.bottleneck == pytest.approx(8 + 0.25 * rho)
    # links that cost nothing: the factors change nothing
    assert balance(Problem(costs=COSTS, stages=2, cut_factor=FACTORS)).boundaries == [0, 4, 8]


def test_the_other_contiguous_balancers_and_repacking_charge_the_cuts():
    pr = Problem(costs=COSTS, stages=2, transfer=2.0, transfer_back=2.0, cut_factor=FACTORS, current=[0, 4, 8])
    for name in ("diffusion-contiguous", "diffusion"):
        r = balance(pr, name)
        assert r.stage_loads == pr.loads_of_assignment(r.assignment)
    # diffusion-contiguous lowers the variance of the loads: [0, 4, 8]'s are 2 apart, a block edge's 4
    assert balance(pr, "diffusion-contiguous").boundaries == [0, 4, 8]
    moved = balance(replace(pr, current=[0, 5, 8]), "diffusion-contiguous")
    assert moved.boundaries == [0, 4, 8] and moved.stage_loads == pr.loads_of_assignment(Layout((0, 4, 8)).owner())
    sub = pr.with_stages([0, 1])
    assert sub.r is not None and sub.r.tolist() == pr.r.tolist()
    r = repack(pr, tolerance=0.0)
    assert r.boundaries in ([0, 3, 8], [0, 5, 8]) and r.bottleneck == 11.0


def test_bad_cut_factors_are_a_clear_error():
    with pytest.raises(BalanceError, match="cut_factor has 2 entries, expected 7"):
        Problem(costs=COSTS, stages=2, transfer=1.0, cut_factor=[1.0, 2.0])
    with pytest.raises(BalanceError, match=r"cut_factor\[1\]"):
        Problem(costs=COSTS, stages=2, transfer=1.0, cut_factor=[1.0, -2.0, 1, 1, 1, 1, 1])
    assert Problem.from_dict({"costs": COSTS, "stages": 2, "transfer": 1.0, "cut_factor": FACTORS}).r is not None


@st.composite
def cut_problems(draw, max_layers=8):
    n = draw(st.integers(2, max_layers))
    p = draw(st.integers(2, n))
    cost = st.one_of(st.sampled_from([0.0, 1.0, 2.0, 3.0, 50.0]), st.floats(0, 10, allow_nan=False))
    kw: dict = {"costs": draw(st.lists(cost, min_size=n, max_size=n)), "stages": p,
                "transfer": draw(st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=p - 1, max_size=p - 1)),
                "cut_factor": draw(st.lists(st.sampled_from([1.0, 1.0, 0.5, 2.0, 3.5]), min_size=n - 1, max_size=n - 1))}
    if draw(st.booleans()):
        kw["transfer_back"] = draw(st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=p - 1, max_size=p - 1))
    if draw(st.booleans()):
        kw["memory"] = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
        kw["capacity"] = draw(st.one_of(st.integers(1, 14), st.lists(st.integers(1, 14), min_size=p, max_size=p)))
    if draw(st.booleans()):
        kw["speeds"] = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=p, max_size=p))
    if draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=p - 1, max_size=p - 1)))
        kw["current"] = [0, *cuts, n]
    return Problem(**kw)


def every_layout(pr: Problem) -> list[tuple[tuple[int, ...], float]]:
    """Every contiguous layout within the memory caps and its bottleneck (the load model)."""
    n, p = pr.num_layers, pr.stages
    out = []
    for cuts in itertools.combinations(range(1, n), p - 1):
        b = (0, *cuts, n)
        if all(pr.m[b[j]:b[j + 1]].sum() <= pr.cap[j] + 1e-9 for j in range(p)):
            out.append((b, max(pr.loads_of_assignment(Layout(b).owner()))))
    return out


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut_problems())
def test_optimal_with_cut_factors_matches_brute_force_with_fewest_moves(pr):
    layouts = every_layout(pr)
    if not layouts:
        with pytest.raises(BalanceError, match="infeasible"):
            balance(pr, "optimal")
        return
    best = min(mx for _, mx in layouts)
    r = balance(pr, "optimal")
    assert r.stage_loads == pr.loads_of_assignment(r.assignment)
    assert all(m <= c + 1e-9 for m, c in zip(r.stage_memory, pr.cap))
    tol = CutSolver(pr, []).btol if pr.r is not None else EPS * (pr.c.sum() / pr.s.min() + pr.t.max())
    assert best - 1e-12 <= r.bottleneck <= best + 2 * tol + 1e-12
    cur = pr.current_layout

    def fewest(slack):
        return min(len(cur.moves_to(Layout(b))) for b, mx in layouts if mx <= best + slack)

    assert fewest(2 * tol + 1e-12) <= len(r.moves) <= fewest(tol)
    for name, (_, contiguous) in BALANCERS.items():  # optimal is the best contiguous layout under the cuts too
        try:
            other = balance(pr, name)
        except BalanceError:
            continue
        assert other.stage_loads == pr.loads_of_assignment(other.assignment)
        if contiguous:  # within the tolerance optimal trades for fewer moves (above)
            assert r.bottleneck <= other.bottleneck + 2 * tol + 1e-9


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut_problems(max_layers=30), st.integers(0, 2**32 - 1))
def test_the_windows_keep_every_range_an_optimum_needs(pr, seed):
    """The exact dynamic programs read only the ranges an upper bound allows: from any start
    layout (here random ones) they give the B* of the unbounded programs."""
    if pr.r is None:
        return
    rng = np.random.default_rng(seed)
    n, p = pr.num_layers, pr.stages
    free = CutSolver(pr, [])
    B, bnd = free.min_bottleneck()
    starts = [[0, *sorted(rng.choice(np.arange(1, n), p - 1, replace=False).tolist()), n] for _ in range(2)]
    bounded = CutSolver(pr, starts + ([bnd] if bnd is not None else []))
    assert bounded.min_bottleneck()[0] == B
    if B < math.inf:
        cur = [(0, n)] + [(n, n)] * (p - 1)
        assert bounded.fewest_moves(B, cur) == free.fewest_moves(B, cur)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut_problems(max_layers=12), st.sampled_from(sorted(BALANCERS)))
def test_factors_all_one_are_no_factors_bit_for_bit(pr, name):
    ones = replace(pr, cut_factor=[1.0] * (pr.num_layers - 1))
    plain = replace(pr, cut_factor=None)
    assert ones.r is None
    for owner in (pr.current_layout.owner(), np.random.default_rng(0).integers(0, pr.stages, pr.num_layers)):
        assert ones.loads_of_assignment(owner) == plain.loads_of_assignment(owner)
    try:
        a = balance(plain, name).as_dict()
    except BalanceError as e:
        with pytest.raises(BalanceError, match=re.escape(str(e))):
            balance(ones, name)
        return
    b = balance(ones, name).as_dict()
    a.pop("seconds"), b.pop("seconds")
    assert a == b
    lay = pr.current_layout
    model = StepModel("1f1b")
    assert model.step_s(ones, lay, 4) == model.step_s(plain, lay, 4)


# ---- the controller ------------------------------------------------------------------------

def test_the_step_model_charges_each_link_its_cut():
    lay = Layout((0, 4, 8))  # between block 1's halves
    rho = HALVES / EDGE
    with_cuts = Problem(costs=COSTS, stages=2, transfer=2.0, transfer_back=1.0, cut_factor=FACTORS)
    by_hand = Problem(costs=COSTS, stages=2, transfer=2.0 * rho, transfer_back=1.0 * rho)
    model = StepModel("1f1b")
    assert model.step_s(with_cuts, lay, 4) == model.step_s(by_hand, lay, 4)
    edge = Layout((0, 3, 8))
    assert model.step_s(with_cuts, edge, 4) == model.step_s(replace(with_cuts, cut_factor=None), edge, 4)


def test_the_controller_prices_the_runtimes_cut_bytes_and_the_event_records_them():
    kw = dict(microbatches=4, transfer=[2.0], transfer_back=[2.0])
    c = Controller(BalanceConfig(when="every"), boundary_bytes=sublayer_bytes(3), **kw)
    pr = c.problem([float(x) for x in COSTS], 2, Layout((0, 4, 8)))
    assert pr.r is not None and pr.r[1:-1].tolist() == FACTORS
    assert c.problem([float(x) for x in COSTS], 2).r is not None
    plain = Controller(BalanceConfig(when="every"), **kw).problem([float(x) for x in COSTS], 2)
    assert plain.r is None
    loop = DynmoLoop(BalanceConfig(when="every", every=1, window=1), microbatches=4, schedule="1f1b",
                     layer_params=[1] * 8, transfer=[2.0], transfer_back=[2.0], boundary_bytes=sublayer_bytes(3))
    assert loop.boundary_bytes == sublayer_bytes(3)
    loop.observe(StepRecord(step=0, layout=[0, 4, 8], microbatches=4, layer_cost_s=[float(x) for x in COSTS]))
    d = loop.decide(1, Layout((0, 4, 8)), 100)
    assert d is not None and d.layout.boundaries in ((0, 3, 8), (0, 5, 8))
    assert loop.event(d, 0.0)["boundary_bytes"] == sublayer_bytes(3)


# ---- the runtime ---------------------------------------------------------------------------

def config(**sections) -> Config:
    cfg = Config()
    apply_dict(cfg, {"model": {"n_layers": 3, "d_model": D, "n_heads": 2, "seq_len": SEQ, "vocab_size": 128}} | sections)
    return cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sections", [
    {},
    {"parallel": {"unit": "sublayer"}},
    {"parallel": {"unit": "sublayer"}, "early_exit": {"enabled": True}},
    {"parallel": {"unit": "sublayer"}, "model": {"n_layers": 3, "d_model": D, "n_heads": 2, "seq_len": SEQ,
                                                 "vocab_size": 128, "block": "mod"}},
    {"parallel": {"unit": "sublayer"}, "early_exit": {"enabled": True},
     "model": {"n_layers": 3, "d_model": D, "n_heads": 2, "seq_len": SEQ, "vocab_size": 128, "block": "mod"}},
], ids=["block", "sublayer", "sublayer+early-exit", "sublayer+mod", "sublayer+mod+early-exit"])
def test_boundary_bytes_are_what_the_stage_examples_send(sections, dtype):
    """Per cut, the bytes of the tensors a stage ending there sends (`example_io`): the pure
    count the controller and the trace get is the pipeline's own."""
    cfg = config(**sections)
    specs = layer_specs(cfg.model, cfg.parallel.unit)
    elem = torch.empty(0, dtype=dtype).element_size()
    got = boundary_bytes(cfg, MB, elem)
    want = []
    for i in range(len(specs) - 1):
        carry = half_carry(cfg) if specs[i].part == "attn" else ()
        _, outs = example_io(False, False, MB, SEQ, D, 128, torch.device("cpu"), dtype, carry_out=carry)
        want.append(sum(t.numel() * t.element_size() for t in outs))
    assert got == want
    assert min(got) == edge_bytes(MB, SEQ, D, elem)  # what the link probe prices
    assert (len(set(got)) > 1) == (cfg.parallel.unit == "sublayer" and bool(half_carry(cfg)))


# ---- the trace -----------------------------------------------------------------------------

def trace_config(blocks: int, unit: str = "sublayer") -> dict:
    return {"model": {"n_layers": blocks, "d_model": D, "seq_len": SEQ, "vocab_size": 64},
            "train": {"global_batch": 4, "microbatches": 2}, "parallel": {"schedule": "1f1b", "unit": unit}}


def sublayer_trace(blocks: int, steps: int = 6, cuts: list[int] | None = None, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    n = 2 * blocks + 2
    header = TraceHeader.from_config(trace_config(blocks), rng.integers(1, 10_000, n).tolist(), 2, 1,
                                     boundary_bytes=cuts)
    steps_ = [TraceStep(k, rng.uniform(0.001, 0.01, n).tolist(), rng.uniform(0.002, 0.02, n).tolist())
              for k in range(steps)]
    return Trace(header, steps_)


def test_the_header_keeps_boundary_bytes_through_a_file(tmp_path):
    t = sublayer_trace(3, cuts=sublayer_bytes(3))
    t.write(tmp_path / "t.jsonl")
    first = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
    assert first["boundary_bytes"] == sublayer_bytes(3)
    assert load_trace(tmp_path / "t.jsonl").header.boundary_bytes == sublayer_bytes(3)
    old = sublayer_trace(3)  # a trace without the field writes none and reads as before
    old.write(tmp_path / "old.jsonl")
    assert "boundary_bytes" not in json.loads((tmp_path / "old.jsonl").read_text().splitlines()[0])
    assert load_trace(tmp_path / "old.jsonl").header == old.header


@pytest.mark.parametrize("bad,message", [
    ([EDGE] * 3, "boundary_bytes must be a list of 7 integers"),
    ([EDGE, 0] + [EDGE] * 5, r"boundary_bytes\[1\] = 0"),
    ([EDGE, 1.5] + [EDGE] * 5, r"boundary_bytes\[1\] = 1.5"),
    ("many", "boundary_bytes must be a list"),
])
def test_bad_boundary_bytes_say_what_is_wrong(tmp_path, bad, message):
    d = sublayer_trace(3).header.as_dict() | {"boundary_bytes": bad}
    with pytest.raises(TraceError, match=message):
        TraceHeader.from_dict(d)
    with pytest.raises(TraceError, match=message):
        TraceHeader.from_config(trace_config(3), [1] * 8, 2, 1, boundary_bytes=bad if isinstance(bad, list) else [bad])


def test_scaling_maps_each_cut_to_its_source_and_merging_drops_the_cuts_inside_blocks():
    cuts = [EDGE, HALVES, EDGE + 1, HALVES + 2, EDGE + 3, HALVES + 4, EDGE + 5]  # distinct, to follow each
    t = sublayer_trace(3, cuts=cuts)
    big = scale_trace(t, 6)
    # new block j comes from block j // 2: its attention cut and its MLP cut are the source's
    assert big.header.boundary_bytes == [cuts[0]] + [cuts[1 + 2 * (j // 2) + h] for j in range(6) for h in (0, 1)]
    big.header.check()
    m = merge_units(t)
    assert m.header.boundary_bytes == [EDGE, EDGE + 1, EDGE + 3, EDGE + 5]  # after E and after each MLP half
    m.header.check()
    assert merge_units(big).header.boundary_bytes == [EDGE] + [cuts[2 + 2 * (j // 2)] for j in range(6)]
    assert scale_trace(sublayer_trace(3), 6).header.boundary_bytes is None
    assert merge_units(sublayer_trace(3)).header.boundary_bytes is None


def test_a_converted_run_takes_the_bytes_its_controller_priced():
    steps = [TraceStep(0, [0.0] * 4, [0.0] * 4, events=[{"type": "dynamism"}]),
             TraceStep(1, [0.0] * 4, [0.0] * 4, events=[{"type": "migration", "boundary_bytes": [5, 9, 5]}])]
    assert recorded_boundary_bytes(steps, 4) == [5, 9, 5]
    assert recorded_boundary_bytes(steps, 5) is None  # another model's
    assert recorded_boundary_bytes(steps[:1], 4) is None


# ---- the replay ----------------------------------------------------------------------------

def test_the_replay_charges_each_layouts_cuts_their_bytes():
    cuts = sublayer_bytes(3)
    t = sublayer_trace(3, cuts=cuts)
    old = sublayer_trace(3)
    opts = ReplayOptions(comm=0.004)
    rho = HALVES / EDGE
    r_cuts, r_old = Runner(t, 1, opts, 2), Runner(old, 1, opts, 2)
    inside, edge = Layout((0, 4, 8)), Layout((0, 3, 8))
    assert r_cuts.cut_factor == cut_factors(cuts)
    assert r_old.cut_factor is None
    # a cut between blocks ships what the probe priced; one between halves rho times that
    assert r_cuts.iteration_s(0, edge) == r_old.iteration_s(0, edge)
    assert r_cuts.iteration_s(0, inside) > r_old.iteration_s(0, inside)
    by_hand = Runner(old, 1, replace(opts, comm=0.004 * rho), 2)
    assert r_cuts.iteration_s(0, inside) == by_hand.iteration_s(0, inside)
    # a link delay is a wait before each send: the same at every cut
    d = replace(opts, link_delay=[0.01])
    assert Runner(t, 1, d, 2).iteration_s(0, inside) - r_cuts.iteration_s(0, inside) == pytest.approx(
        Runner(old, 1, d, 2).iteration_s(0, inside) - r_old.iteration_s(0, inside), rel=1e-9, abs=1e-12)


def test_a_trace_without_boundary_bytes_or_with_equal_ones_replays_as_before():
    old = sublayer_trace(3, steps=8)
    same = sublayer_trace(3, steps=8, cuts=[EDGE] * 7)
    opts = ReplayOptions(comm=0.004, charge_decide=False)
    policies = ["uniform", "profile-once", "optimal", "oracle"]
    for a, b in zip(replay(old, 2, 1, policies, opts), replay(same, 2, 1, policies, opts)):
        assert (a.policy, a.iteration_s, a.layouts) == (b.policy, b.iteration_s, b.layouts)


# ---- one real run --------------------------------------------------------------------------

@pytest.mark.dist
def test_a_sublayer_early_exit_run_records_its_cut_bytes(tmp_path):
    """The launcher's run (7 to 19 s here): the trace header and the controller's migration
    events carry the bytes it priced, the pipeline's own (hidden state and mask, and the block
    input after an attention half); a converted run folder gets them back from the events.
    Injected costs, heavy on the first stage, make the controller move whatever this machine's
    speed."""
    out = tmp_path / "run"
    run_train(out, "--steps", "3", "--parallel.unit", "sublayer", "--early_exit.enabled", "true",
              "--balance.when", "every", "--balance.every", "1", "--log.trace", str(out / "t.jsonl"),
              env={"DYNMO_COSTS": "0:1,9,9,9,9,1,1,1,1,1"})
    want = [EDGE] + [HALVES, EDGE] * 4  # the tiny model: 4 blocks, d_model 64, seq 32, 2 sequences a microbatch
    assert load_trace(out / "t.jsonl").header.boundary_bytes == want
    events = [e for r in metrics(out) for e in r["events"] if e["type"] == "migration"]
    assert events and all(e["boundary_bytes"] == want for e in events)
    from dynmo.sim.trace import trace_from_metrics

    assert trace_from_metrics(out).header.boundary_bytes == want


def test_the_replayed_policies_balance_with_the_cut_factors():
    """profile-once (and so the oracles' and the DynMo loop's problems, built the same way) moves
    the cut to a block edge on slow links, as the balancer does."""
    from dynmo.sim.replay.policies import profile_once_layout

    assert profile_once_layout(COSTS, 2, [2.0], [2.0]).boundaries == (0, 4, 8)
    assert profile_once_layout(COSTS, 2, [2.0], [2.0], FACTORS).boundaries in ((0, 3, 8), (0, 5, 8))
