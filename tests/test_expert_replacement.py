"""Moving experts between the ranks of an expert-parallel group while training
(`parallel.replace_experts`, `dynmo.runtime.experts.apply_placement`).

Which rank holds an expert does not change its numbers: a run whose experts are re-placed
before a step trains bitwise like the run without it (losses, validation losses, gradient
norms), ends with bitwise the same checkpoint tensors, and a resume from a checkpoint saved
under a re-placed layout restores the placement. The bookkeeping (which rows go where) is
checked on many random placements, the exchange itself on spawned gloo processes against the
whole tensors, and bad settings are refused in one line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dynmo.checks import parse_replacements, validate
from dynmo.config import ConfigError
from dynmo.balance.experts import check_order, start_order
from dynmo.runtime.experts import moved_experts, plan_moves
from tests.conftest import metrics, run_train, spawn
from tests.reference import tiny_config
from tests.test_expert_parallel import flat, losses


# ---- the bookkeeping ---------------------------------------------------------------------------

def _apply(rows: list[list], plan: dict, ranks: int) -> list[list]:
    """What `plan_moves`' plan makes of per-rank rows (each row names its expert)."""
    L = len(rows[0])
    out = [[None] * L for _ in range(ranks)]
    for (src, dst), moves in plan.items():
        for e, s, d in moves:
            assert rows[src][s] == e
            assert out[dst][d] is None  # every slot filled once
            out[dst][d] = rows[src][s]
    return out


