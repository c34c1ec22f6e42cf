"""Expert parallelism (`parallel.ep`): the experts of every MoE layer spread over the replicas of
an expert-parallel group, tokens exchanged by all-to-all, expert gradients averaged over the
replicas holding the same experts. The same training as `parallel.ep = 1` to float32 rounding
(the experts' matmuls and the gradient sums run in another order), bitwise under a forced
re-layout against the same expert-parallel run; checkpoints keep the whole tensors' keys, so a
run resumes under another `parallel.ep` and exports to Hugging Face as before.

The bound: over 6 steps the losses differ from `parallel.ep = 1`'s by at most 1e-5 (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dynmo.checks import validate
from dynmo.config import ConfigError
from tests.conftest import metrics, run_train, spawn
from tests.reference import tiny_config
from tests.test_bad_input import assert_rejected, dynmo_train

STEPS = 6
BOUND = 1e-5  # max abs loss difference to parallel.ep = 1 over STEPS steps
COMMON = ["--steps", str(STEPS), "--train.microbatches", "2", "--train.eval_every", "3", "--balance.when", "never"]
GPT_MOE = ["--config", "configs/moe.toml", *COMMON, "--model.moe.num_experts", "4"]
MIXTRAL = ["--config", "configs/mixtral.toml", *COMMON, "--model.n_kv_heads", "1", "--model.intermediate_size", "96"]


@pytest.mark.parametrize("args,message", [
    (["--parallel.dp", "4", "--parallel.ep", "3"], "parallel.ep = 3 does not divide parallel.dp = 4"),
    (["--parallel.dp", "4", "--parallel.ep", "4", "--model.moe.num_experts", "6"],
     "parallel.ep = 4 does not divide moe.num_experts = 6"),
    (["--parallel.dp", "2", "--parallel.ep", "2"], "model.block = 'dense' has none"),
    (["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.shard", "optimizer"],
     "expert parallelism runs with parallel.shard = \"none\" for now"),
    (["--parallel.ep", "0"], "parallel.ep = 0: use a whole number >= 1"),
    (["--parallel.dp", "2", "--parallel.expert_slots", "1", "--model.block", "moe"],
     "parallel.expert_slots = 1 holds copies of experts on other expert-parallel ranks, and parallel.ep = 1"),
    (["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.expert_slots", "3", "--model.block", "moe",
      "--model.moe.num_experts", "4"], "parallel.expert_slots = 3: a rank holds each expert at most once, so at most 2"),
    (["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.expert_slots", "-1", "--model.block", "moe"],
     "parallel.expert_slots = -1: use a whole number >= 0"),
    (["--parallel.ep", "-2"], "parallel.ep = -2: use a whole number >= 1"),
])
def test_bad_expert_parallel_settings_are_refused(args, message):
    block = [] if "has none" in message else ["--model.block", "moe"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(tiny_config(*block, *args), 4)


def test_the_launcher_refuses_them_in_one_line_before_work(tmp_path):
    p, _ = dynmo_train(tmp_path, "--model.block", "moe", "--parallel.dp", "4", "--parallel.ep", "3", nproc=4)
    assert_rejected(p, tmp_path, "parallel.ep = 3 does not divide parallel.dp = 4")


def losses(out: Path) -> list[float]:
    """The training losses, then the validation losses (`train.eval_every`)."""
    rows = metrics(out)
    return [r["loss"] for r in rows] + [r["val_loss"] for r in rows if r.get("val_loss") is not None]


def flat(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{ckpt.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out)


def check_rows(out: Path, ep: int) -> None:
    """Every step records per MoE layer the rows each rank of the expert-parallel group
    computed; together they are the group's replicas' kept assignments."""
    for r in metrics(out):
        for rows, useful in zip(r["moe_ep_rank_rows"], r["moe_useful_rows"]):
            if rows is not None:
                assert len(rows) == ep and sum(rows) == pytest.approx(ep * useful)


@pytest.mark.dist
def test_gpt_moe_trains_as_without_expert_parallelism_and_resumes_under_another(tmp_path):
    """gpt `moe`: dp 4 x pp 1 with ep 2 (one extra slot a rank: copies of experts, re-placed
    to other copies at step 2) and ep 4, dp 2 x pp 2 with ep 2 (also re-packed onto one stage),
    against ep 1; the ep 2 checkpoint holds the ep 1 one's keys and tensors and resumes at ep 4
    without copies (its experts gathered whole, then spread anew), continuing the run."""
    dp4 = [*GPT_MOE, "--parallel.dp", "4", "--checkpoint.every", "3"]
    copies = ["--parallel.expert_slots", "1", "--parallel.replace_experts", "2:3,1,2,0,2,1"]
    runs = {e: tmp_path / f"dp4-ep{e}" for e in (1, 2, 4)}
    for e, out in runs.items():
        run_train(out, *dp4, "--parallel.ep", str(e), *(copies if e == 2 else []), nproc=4)
    ref = losses(runs[1])
    assert len(ref) == STEPS + 2  # and two validation losses
    for e in (2, 4):
        assert losses(runs[e]) == pytest.approx(ref, abs=BOUND, rel=0)
        check_rows(runs[e], e)
    moved = [e for r in metrics(runs[2]) for e in r["events"] if e["type"] == "replacement"]
    # from the start 0,1,2 | 2,3,0: experts 3 and 1 arrive on rank 0, 1 on rank 1
    assert [e["experts_moved"] for e in moved] == [{f"block{b}": [1, 3] for b in range(4)}]
    saved = json.loads((runs[2] / "checkpoint-3" / "dynmo.json").read_text())["expert_placement"]
    assert saved == {f"block{b}": [3, 1, 2, 0, 2, 1] for b in range(4)}
    pp2 = {e: tmp_path / f"pp2-ep{e}" for e in (1, 2)}
    for e, out in pp2.items():
        run_train(out, *GPT_MOE, "--parallel.dp", "2", "--parallel.ep", str(e), nproc=4)
    assert losses(pp2[2]) == pytest.approx(losses(pp2[1]), abs=BOUND, rel=0)
    check_rows(pp2[2], 2)
    # a re-pack onto one stage at step 3 releases half the ranks: the groups are made again
    repacked = tmp_path / "pp2-ep2-repacked"
    run_train(repacked, *GPT_MOE, "--parallel.dp", "2", "--parallel.ep", "2", "--parallel.relayout", "3:0,6", nproc=4)
    assert any(e.get("repacked") for r in metrics(repacked) for e in r["events"])
    assert losses(repacked) == pytest.approx(losses(pp2[1]), abs=BOUND, rel=0)

    # the same keys, the whole tensors: a run saved at ep 2 resumes at ep 1, one saved at ep 1 at ep 4
    a, b = flat(runs[2] / "checkpoint-3", tmp_path), flat(runs[1] / "checkpoint-3", tmp_path)
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    assert all(a[k].shape == b[k].shape and torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)
    out = tmp_path / "resume-ep4"
    run_train(out, *dp4, "--parallel.ep", "4", "--checkpoint.resume", str(runs[2] / "checkpoint-3"), nproc=4)
    assert [r["step"] for r in metrics(out)] == list(range(3, STEPS))
    assert [r["loss"] for r in metrics(out)] == pytest.approx(ref[3:STEPS], abs=BOUND, rel=0)


@pytest.mark.dist
def test_mixtral_trains_as_without_expert_parallelism_migrates_and_exports(tmp_path):
    """mixtral: dp 2 x pp 2 with ep 2 (and a forced re-layout: bitwise the same as without it),
    dp 4 x pp 1 with ep 4, against ep 1; the ep 2 checkpoint exports as the ep 1 one. (ep 2 at
    dp 4 x pp 1 is the gpt test's: both families route and exchange tokens in `RoutedBlock`.)"""
    pp2 = [*MIXTRAL, "--parallel.dp", "2", "--checkpoint.final", "true"]
    one, two, moved = tmp_path / "pp2-ep1", tmp_path / "pp2-ep2", tmp_path / "pp2-ep2-moved"
    run_train(one, *pp2, nproc=4)
    run_train(two, *pp2, "--parallel.ep", "2", nproc=4)
    run_train(moved, *pp2, "--parallel.ep", "2", "--parallel.relayout", "2:0,2,6;4:0,4,6", nproc=4)
    assert losses(two) == pytest.approx(losses(one), abs=BOUND, rel=0)
    check_rows(two, 2)
    assert losses(moved) == losses(two)
    assert [e["new"] for r in metrics(moved) for e in r["events"] if e["type"] == "migration"] == [[0, 2, 6], [0, 4, 6]]
    dp4 = {e: tmp_path / f"dp4-ep{e}" for e in (1, 4)}
    for e, out in dp4.items():
        run_train(out, *MIXTRAL, "--parallel.dp", "4", "--parallel.ep", str(e), nproc=4)
    assert losses(dp4[4]) == pytest.approx(losses(dp4[1]), abs=BOUND, rel=0)
    check_rows(dp4[4], 4)

    from tests.test_shard import run_export
    from safetensors.torch import load_file

    exported = {}
    for name, out in (("one", one), ("two", two)):
        hf = tmp_path / f"hf-{name}"
        p = run_export(out / "checkpoint-final", hf)
        assert p.returncode == 0, p.stderr
        exported[name] = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    x, y = exported["one"], exported["two"]
    assert x.keys() == y.keys() and any(".experts.7.w1.weight" in k for k in x)
    assert all(x[k].shape == y[k].shape and torch.allclose(x[k], y[k], rtol=0, atol=1e-5) for k in x)


def _one_layer(rank: int, world: int, store: str, family: str, slots: int) -> None:
    """One MoE block on `world` gloo processes, each a replica with its own tokens (some
    inactive) and experts dropped by a capacity factor: with its experts spread over the
    processes it gives the whole block's output, and each expert's gradient is the sum over the
    replicas of the whole block's gradients of that expert. With `slots` extra slots a rank
    (copies of experts, the start placement) every copy ends with the whole expert's gradient,
    bitwise the same on each."""
    import torch.distributed as dist

    from dynmo.model.layers import LayerSpec, build_layer
    from dynmo.model.stats import as_numbers
    from dynmo.runtime.experts import ExpertGroup, expert_modules, is_expert_param, local_experts, localize, reduce_copies

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fam = ["--model.family", "mixtral", "--model.n_kv_heads", "1"] if family == "mixtral" else []
        cfg = tiny_config("--model.block", "moe", *fam, "--model.moe.num_experts", "4",
                          "--model.moe.capacity_factor", "0.75").model
        whole = build_layer(LayerSpec("t", 1), cfg, seed=3)
        part = localize(build_layer(LayerSpec("t", 1), cfg, seed=3),
                        ExpertGroup(world, rank, dist.group.WORLD, "gloo", slots=slots))
        whole.skip_inactive = part.skip_inactive = True  # some tokens are inactive: route the others
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=g)
        mask = torch.rand(2, cfg.seq_len, generator=g) > 0.2
        w = torch.randn(2, cfg.seq_len, cfg.d_model, generator=g)
        mod = expert_modules(part)[0]
        rows = [0] * len(local_experts(mod))  # rows each local slot computed
        grouped = mod.grouped

        def counted(xs, offs, idx):  # the local experts, one grouped matmul per weight
            for j, n in enumerate(torch.diff(offs, prepend=offs.new_zeros(1)).tolist()):
                rows[j] += n
            return grouped(xs, offs, idx)

        mod.grouped = counted
        outs = []
        for layer in (whole, part):
            y, aux = layer.forward_with_aux(x, mask)
            ((y * w).sum() + aux).backward()
            outs.append(y.detach())
        del mod.grouped  # the class's again: a module holding a closure over itself lives on to the interpreter's
        # exit with the group's handle, and gloo aborts a process whose group is torn down that late
        reduce_copies({0: part})
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
        mine_stats, whole_stats = as_numbers([part.last_stats, whole.last_stats])
        assert mine_stats["tokens_per_expert"] == whole_stats["tokens_per_expert"]
        assert len(mine_stats["ep_rank_rows"]) == world
        mine = local_experts(mod)
        assert len(mine) == cfg.moe.num_experts // world + slots
        every_rows = [torch.zeros(len(rows), dtype=torch.long) for _ in range(world)]
        dist.all_gather(every_rows, torch.tensor(rows, dtype=torch.long))
        per_copy: dict[int, list[int]] = {}
        for e, n in zip(mod.order, [int(n) for r in every_rows for n in r]):
            per_copy.setdefault(e, []).append(n)
        for e, ns in per_copy.items():  # each source splits its rows for a copied expert evenly
            assert len(ns) == int(mod.copies[e]) and max(ns) - min(ns) <= world, (e, ns)
        for (n, pw), (m, pp) in zip(whole.named_parameters(), part.named_parameters()):
            assert n == m
            if not is_expert_param(n):
                assert torch.equal(pw.grad, pp.grad), n  # the same computation on this replica's tokens
                continue
            summed = pw.grad.clone()
            dist.all_reduce(summed)  # what the replicas' whole blocks give this expert, together
            assert pp.shape[0] == len(mine)
            torch.testing.assert_close(pp.grad, summed[mine], rtol=0, atol=1e-5)
            every = [torch.empty_like(pp.grad) for _ in range(world)]
            dist.all_gather(every, pp.grad)
            for q, theirs in enumerate(every):  # a copied expert's gradient is bitwise the same on every copy
                ks = len(mine)
                for j, e in enumerate(mod.order[q * ks:(q + 1) * ks]):
                    if e in mine:
                        assert torch.equal(theirs[j], pp.grad[mine.index(e)]), (n, e)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist  # spawns gloo processes: seconds, not milliseconds
