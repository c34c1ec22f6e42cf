"""Workers that come back after a re-pack: a grow is a checkpoint and a restart on the whole world.

The plan's parsing of grow entries and the launcher's decision to launch again are pure and
tested here without torchrun; one end-to-end run, on injected costs, has the controller re-pack 3
ranks onto 1 and decide to grow back to 3 through the real launcher, with the losses of the
single-process reference, bitwise.
"""

import json
import time

import pytest
import torch

from dynmo import launch
from dynmo.config import ConfigError
from dynmo.layout import Layout
from dynmo.plan import first_layout, parse_relayouts
from tests.conftest import TINY, metrics, run_train
from tests.reference import reference_run, tiny_config
from tests.test_pipeline_dist import final_weights

STEPS = 12
SHRINK_GROW = "5:0,3,6;10:0,2,4,6"  # a list on the command line: entries separated by ";"


# ---- the plan ---------------------------------------------------------------------------------


def test_a_grow_back_to_the_launched_stages_is_accepted():
    cfg = tiny_config("--train.steps", str(STEPS), "--parallel.relayout", SHRINK_GROW)
    got = parse_relayouts(cfg, 3)
    assert got == {5: Layout((0, 3, 6)), 10: Layout((0, 2, 4, 6))}
    # shrink twice, grow part of the way back, then all of it
    cfg = tiny_config("--train.steps", str(STEPS), "--parallel.relayout", "2:0,6;4:0,3,6;6:0,2,4,6")
    assert [lay.num_stages for lay in parse_relayouts(cfg, 3).values()] == [1, 2, 3]


def test_a_grow_beyond_the_launched_world_is_refused_in_one_line():
    cfg = tiny_config("--train.steps", str(STEPS), "--parallel.relayout", "5:0,6;8:0,2,4,6")
    with pytest.raises(ConfigError) as e:
        parse_relayouts(cfg, 2)
    msg = str(e.value)
    assert "\n" not in msg and "'8:0,2,4,6'" in msg and "cannot grow beyond the 2" in msg