@pytest.mark.parametrize("experts,ranks", [(4, 2), (8, 2), (8, 4), (12, 3), (16, 8), (6, 6), (5, 1)])
def test_the_plan_puts_every_expert_in_its_new_slot_and_ships_only_those_whose_rank_changes(experts, ranks):
    rnd = random.Random(experts * 100 + ranks)
    L = experts // ranks
    for _ in range(200):
        old, new = list(range(experts)), list(range(experts))
        rnd.shuffle(old)
        rnd.shuffle(new)
        plan = plan_moves(old, new, ranks)
        rows = [old[q * L:(q + 1) * L] for q in range(ranks)]
        assert _apply(rows, plan, ranks) == [new[q * L:(q + 1) * L] for q in range(ranks)]
        travel = sorted(e for (a, b), m in plan.items() if a != b for e, _, _ in m)
        assert travel == moved_experts(old, new, ranks)
        assert travel == sorted(e for e in range(experts) if old.index(e) // L != new.index(e) // L)
        for moves in plan.values():  # each pair's rows in destination slot order: both ends agree
            assert [d for _, _, d in moves] == sorted(d for _, _, d in moves)
    start = start_order(experts, ranks)
    assert plan_moves(start, start, ranks) == {(q, q): [(q * L + j, j, j) for j in range(L)] for q in range(ranks)}
    with pytest.raises(ValueError, match="not placements of the same experts"):
        plan_moves(list(range(experts)), [0] * experts, ranks)


def _random_order(rnd: random.Random, experts: int, ranks: int, slots: int) -> list[int]:
    """A random placement with `slots` extra slots a rank: every expert once, then copies."""
    perm = list(range(experts))
    rnd.shuffle(perm)
    L = experts // ranks
    out = []
    for q in range(ranks):
        mine = perm[q * L:(q + 1) * L]
        mine += rnd.sample([e for e in range(experts) if e not in mine], slots)
        rnd.shuffle(mine)
        out += mine
    return out


@pytest.mark.parametrize("experts,ranks,slots", [(4, 2, 1), (4, 2, 2), (8, 4, 1), (8, 4, 3), (12, 3, 2), (6, 6, 1)])
def test_with_copies_the_plan_fills_every_slot_from_a_holder_and_ships_only_arrivals(experts, ranks, slots):
    rnd = random.Random(experts * 1000 + ranks * 10 + slots)
    K = experts // ranks + slots
    start = start_order(experts, ranks, slots)
    assert check_order(start, experts, ranks) == start and len(start) == ranks * K
    for _ in range(200):
        old, new = _random_order(rnd, experts, ranks, slots), _random_order(rnd, experts, ranks, slots)
        assert check_order(old, experts, ranks) == tuple(old)
        plan = plan_moves(old, new, ranks)
        rows = [old[q * K:(q + 1) * K] for q in range(ranks)]
        assert _apply(rows, plan, ranks) == [new[q * K:(q + 1) * K] for q in range(ranks)]
        arrive = {e for q in range(ranks) for e in new[q * K:(q + 1) * K] if e not in old[q * K:(q + 1) * K]}
        assert moved_experts(old, new, ranks) == sorted(arrive)
        shipped = [(e, b) for (a, b), m in plan.items() if a != b for e, _, _ in m]
        assert len(shipped) == len(set(shipped)) == sum(
            len(set(new[q * K:(q + 1) * K]) - set(old[q * K:(q + 1) * K])) for q in range(ranks))
    with pytest.raises(ValueError, match="give a rank"):
        plan_moves(start, start_order(experts, ranks), ranks) if slots else None


@pytest.mark.parametrize("order,message", [
    ([0, 1, 1, 2, 3, 3], "puts an expert twice on rank 0"),
    ([0, 1, 2, 0, 1, 2], "must hold every expert 0..3"),
    ([0, 1, 2, 3, 0], "give 2 ranks the same number of slots"),
    ([0, 1, 2, 3, 4, 0], "must hold every expert 0..3"),
])
def test_bad_placements_with_copies_are_named(order, message):
    with pytest.raises(ValueError, match=message):
        check_order(order, 4, 2)


# ---- the knob ---------------------------------------------------------------------------------

MOE = ["--model.block", "moe", "--model.moe.num_experts", "4", "--parallel.dp", "2"]


@pytest.mark.parametrize("args,message", [
    (["--parallel.replace_experts", "2:1,0,3,2"], "parallel.ep = 1: use parallel.ep > 1"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "2:1,0,3,3"], "must hold every expert 0..3, and no other"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "2:1,0,3"], "3 experts listed; the ranks hold 4 (moe.num_experts = 4)"),
    (["--parallel.ep", "2", "--parallel.expert_slots", "1", "--parallel.replace_experts", "2:1,0,3,2"],
     "4 experts listed; the ranks hold 6 (moe.num_experts = 4 and parallel.expert_slots = 1)"),
    (["--parallel.ep", "2", "--parallel.expert_slots", "1", "--parallel.replace_experts", "2:1,0,0,3,2,1"],
     "puts an expert twice on rank 0"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "2:1,0,3,2,4"], "5 experts listed"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "9:1,0,3,2"], "step 9 is not a step of the run (steps 0..4"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "-1:1,0,3,2"], "step -1 is not a step of the run"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "2:7:1,0,3,2"], "block 7 is not a block of the model (0..3)"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "2"], "must look like STEP:ORDER or STEP:BLOCK:ORDER"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "x:1,0,3,2"], "must be whole numbers"),
    (["--parallel.ep", "2", "--parallel.replace_experts", "2:1,0,3,2;2:1:0,1,2,3"],
     "step 2 already re-places this block"),
])
def test_bad_replacements_are_refused(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        validate(tiny_config(*MOE, "--train.steps", "5", *args), 2)


def test_replacements_parse_per_block_and_for_every_block():
    cfg = tiny_config(*MOE, "--parallel.ep", "2", "--train.steps", "5", "--parallel.replace_experts",
                      "1:2,3,0,1;3:2:1,0,2,3;3:0:3,2,1,0")
    validate(cfg, 2)
    assert parse_replacements(cfg) == {1: {f"block{b}": (2, 3, 0, 1) for b in range(4)},
                                       3: {"block2": (1, 0, 2, 3), "block0": (3, 2, 1, 0)}}


def test_the_launcher_refuses_a_bad_one_in_one_line_before_work(tmp_path):
    from tests.test_bad_input import assert_rejected, dynmo_train

    p, _ = dynmo_train(tmp_path, *MOE, "--parallel.ep", "2", "--parallel.replace_experts", "1:0,0,1,2", nproc=2)
    assert_rejected(p, tmp_path, "must hold every expert 0..3, and no other")


# ---- the exchange, on spawned gloo processes ---------------------------------------------------

def _exchange(rank: int, world: int, store: str, slots: int) -> None:
    """One MoE block, experts spread over `world` processes, trained one AdamW step so it has
    state; then a series of random re-placements: after each, every rank's rows of every weight,
    gradient and AdamW moment are the whole tensor's rows of the experts it now holds, the step
    counts are unchanged, and the whole tensor gathered by index (what a checkpoint stores) is
    the same as before any move."""
    import torch.distributed as dist

    from dynmo.model.layers import LayerSpec, build_layer
    from dynmo.runtime.experts import (ExpertGroup, apply_placement, expert_modules, is_expert_param, local_experts,
                                       localize, reduce_copies, whole)

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cfg = tiny_config("--model.block", "moe", "--model.moe.num_experts", "8").model
        ep = ExpertGroup(world, rank, dist.group.WORLD, "gloo", slots=slots)
        layer = localize(build_layer(LayerSpec("t", 1), cfg, seed=3), ep, "block0")
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=g)
        y, aux = layer.forward_with_aux(x, torch.ones(2, cfg.seq_len, dtype=torch.bool))
        (y.square().mean() + aux).backward()
        reduce_copies({1: layer})  # copies: the same gradient, so the same AdamW step
        opt.step()  # state: step 1, moments
        for p in layer.parameters():
            if p.grad is not None:
                p.grad.add_(1.0)  # a gradient that is not the one AdamW saw: it moves too
        named = {n: p for n, p in layer.named_parameters() if is_expert_param(n)}

        def tensors(n: str, p) -> dict[str, torch.Tensor]:
            st = opt.state[p]
            return {"w": p.detach(), "g": p.grad, "m": st["exp_avg"], "v": st["exp_avg_sq"]}

        ref = {(n, k): whole(layer, n, t).clone() for n, p in named.items() for k, t in tensors(n, p).items()}
        ids = {n: id(p) for n, p in named.items()}
        rnd = random.Random(11)
        K = 8 // world + slots
        for _ in range(6):
            order = _random_order(rnd, 8, world, slots)
            dist.broadcast_object_list(obj := [order], src=0)
            got = apply_placement({1: layer}, {1: "block0"}, opt, ep, {"block0": tuple(obj[0])})
            (mod,) = expert_modules(layer)
            assert mod.order == tuple(obj[0]) and ep.orders["block0"] == tuple(obj[0])
            mine = local_experts(mod)
            assert mine == obj[0][rank * K:(rank + 1) * K]
            assert got >= 0
            for n, p in layer.named_parameters():
                if n not in named:
                    continue
                assert id(p) == ids[n] and opt.state[p]["step"].item() == 1.0
                for k, t in tensors(n, p).items():
                    assert torch.equal(t, ref[(n, k)][mine]), (n, k)
                    assert torch.equal(whole(layer, n, t), ref[(n, k)]), (n, k)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist  # spawns gloo processes: seconds, not milliseconds