@pytest.mark.parametrize("family,world,slots", [("gpt", 2, 0), ("mixtral", 4, 0), ("gpt", 2, 1), ("mixtral", 4, 2)])
def test_one_block_with_its_experts_spread_equals_the_whole_block(tmp_path, family, world, slots):
    spawn(_one_layer, args=(world, str(tmp_path / "store"), family, slots), nprocs=world)


def _copies_over_replicas(rank: int, world: int, store: str) -> None:
    """dp 6 with ep 2 (three expert-parallel groups, three replicas holding each rank's experts),
    one extra slot a rank: after the data-parallel reduction every copy of an expert, in every
    group, holds bitwise the same gradient (so the copies take the same AdamW step), and it is
    the mean over the replicas of the whole block's gradients of that expert."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from dynmo.model.layers import LayerSpec, build_layer
    from dynmo.runtime.experts import ExpertGroup, expert_modules, is_expert_param, local_experts, localize
    from dynmo.runtime.grads import sync_data_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ep_groups = [dist.new_group([2 * g, 2 * g + 1]) for g in range(world // 2)]
        replica_groups = [dist.new_group(list(range(q, world, 2))) for q in range(2)]
        cfg = tiny_config("--model.block", "moe", "--model.moe.num_experts", "4").model
        whole = build_layer(LayerSpec("t", 1), cfg, seed=3)
        part = localize(build_layer(LayerSpec("t", 1), cfg, seed=3),
                        ExpertGroup(2, rank % 2, ep_groups[rank // 2], "gloo", slots=1))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=g)
        w = torch.randn(2, cfg.seq_len, cfg.d_model, generator=g)
        mask = torch.ones(2, cfg.seq_len, dtype=torch.bool)
        for layer in (whole, part):
            y, aux = layer.forward_with_aux(x, mask)
            ((y * w).sum() + aux).backward()
        ctx = SimpleNamespace(ep=2, dp=world, dp_group=dist.group.WORLD, ep_replica_group=replica_groups[rank % 2])
        sync_data_parallel({0: part}, ctx)
        mine = local_experts(expert_modules(part)[0])
        for (n, pw), (_, pp) in zip(whole.named_parameters(), part.named_parameters()):
            if not is_expert_param(n):
                continue
            mean = pw.grad.clone()
            dist.all_reduce(mean)
            torch.testing.assert_close(pp.grad, mean[mine] / world, rtol=0, atol=1e-6)
            every = [torch.empty_like(pp.grad) for _ in range(world)]
            dist.all_gather(every, pp.grad)
            orders = [(0, 1, 2, 2, 3, 0)[3 * (q % 2):3 * (q % 2) + 3] for q in range(world)]
            for e in range(cfg.moe.num_experts):
                rows = [every[q][orders[q].index(e)] for q in range(world) if e in orders[q]]
                assert all(torch.equal(r, rows[0]) for r in rows), (n, e)  # every copy, every group
    finally:
        dist.destroy_process_group()


@pytest.mark.dist  # spawns 6 gloo processes: seconds
def test_copies_stay_bitwise_equal_over_three_replica_groups(tmp_path):
    spawn(_copies_over_replicas, args=(6, str(tmp_path / "store")), nprocs=6)
