"""Tensors on the device they meet: a pruning cut builds its masks where the scores live, and
every collective gets its tensor on the rank's device (NCCL takes none on the CPU).

A GPU is not needed to catch a tensor made on the wrong device: with the meta device as the
default (a tensor created without one lands there, not beside the scores) or as the rank's
device (a collective must get a tensor there), a CPU machine sees the same mismatch a GPU run
does. The collectives are replaced by a recorder that stops at the first one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dynmo.config import ModelConfig, PruneConfig
from dynmo.dynamics import topk
from dynmo.dynamics.freeze import Freeze
from dynmo.dynamics.prunemask import floor_count, keep_with_floor, weight_masks
from dynmo.dynamics.topk import global_keep
from dynmo.model.layers import LayerSpec, build_layer
from dynmo.runtime import checkpoint, probe
from dynmo.trainer import Trainer

NAMES = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
RANK_DEVICE = torch.device("meta")  # stands for the rank's accelerator: any device but the CPU


def blocks(n=3, d=32):
    cfg = ModelConfig(d_model=d, n_heads=2, seq_len=16, n_layers=n, mlp_ratio=4)
    return {i + 1: build_layer(LayerSpec("t", i + 1), cfg, seed=7) for i in range(n)}


@pytest.mark.parametrize("scoring", ["magnitude", "normalized", "lamp"])
def test_pruning_masks_are_built_beside_the_scores(scoring):
    """Every tensor of the cut is made on the scores' device: none lands on the default device."""
    model = blocks()
    host = SimpleNamespace(block_number=lambda i: i - 1, model_group=None, num_blocks=len(model))
    opts = PruneConfig(enabled=True, scoring=scoring, min_density=0.05)
    keep = sum(model[1].get_submodule(n).weight.numel() for n in NAMES)  # one block's worth over three
    ref, kept = weight_masks(host, model, NAMES, keep, opts)
    with torch.device("meta"):  # what a factory call without a device now makes
        got, kept_meta = weight_masks(host, model, NAMES, keep, opts)
    assert kept_meta == kept
    for i in ref:
        for name in NAMES:
            assert got[i][name].device.type == "cpu"
            assert torch.equal(got[i][name], ref[i][name])


def test_floor_and_global_cut_beside_the_scores():
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(8, 4, generator=g), torch.rand(16, generator=g)]
    floors = [floor_count(0.25, s.numel()) for s in scores]
    ref, n = keep_with_floor(scores, 10, floors, keys=[1, 0], num_keys=2)
    with torch.device("meta"):
        got, n_meta = keep_with_floor(scores, 10, floors, keys=[1, 0], num_keys=2)
        keep = global_keep(scores, 10)
    assert n_meta == n
    assert all(a.device.type == "cpu" and torch.equal(a, b) for a, b in zip(got, ref))
    assert all(m.device.type == "cpu" for m in keep)


class Stop(Exception):
    """Raised by the recorder at the first collective."""


@pytest.fixture
def collectives(monkeypatch):
    """Replace the collectives by a recorder of the devices of their tensors."""
    seen: list[tuple[str, set[torch.device]]] = []

    def recorder(name):
        def call(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            seen.append((name, {t.device for t in tensors}))
            raise Stop

        return call

    for name in ("all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, recorder(name))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    return seen


def check_on_rank_device(seen, name):
    assert seen and seen[0] == (name, {RANK_DEVICE}), seen


def test_freeze_sums_its_measurements_on_the_rank_device(collectives):
    case = Freeze.__new__(Freeze)  # the state _check reads, on a rank holding no block
    case.frozen, case.progress, case.probes, case.refs = [False] * 4, [None] * 4, {}, {}
    case.host = SimpleNamespace(device=RANK_DEVICE, active_group=None, blocks=lambda: {}, is_block=lambda i: 0 < i < 3)
    with pytest.raises(Stop):
        case._check(step=5)
    check_on_rank_device(collectives, "all_reduce")


def test_validation_loss_is_summed_on_the_rank_device(collectives):
    trainer = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(eval_batches=0)),
                              ctx=SimpleNamespace(device=RANK_DEVICE, active_group=None))
    with pytest.raises(Stop):
        Trainer.validate(trainer)
    check_on_rank_device(collectives, "all_reduce")


def test_checkpoint_agrees_on_optimizer_state_on_the_rank_device(collectives, tmp_path):
    pipe = SimpleNamespace(ctx=SimpleNamespace(device=RANK_DEVICE, active_group=None), layers={},
                           optimizer=SimpleNamespace(state={}))
    with pytest.raises(Stop):
        checkpoint.save(pipe, tmp_path / "ckpt", 1, None)
    check_on_rank_device(collectives, "all_reduce")


def test_probes_gather_on_the_rank_device(collectives):
    ctx = SimpleNamespace(device=RANK_DEVICE, active_group=None, active_world=1, pp=1, dp=1, pp_rank=0)
    with pytest.raises(Stop):
        probe.measure_speeds(ctx)
    with pytest.raises(Stop):
        probe.measure_links(ctx, microbatch=1, seq_len=4, d_model=8)
    assert [d for _, d in collectives] == [{RANK_DEVICE}, {RANK_DEVICE}]


def test_distributed_top_k_counts_on_the_group_device(collectives, monkeypatch):
    monkeypatch.setattr(topk, "_distributed", lambda group: True)
    monkeypatch.setattr(topk, "group_device", lambda group: RANK_DEVICE)
    with pytest.raises(Stop):
        topk.group_sum(torch.zeros(3), "group")  # a CPU tensor is summed on the group's device
    with pytest.raises(Stop):
        topk.group_count(5, "group")
    with pytest.raises(Stop):
        global_keep([torch.rand(6)], 3, "group")
    assert [d for _, d in collectives] == [{RANK_DEVICE}] * 3


def test_group_device_of_a_gloo_group_is_the_cpu():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert topk.group_device(dist.group.WORLD) == torch.device("cpu")
    finally:
        dist.destroy_process_group()
