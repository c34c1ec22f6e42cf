"""The bytes that cross each cut: a boundary between a block's halves ships the block's carry
beside the hidden state and the mask, and the balancers and the controller charge each
layout's cuts for it."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo.balance import BALANCERS, EPS, BalanceError, Problem, balance, cut_factors, repack
from dynmo.balance.cuts import CutSolver
from dynmo.config import BalanceConfig
from dynmo.controller import Controller
from dynmo.controller.steptime import StepModel
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.record import StepRecord

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
        if contiguous:
            assert r.bottleneck <= other.bottleneck * (1 + 1e-9) + 1e-9


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
