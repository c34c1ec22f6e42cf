"""The plug-in interface for dynamic-model cases (pruning, freezing, early exit, the skew, ...).

A case is a subclass of `Case` listed in `dynmo.dynamics.registry.CASES`. The trainer builds one
instance per rank, for every listed case whose `enabled(cfg)` is true, hands it a `Host` (the
narrow view of the run a case may use) and calls it at fixed points of each step on every rank:

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
    prepare_layer(i, layer)    a layer this rank has just built because it arrived by
                               migration, *before* its weights load: apply the case's
                               structural changes (e.g. add an exit classifier) so the
                               arriving weights fit.
    pack_layer(i, layer)       extra per-layer state that must travel with layer i when it
                               migrates to another rank: {key: tensor} (masks, references);
    unpack_layer(i, layer, t)  restores it on the receiving rank after the weights loaded.

An event whose "type" is "dynamism" says the model's work changed at this step (e.g. a pruning
step, a block frozen); `balance.when = "dynamism"` rebalances after such steps, as the paper's
Algorithm 1 does. Other events are only logged.

A case that needs a collective must call it on every rank of the groups it uses, in the same
order (all cases run on all ranks in the order of `dynmo.dynamics.registry.CASES`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from dynmo.config import Config


class Host(Protocol):
    """What a case may use of the run on its rank. It reads the pipeline as it is now, so it
    stays valid across migrations and re-packs."""

    cfg: "Config"  # the run's configuration (read it, never change it)

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype layers compute in (`train.dtype`; parameters are float32 either way)."""

    @property
    def microbatch(self) -> int:
        """Sequences per microbatch."""

    @property
    def num_layers(self) -> int:
        """Placement units of the whole model (embedding, blocks or half blocks, head): the
        range of the global layer indices below."""

    @property
    def num_blocks(self) -> int:
        """Transformer blocks of the whole model (a block placed as two halves counts once)."""

    def layers(self) -> dict[int, nn.Module]:
        """This rank's layers by global layer index."""

    def blocks(self) -> dict[int, nn.Module]:
        """This rank's transformer blocks, or half blocks with `parallel.unit = "sublayer"`, by
        global layer index, in layer order."""

    def is_block(self, index: int) -> bool:
        """Whether global layer `index` is a transformer block or half of one."""

    def block_number(self, index: int) -> int:
        """0-based block number of global layer `index` (a block or half of one)."""

    def part(self, index: int) -> str | None:
        """"attn" or "mlp" for a half block (`dynmo.model.layers.LayerSpec.part`), else None."""

    def add_params(self, index: int, names: list[str]) -> None:
        """Declare the parameters (names within the layer) a case adds to layer `index`, after
        the layer's own: call it alike on every rank for every layer, held or not, so the
        gradient norm of a block placed as two halves sums them where the whole block would."""

    # process groups (None where a group would have one rank)
    @property
    def model_group(self) -> Any:
        """The pipeline ranks of this replica: a sum over it sees every layer once."""

    @property
    def replica_group(self) -> Any:
        """The data-parallel peers that hold the same layers as this rank."""

    @property
    def replicas(self) -> int:
        """Data-parallel replicas."""

    @property
    def active_group(self) -> Any:
        """Every rank still training (all replicas)."""

    # the optimizer: a case that replaces, narrows or freezes parameters rebuilds it
    def optimizer_state(self, param: torch.Tensor) -> dict:
        """The AdamW state of a local parameter ({} before its first step)."""

    def optimizer_states(self) -> dict[int, dict]:
        """{local layer index: its AdamW state by parameter name}."""

    def rebuild_optimizer(self, states: dict[int, dict]) -> None:
        """A new optimizer over the local layers as they are now, carrying `states`."""


class Case:
    name = "case"
    section = ""  # the config section whose `enabled` switches the case on; its values are `self.opts`

    @classmethod
    def enabled(cls, cfg: "Config") -> bool:
        return bool(cls.section) and bool(getattr(cfg, cls.section).enabled)

    def __init__(self, host: Host):
        self.host = host
        self.opts = getattr(host.cfg, self.section) if self.section else None

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

    def prepare_layer(self, index: int, layer: nn.Module) -> None:
        pass

    def pack_layer(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        return {}

    def unpack_layer(self, index: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        pass