@pytest.mark.parametrize("world,slots", [(2, 0), (4, 0), (4, 1)])
def test_moving_experts_carries_their_weights_gradients_and_adamw_state(tmp_path, world, slots):
    spawn(_exchange, args=(world, str(tmp_path / "store"), slots), nprocs=world)


# ---- end to end -------------------------------------------------------------------------------

STEPS = 6
COMMON = ["--config", "configs/moe.toml", "--steps", str(STEPS), "--train.microbatches", "2", "--train.eval_every", "3",
          "--balance.when", "never", "--model.moe.num_experts", "4", "--parallel.ep", "2", "--train.grad_clip", "0.05"]


def _norms(out: Path) -> list[float]:
    return [r["grad_norm"] for r in metrics(out)]


@pytest.mark.dist
def test_a_run_with_experts_moved_trains_bitwise_as_without_and_resumes_with_its_placement(tmp_path):
    """gpt `moe`, dp 2 x pp 1, ep 2: every block's experts re-placed before step 2 and block 1's
    again before step 4 give bitwise the losses, validation losses, gradient norms (clipped
    hard, so the norm decides every update) and final checkpoint of the run without it; the
    checkpoint at step 3 records the placement and a resume from it continues bitwise. dp 2 x
    pp 2: a re-placement and then a re-layout (the layers migrate with their placement)."""
    dp2 = [*COMMON, "--parallel.dp", "2", "--checkpoint.every", "3", "--checkpoint.final", "true"]
    moves = ["--parallel.replace_experts", "2:3,1,0,2;4:1:3,0,1,2"]  # a list option: entries split at ";"
    base, moved = tmp_path / "base", tmp_path / "moved"
    run_train(base, *dp2, nproc=2)
    run_train(moved, *dp2, *moves, nproc=2)
    assert len(losses(base)) == STEPS + 2
    assert losses(moved) == losses(base)
    assert _norms(moved) == _norms(base) and any(n > 0.05 for n in _norms(base))
    events = [(r["step"], e) for r in metrics(moved) for e in r["events"] if e["type"] == "replacement"]
    assert [s for s, _ in events] == [2, 4]
    assert events[0][1]["experts_moved"] == {f"block{b}": [0, 3] for b in range(4)}
    assert events[1][1]["experts_moved"] == {"block1": [0, 1]}  # block 1: 3,1 | 0,2 -> 3,0 | 1,2
    assert all(e["bytes"] > 0 and e["seconds"] >= 0 for _, e in events)
    a, b = flat(base / "checkpoint-final", tmp_path), flat(moved / "checkpoint-final", tmp_path)
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    saved = json.loads((moved / "checkpoint-3" / "dynmo.json").read_text())["expert_placement"]
    assert saved == {f"block{b}": [3, 1, 0, 2] for b in range(4)}
    resumed = tmp_path / "resumed"
    run_train(resumed, *dp2, *moves, "--checkpoint.resume", str(moved / "checkpoint-3"), nproc=2)
    assert [r["step"] for r in metrics(resumed)] == list(range(3, STEPS))
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in metrics(base)][3:]
    c = flat(resumed / "checkpoint-final", tmp_path)
    assert all(torch.equal(a[k], c[k]) for k in a if isinstance(a[k], torch.Tensor))

    pp2 = [*COMMON, "--parallel.dp", "2"]
    still, both = tmp_path / "pp2", tmp_path / "pp2-moved"
    run_train(still, *pp2, nproc=4)
    run_train(both, *pp2, "--parallel.replace_experts", "2:2,3,1,0", "--parallel.relayout", "3:0,2,6", nproc=4)
    assert losses(both) == losses(still)
    kinds = [e["type"] for r in metrics(both) for e in r["events"] if e["type"] in ("replacement", "migration")]
    assert kinds == ["replacement", "migration"]


