"""A checkpoint holding a tensor of this rank's layers that the model has no place for is
refused before loading, with the keys named: DCP alone would leave it behind without a word."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dynmo.runtime import checkpoint


def pipe_of(*prefixes, local=None):
    local = range(len(prefixes)) if local is None else local
    return SimpleNamespace(specs=[SimpleNamespace(prefix=p) for p in prefixes], layers={i: None for i in local})


def test_a_stored_parameter_the_model_lacks_is_refused(tmp_path):
    model = {"block0.router.weight": torch.zeros(1, 4), "block0.predictor.bias": torch.zeros(1)}
    stored = dict(model, **{"block0.router.bias": torch.zeros(1), "block1.router.bias": torch.zeros(1)})
    dcp.save(stored, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(ValueError, match=r"holds block0\.router\.bias, which this model has no place for"):
        checkpoint._refuse_unplaced(pipe_of("block0"), model, tmp_path)
    # another rank's layers are that rank's to check; a model holding every stored key passes
    checkpoint._refuse_unplaced(pipe_of("block0"), dict(model, **{"block0.router.bias": torch.zeros(1)}), tmp_path)
    with pytest.raises(ValueError, match=r"block1\.router\.bias"):
        checkpoint._refuse_unplaced(pipe_of("block0", "block1"), dict(model, **{"block0.router.bias": 0}), tmp_path)
    # a block split in halves over two ranks: its parameters are the two ranks' together
    checkpoint._refuse_unplaced(pipe_of("block0", "block0", local=[0]), model, tmp_path)
