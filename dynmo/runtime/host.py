"""The view of one rank's pipeline that dynamic-model cases get (`dynmo.dynamics.case.Host`).

It reads the pipeline as it is at each call, so it stays right after migrations and re-packs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dynmo.runtime.pipeline import Pipeline


class PipelineHost:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe
        self.cfg = pipe.cfg

    @property
    def device(self) -> torch.device:
        return self.pipe.ctx.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pipe.dtype

    @property
    def microbatch(self) -> int:
        return self.pipe.microbatch

    @property
    def num_layers(self) -> int:
        return len(self.pipe.specs)

    @property
    def num_blocks(self) -> int:
        return self.cfg.model.n_layers

    def layers(self) -> dict[int, nn.Module]:
        return self.pipe.layers

    def blocks(self) -> dict[int, nn.Module]:
        layers = self.pipe.layers
        return {i: layers[i] for i in sorted(layers) if self.pipe.specs[i].is_block}

    def is_block(self, index: int) -> bool:
        return self.pipe.specs[index].is_block

    def block_number(self, index: int) -> int:
        n = self.pipe.specs[index].block
        if n is None:
            raise ValueError(f"layer {index} ({self.pipe.specs[index].name}) is not a transformer block")
        return n

    def add_params(self, index: int, names: list[str]) -> None:
        self.pipe.norm_slots.add(index, names)

    def part(self, index: int) -> str | None:
        return self.pipe.specs[index].part

    @property
    def model_group(self):
        return self.pipe.ctx.pp_group

    @property
    def replica_group(self):
        return self.pipe.ctx.dp_group

    @property
    def replicas(self) -> int:
        return self.pipe.ctx.dp

    @property
    def active_group(self):
        return self.pipe.ctx.active_group

    def optimizer_state(self, param: torch.Tensor) -> dict:
        return self.pipe.optimizer.state.get(param) or {}

    def optimizer_states(self) -> dict[int, dict]:
        return self.pipe.optimizer_states()

    def rebuild_optimizer(self, states: dict[int, dict]) -> None:
        self.pipe.rebuild_optimizer(states)
