"""The host's work per microbatch: aten operators one forward+backward of a whole model dispatches
(`dynmo.model.hostops`), at the quoted size (d_model 64, 4 heads, 128 tokens, batch 2).

Counts are exact and deterministic on any machine, so the bounds below are asserted as they are:
each block kind against the gpt dense model of the same config, and no operator that makes the
host wait for the device in any training step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynmo.model.hostops import OpCounter, SYNC_OPS, count_step, quoted_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# config -> the most operators it may dispatch, as a multiple of configs/default.toml's gpt dense
# model (before the lean blocks: mod 2.97, moe 3.76, llama 3.09, mixtral 5.32, llama-mod 5.05)
BOUNDS = {"mod": 1.48, "moe": 2.05, "llama": 2.0, "mixtral": 2.98, "llama-mod": 2.49}


@pytest.fixture(scope="module")
def dense() -> int:
    return count_step(quoted_config(CONFIGS / "default.toml"), strict=True).total


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_block_kinds_dispatch_about_what_their_work_needs_and_never_sync(name, dense):
    c = count_step(quoted_config(CONFIGS / f"{name}.toml"), strict=True)  # strict: a sync operator raises
    assert not c.syncs
    assert c.total <= BOUNDS[name] * dense, (name, c.total, c.total / dense, c.ops.most_common(8))


def test_the_count_is_exact_and_leaves_views_out():
    cfg = quoted_config(CONFIGS / "default.toml", ["--model.n_layers", "1"])
    a, b = count_step(cfg), count_step(cfg)
    assert a.ops == b.ops and a.total == b.total > 0
    x = torch.randn(4, 6)
    with OpCounter() as rec:
        x.view(6, 4).t().transpose(0, 1)[1:].unsqueeze(0)  # views only: nothing launches
        x.exp()
    assert dict(rec.ops) == {"aten::exp": 1}


@pytest.mark.parametrize("op", [
    lambda x: x[x > 0],  # boolean indexing
    lambda x: x.nonzero(),
    lambda x: x.sum().item(),
    lambda x: x.masked_select(x > 0),
    lambda x: torch.repeat_interleave(torch.tensor([1, 2])),
    lambda x: torch.unique(x),
    lambda x: torch.bincount(torch.tensor([1, 2])),
])
def test_a_sync_operator_is_caught(op):
    with pytest.raises(AssertionError, match="synchronises"), OpCounter(strict=True):
        op(torch.randn(8))
    with OpCounter() as rec:
        op(torch.randn(8))
    assert set(rec.syncs) <= SYNC_OPS | {"aten::index", "aten::repeat_interleave"} and rec.syncs


def test_fixed_output_size_repeat_interleave_is_no_sync():
    with OpCounter(strict=True) as rec:
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
    assert not rec.syncs