# ---- balance.experts = "auto": decided from the measured routing --------------------------------

def _records(loads_of_step, steps: int, layer_s: float = 0.05, names=("embed", "block0", "head"), others=(0.0, 0.0)):
    """Step records with injected routing (`moe_tokens_per_expert` of block0) and layer times."""
    from dynmo.record import StepRecord

    return [StepRecord(step=k, microbatches=2, layer_cost_s=[others[0], layer_s, others[1]],
                       stats={"moe_tokens_per_expert": [None, list(loads_of_step(k)), None]}) for k in range(steps)]


def _balancer(**kw):
    from dynmo.controller.experts import ExpertBalancer

    return ExpertBalancer(**({"ranks": 2, "groups": 1, "names": ["embed", "block0", "head"], "expert_bytes": 1e5,
                              "every": 2, "window": 3} | kw))


def test_auto_moves_experts_apart_when_the_routing_keeps_two_hot_ones_together():
    from dynmo.balance.experts import place_experts
    from dynmo.controller.experts import busiest

    rnd = random.Random(1)
    hot = lambda k: [100 + rnd.uniform(-5, 5), 90 + rnd.uniform(-5, 5), 10 + rnd.uniform(-2, 2), 5]  # noqa: E731
    eb = _balancer()
    decisions = {}
    for rec in _records(hot, 14):
        new = eb.decide(rec.step, {}, 100 - rec.step)
        if new:
            decisions[rec.step] = new
            break
        eb.observe(rec)
    (step, new), = decisions.items()
    assert step == 10  # the first look (every 2 steps) with 5 steps to choose and 5 to judge
    order = new["block0"]
    assert sorted(order) == [0, 1, 2, 3] and {frozenset(order[:2]), frozenset(order[2:])} == {
        frozenset({0, 3}), frozenset({1, 2})}  # the hot experts 0 and 1 apart
    mean = [95.0, 90.0, 10.0, 5.0]
    assert busiest(order, mean, 2) == pytest.approx(place_experts(mean, 2).busiest, abs=5)
    w = eb.last["block0"]
    assert w["significant"] and w["saving_s"] > w["predicted_s"] and w["gain"] > 0.3


def test_auto_keeps_the_placement_under_balanced_noisy_routing_or_when_the_move_does_not_repay():
    rnd = random.Random(2)
    noisy = lambda k: [50 + rnd.uniform(-20, 20) for _ in range(4)]  # noqa: E731
    eb = _balancer()
    for rec in _records(noisy, 20):
        assert eb.decide(rec.step, {}, 100) == {}
        eb.observe(rec)
    assert eb.decide(20, {}, 100) == {} and not eb.last["block0"]["significant"]
    # a real gain, but the layer is so fast that moving its experts costs more than it saves
    eb = _balancer()
    for rec in _records(lambda k: [100, 90 + k % 2, 10, 5], 10, layer_s=1e-7):
        eb.observe(rec)
    assert eb.decide(10, {}, 100) == {}
    w = eb.last["block0"]
    assert w["significant"] and w["saving_s"] < w["predicted_s"]
    # already apart: nothing to propose
    eb = _balancer()
    for rec in _records(lambda k: [100, 90, 10, 5], 10):
        eb.observe(rec)
    assert eb.decide(10, {"block0": (0, 3, 1, 2)}, 100) == {}


