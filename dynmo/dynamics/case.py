"""The plug-in interface for dynamic-model cases (pruning, freezing, early exit, MoE, ...).

A case is a class registered with `@register_case("name")`. The trainer builds one instance
per rank, for every registered case whose `enabled(cfg)` is true, and calls it at fixed
points of each step on every rank:

    before_step(step)          may change the model or its control flow (prune, freeze, let
                               tokens exit, ...). Runs after the step's re-layout, so it sees
                               the layers this rank holds for the step. Returns events.
    after_step(step, result)   after the optimizer step (e.g. keep pruned weights at zero).
                               Returns events.
    layer_stats()              per-layer quantities of this rank's layers for the metrics:
                               {metric name: {global layer index: number or list of numbers}}.
                               The trainer merges all ranks into `metrics.jsonl` as one list
                               per metric over all layers (None where a layer has no value),
                               averaging data-parallel replicas.
    state() / load_state(d)    the case's own state (JSON-able) for checkpoints: saved in
                               `dynmo.json`; on resume handed back *before* the weights load
                               (e.g. re-freeze blocks, so no optimizer state is expected for
                               them), then `after_load(step)` runs *after* (e.g. rebuild masks
                               from the loaded weights).
    pack_layer(i, layer)       extra per-layer state that must travel with layer i when it
                               migrates to another rank: {key: tensor} (masks, references);
    unpack_layer(i, layer, t)  restores it on the receiving rank after the layer is rebuilt.

An event whose "type" is "dynamism" says the model's work changed at this step (e.g. a pruning
step, a block frozen); `balance.when = "dynamism"` rebalances after such steps, as the paper's
Algorithm 1 does. Other events are only logged.

Cases reach the run through `self.trainer`: `trainer.pipe.layers` ({layer index: module} on
this rank), `trainer.pipe.specs`, `trainer.pipe.optimizer`, `trainer.ctx` (ranks and process
groups), `trainer.cfg`. A case that needs a collective must call it on every rank of the
groups it uses, in the same order (all cases run on all ranks in registry order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

if TYPE_CHECKING:  # the runtime imports the cases, not the other way round
    from dynmo.config import Config
    from dynmo.train import Trainer

CASES: dict[str, type["Case"]] = {}


def register_case(name: str) -> Callable[[type["Case"]], type["Case"]]:
    def deco(cls: type[Case]) -> type[Case]:
        cls.name = name
        CASES[name] = cls
        return cls

    return deco


class Case:
    name = "case"

    @classmethod
    def enabled(cls, cfg: "Config") -> bool:
        return False

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer

    def before_step(self, step: int) -> list[dict]:
        return []

    def after_step(self, step: int, result: Any) -> list[dict]:
        return []

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        return {}

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def after_load(self, step: int) -> None:
        pass

    def pack_layer(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        return {}

    def unpack_layer(self, index: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        pass


@register_case("block-stats")
class BlockStats(Case):
    """Per-layer statistics of the dynamic blocks (MoE, hash attention, MoD).

    Each such block accumulates its own statistics over the step's forwards and exposes them
    as `block.last_stats` (see `dynmo.dynamics.StepStats`); this case hands them to the
    metrics as `<block>_<stat>` (e.g. `moe_tokens_per_expert`) and clears them every step.
    """

    @classmethod
    def enabled(cls, cfg: "Config") -> bool:
        return cfg.model.block != "dense"

    def before_step(self, step: int) -> list[dict]:
        for layer in self.trainer.pipe.layers.values():
            if hasattr(layer, "reset_stats"):
                layer.reset_stats()
        return []

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        prefix = self.trainer.cfg.model.block
        out: dict[str, dict[int, Any]] = {}
        for i, layer in self.trainer.pipe.layers.items():
            for key, value in (getattr(layer, "last_stats", None) or {}).items():
                if isinstance(value, (int, float, list)):
                    out.setdefault(f"{prefix}_{key}", {})[i] = value
        return out


def merge_layer_stats(parts: list[dict[str, dict[int, Any]]], num_layers: int) -> dict[str, list]:
    """Merge every rank's `layer_stats()` into one list per metric, replicas averaged."""
    sums: dict[str, dict[int, Any]] = {}
    counts: dict[str, dict[int, int]] = {}
    for part in parts:
        for key, per_layer in part.items():
            for i, v in per_layer.items():
                s = sums.setdefault(key, {})
                if i in s:
                    s[i] = [a + b for a, b in zip(s[i], v)] if isinstance(v, list) else s[i] + v
                else:
                    s[i] = list(v) if isinstance(v, list) else v
                counts.setdefault(key, {})[i] = counts.get(key, {}).get(i, 0) + 1
    out: dict[str, list] = {}
    for key, s in sums.items():
        row: list = [None] * num_layers
        for i, v in s.items():
            n = counts[key][i]
            row[i] = [a / n for a in v] if isinstance(v, list) else v / n
        out[key] = row
    return out
