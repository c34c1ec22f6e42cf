"""Per-layer statistics of the dynamic blocks (MoE, hash attention, MoD), as a case.

Each such block accumulates its own statistics over the step's forwards and exposes them as
`block.last_stats` (`dynmo.model.stats`); this case hands them to the metrics as
`<block>_<stat>` (e.g. `moe_tokens_per_expert`) and clears them every step.
"""

from __future__ import annotations

from typing import Any

from dynmo.dynamics.case import Case
from dynmo.model.stats import as_numbers


class BlockStats(Case):
    name = "block-stats"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.model.block != "dense"

    def before_step(self, step: int) -> list[dict]:
        for layer in self.host.layers().values():
            if hasattr(layer, "reset_stats"):
                layer.reset_stats()
        return []

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        prefix = self.host.cfg.model.block
        layers = self.host.layers()
        # a block may keep its sums on the device: read them all in one go, once per step
        stats = as_numbers([getattr(layer, "last_stats", None) or {} for layer in layers.values()])
        out: dict[str, dict[int, Any]] = {}
        for i, s in zip(layers, stats):
            for key, value in s.items():
                if isinstance(value, (int, float, list)):
                    out.setdefault(f"{prefix}_{key}", {})[i] = value
        return out