def test_auto_copies_one_hot_expert_into_the_extra_slots_which_no_renaming_can_spread():
    """4 experts on 2 ranks, one slot more each (`parallel.expert_slots = 1`), one expert taking
    most tokens: without copies the rank holding it carries it whole whatever the placement; with
    copies the balancer puts it on both ranks (each copy half its tokens), every slot filled."""
    from dynmo.balance.experts import check_order, start_order
    from dynmo.controller.experts import busiest

    rnd = random.Random(3)
    one_hot = lambda k: [300 + rnd.uniform(-10, 10), 30, 20 + rnd.uniform(-2, 2), 10]  # noqa: E731
    recs = _records(one_hot, 10)
    plain, copying = _balancer(), _balancer(extra_slots=1)
    for rec in recs:
        plain.observe(rec)
        copying.observe(rec)
    start = start_order(4, 2, 1)
    assert start == (0, 1, 2, 2, 3, 0)  # the start already copies experts 2 and 0
    # from a placement that holds the hot expert once, beside another expert
    new = copying.decide(10, {"block0": (0, 1, 3, 2, 3, 1)}, 100)["block0"]
    assert check_order(new, 4, 2) == new and len(new) == 6
    assert 0 in new[:3] and 0 in new[3:]  # the hot expert on both ranks
    mean = [300.0, 30.0, 20.0, 10.0]
    # 0 split 150 | 150, 1 and 2 apart, the last slot a copy of 3 (every slot is filled): 185 | 175,
    # the best a full set of slots allows (an empty slot would give 180 | 180)
    assert busiest(new, mean, 2) == pytest.approx(185.0) and busiest((0, 1, 3, 2, 3, 1), mean, 2) == 320.0
    # without slots nothing helps: 0 carries 300 wherever it is, and the rest fit beside it
    assert plain.decide(10, {"block0": (0, 1, 2, 3)}, 100) == {} or busiest(
        plain.decide(10, {"block0": (0, 1, 2, 3)}, 100)["block0"], mean, 2) >= 300


def test_scored_by_step_time_a_layer_off_the_critical_path_keeps_its_experts():
    """One decision with the layer layout: a placement is judged by the simulated step time of
    the layout in force (the layer controller's own `step_times`, 16 microbatches of 1F1B), so
    the same lopsided routing moves the experts of a layer on the slowest stage and leaves those
    of a layer whose stage waits on a slower one."""
    from dynmo.config import BalanceConfig
    from dynmo.layout import Layout
    from dynmo.loop import DynmoLoop

    loop = DynmoLoop(BalanceConfig(), microbatches=16, schedule="1F1B", layer_params=[1, 1, 1])
    layout = Layout((0, 2, 3))  # embed and block0 | head
    lopsided = lambda k: [100, 90 + k % 3, 10, 5]  # noqa: E731
    # block0 (0.05 s) on stage 0, the head (0.01 s) on stage 1: block0 is the bottleneck
    eb = _balancer(expert_share={"block0": 0.6})
    for rec in _records(lopsided, 10, others=(0.0, 0.01)):
        eb.observe(rec)
    assert "block0" in eb.decide(10, {}, 100, step_times=lambda steps: loop.step_times(steps, layout))
    w = eb.last["block0"]
    assert w["scored_by"] == "step time" and w["significant"]
    # 0.6 of the layer follows the busiest rank (100 + 90 -> 100 + 5), and the bottleneck is the step
    assert 0.6 * (1 - 105 / 191) * 0.8 < w["gain"] < 0.6 * (1 - 105 / 191)
    # the head's stage is three times slower: block0 only shortens the fill and the drain
    eb = _balancer(expert_share={"block0": 0.6})
    for rec in _records(lopsided, 10, others=(0.0, 0.15)):
        eb.observe(rec)
    assert eb.decide(10, {}, 100, step_times=lambda steps: loop.step_times(steps, layout)) == {}
    assert 0 < eb.last["block0"]["gain"] < 0.01 and not eb.last["block0"]["significant"]
    # scored by the busiest rank alone, the same routing would move it
    assert "block0" in eb.decide(10, {}, 100)