def test_the_launcher_refuses_a_grow_beyond_its_world_before_work_starts(tmp_path, capsys):
    out = tmp_path / "run"
    status = launch.main(["--nproc", "2", "--out", str(out), *TINY, "--steps", "6",
                          "--parallel.relayout", "2:0,2,4,6"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("dynmo train: error: parallel.relayout entry '2:0,2,4,6'")
    assert "cannot grow beyond the 2" in err
    assert not out.exists()  # nothing started, nothing written


def test_a_grown_layout_wins_when_it_fits_the_world():
    cfg = tiny_config()
    params, costs = [1] * 6, [1.0, 9.0, 1.0, 1.0, 1.0, 1.0]
    # saved on 2 stages, the grow decided 3: resumed on 3, its layout (not the balancer's)
    lay, rebalanced = first_layout(cfg, 3, params, costs, [0, 3, 6], grown=[0, 1, 3, 6])
    assert lay == Layout((0, 1, 3, 6)) and not rebalanced
    # explicit parallel.layout: the grow's layout still wins, it is where the run was
    explicit = tiny_config("--parallel.layout", "0,2,4,6")
    assert first_layout(explicit, 3, params, costs, [0, 3, 6], grown=[0, 1, 3, 6])[0] == Layout((0, 1, 3, 6))
    # the job came back smaller than the grow asked (elastic): as any resume on that world
    assert first_layout(cfg, 2, params, costs, [0, 3, 6], grown=[0, 1, 3, 6]) == (Layout((0, 3, 6)), False)
    lay, rebalanced = first_layout(cfg, 1, params, costs, [0, 3, 6], grown=[0, 1, 3, 6])
    assert lay == Layout((0, 6)) and rebalanced


def test_a_damaged_grow_record_is_refused():
    from dynmo.checks import check_checkpoint_grow

    cfg, t = tiny_config(), time.time()
    check_checkpoint_grow(cfg, "c", _grow_meta(10, t))
    check_checkpoint_grow(cfg, "c", {"step": 10})  # no grow: nothing to check
    for bad in ({"layout": [0, 2, 7]}, {"layout": "0,2,6"}, {"stages": [2]}, {"saved_at": None}):
        meta = _grow_meta(10, t)
        meta["grow"] |= bad
        with pytest.raises(ConfigError, match="'grow' record"):
            check_checkpoint_grow(cfg, "c", meta)


# ---- the launcher's decision ------------------------------------------------------------------


def _grow_meta(step: int, saved_at: float) -> dict:
    return {"step": step, "layout": [0, 3, 6],
            "grow": {"step": step, "layout": [0, 2, 4, 6], "stages": [2, 3], "decided_at": saved_at - 0.1,
                     "saved_at": saved_at, "reason": "forced"}}


def test_a_job_that_saved_a_grow_is_launched_again():
    t = time.time()
    assert launch.grow_restart(0, _grow_meta(10, t + 5), t, None)
    assert launch.grow_restart(0, _grow_meta(10, t + 5), t, 4)  # resumed from step 4, grew at 10


@pytest.mark.parametrize("status, meta, resumed, why", [
    (1, "grow", None, "the job failed"),
    (2, "grow", None, "bad input"),
    (130, "grow", None, "stopped by a signal"),
    (0, None, None, "no checkpoint"),
    (0, {"step": 10, "layout": [0, 3, 6]}, None, "the newest checkpoint is no grow's"),
    (0, "old grow", None, "a grow saved before this job started"),
    (0, "grow", 10, "the grow this job resumed from"),
    (0, {"step": 10, "grow": "x"}, None, "a malformed record"),
])
def test_anything_else_is_not_launched_again(status, meta, resumed, why):
    t = time.time()
    if isinstance(meta, str):
        meta = {"grow": _grow_meta(10, t + 5), "old grow": _grow_meta(10, t - 60)}[meta]
    assert not launch.grow_restart(status, meta, t, resumed), why


# ---- end to end -------------------------------------------------------------------------------


# What the controller sees (dynmo.runtime.faults.DYNMO_COSTS, milliseconds per microbatch): a
# model whose three middle blocks cost 2 s, then from step 6 only the first of them (the model
# shrank: one stage does the work within the re-pack's tolerance of three), then from step 30 all
# three again (three stages halve the step: the released workers pay for their restart).
GROW_STEPS = 44
SHRINK_THEN_GROW = "0:10,2000,2000,2000,10,10;6:10,2000,10,10,10,10;30:10,2000,2000,2000,10,10"


@pytest.mark.dist
def test_the_controller_repacks_then_takes_the_workers_back_with_the_losses_of_an_uninterrupted_run(tmp_path):
    """3 ranks under `balance.when = auto` with re-packing, on injected costs (no timing): the
    controller re-packs onto one rank once the model shrank, and when it grows again decides the
    grow (a checkpoint, then the launcher restarts the job on its 3 ranks): every step once,
    bitwise the losses and the final weights of the single-process reference, which every
    uninterrupted pipeline run equals. (Forced grows, `parallel.relayout`, take the same path
    from the decision on; their parsing is tested above.)"""
    p = run_train(tmp_path, "--steps", str(GROW_STEPS), "--balance.when", "auto", "--balance.repack", "true",
                  "--checkpoint.final", "true", nproc=3, env={"DYNMO_COSTS": SHRINK_THEN_GROW})
    ref_losses, ref_weights = reference_run(tiny_config("--train.steps", str(GROW_STEPS)), GROW_STEPS)
    recs = metrics(tmp_path)
    assert [r["step"] for r in recs] == list(range(GROW_STEPS))
    assert [r["loss"] for r in recs] == ref_losses
    events = [(r["step"], e) for r in recs for e in r["events"] if e["type"] in ("migration", "grow")]
    repacked = [k for k, e in events if e.get("repacked")]
    grown = [(k, e) for k, e in events if e["type"] == "grow"]
    assert len(repacked) == 1 and 6 < repacked[0] < 30, events
    assert len(grown) == 1, events
    g, ev = grown[0]
    assert 30 < g < GROW_STEPS - 5  # after the change, with steps left to repay the restart
    assert [r["workers"] for r in recs] == [3] * repacked[0] + [1] * (g - repacked[0]) + [3] * (GROW_STEPS - g)
    assert ev["reason"] == "balance.when=auto" and ev["decision"] == "grow" and ev["stages"] == [1, 3]
    assert ev["old"] == [0, 6] and ev["decided_step"] == g and ev["predicted_step_s"] < ev["current_step_s"]
    assert 0 < ev["checkpoint_s"] + ev["setup_s"] < ev["restart_s"]  # measured, for the next restart's price
    got = final_weights(tmp_path / "checkpoint-final", tmp_path)  # saved by the 3 ranks of the restarted job
    for k in ref_weights:
        assert torch.equal(got[k], ref_weights[k]), k
    text = p.stdout + p.stderr
    assert "rank 2 released" in text
    assert f"dynmo: growing back to 3 pipeline ranks at step {g}: checkpoint, restart" in text
    assert f"dynmo: restarting the job on its 3 ranks from {tmp_path / f'checkpoint-{g}'}" in text
    meta = json.loads((tmp_path / f"checkpoint-{g}" / "dynmo.json").read_text())
    assert meta["layout"] == [0, 6] and meta["grow"]["layout"] == ev["new"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["start_step"] == g and summary["workers"] == 3