def test_the_balancer_keeps_only_the_steps_a_decision_reads():
    from dynmo.controller.evidence import EVIDENCE_STEPS

    eb = _balancer()
    for rec in _records(lambda k: [100, 90 + k % 2, 10, 5], 3 * EVIDENCE_STEPS):
        eb.observe(rec)
    assert all(len(h[name]) == EVIDENCE_STEPS for h in (eb.loads, eb.seconds, eb.costs) for name in h)
    assert eb.loads["block0"][-1] == [100.0, 91.0, 10.0, 5.0]  # the newest kept


def test_a_measured_replacement_refits_the_move_and_restarts_the_evidence():
    from dynmo.record import StepRecord

    eb = _balancer()
    for rec in _records(lambda k: [100, 90, 10, 5], 4):
        eb.observe(rec)
    assert "block0" in eb.loads
    eb.observe(StepRecord(step=4, events=[{"type": "replacement", "placements": {"block0": [0, 3, 1, 2]},
                                           "bytes": 2_000_000, "seconds": 0.03}]))
    assert eb.bandwidth == pytest.approx(2_000_000 / (0.03 - eb.fixed_s))
    assert "block0" not in eb.loads  # fresh evidence under the new placement


def test_balance_experts_is_checked():
    with pytest.raises(ConfigError, match="balance.experts = 'sometimes': choose never or auto"):
        validate(tiny_config(*MOE, "--parallel.ep", "2", "--balance.experts", "sometimes"), 2)
    with pytest.raises(ConfigError, match="parallel.ep = 1: use parallel.ep > 1 or balance.experts"):
        validate(tiny_config(*MOE, "--balance.experts", "auto"), 2)
    with pytest.raises(ConfigError, match="balance.experts_every = 0"):
        validate(tiny_config(*MOE, "--parallel.ep", "2", "--balance.experts", "auto", "--balance.experts_every", "0"), 2)
    validate(tiny_config(*MOE, "--parallel.ep", "2", "--balance.experts", "auto"), 2)


@pytest.mark.parametrize("saved", [{"block0": [0, 1, 1, 2]}, {"block9": [0, 1, 2, 3]}, {"block0": [0, 1, 2]},
                                   {"block0": "0,1,2,3"}, [0, 1, 2, 3]])
def test_a_damaged_placement_record_is_refused_before_launch(saved):
    from dynmo.checks import check_checkpoint_placement

    cfg = tiny_config(*MOE, "--parallel.ep", "2")
    with pytest.raises(ConfigError, match="'expert_placement' record is not an order of the 4 experts"):
        check_checkpoint_placement(cfg, "ckpt", {"expert_placement": saved})
    check_checkpoint_placement(cfg, "ckpt", {"expert_placement": {"block3": [3, 2, 1, 0]}})
    check_checkpoint_placement(cfg, "ckpt", {})


def test_a_saved_placement_with_copies_is_restored_only_under_the_ranks_and_slots_it_was_saved_with():
    """8 experts: ep 2 with 2 extra slots and ep 4 with 1 both have 12 slots, so an order saved
    under one has the other's length; cut under the other its slots would fall on other ranks,
    and the start placement stands instead. An order without copies fits any ep without slots."""
    from types import SimpleNamespace

    from dynmo.runtime.checkpoint import restore_placement
    from dynmo.runtime.experts import ExpertGroup

    def pipe(ep: int, slots: int):
        cfg = SimpleNamespace(model=SimpleNamespace(moe=SimpleNamespace(num_experts=8)))
        return SimpleNamespace(ep=ExpertGroup(ep, 0, None, "gloo", slots=slots), cfg=cfg, layers={}, specs=[])

    saved = [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1]  # ep 2, 2 slots: rank 0 holds 0-5, rank 1 holds 4-7, 0, 1
    p = pipe(4, 1)
    restore_placement(p, {"block0": saved}, {"ep": 2, "expert_slots": 2})
    assert p.ep.order("block0", 8) == p.ep.start(8) == (0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 0)
    p = pipe(2, 2)
    restore_placement(p, {"block0": saved}, {"ep": 2, "expert_slots": 2})
    assert p.ep.order("block0", 8) == tuple(saved)
    p = pipe(4, 0)  # without copies: any ep, even a checkpoint that names none
    restore_placement(p, {"block0": [7, 6, 5, 4, 3, 2, 1, 0]}, None)
    assert p.ep.order("block0", 8) == (7, 6, 5, 4, 3, 2, 1, 0)
