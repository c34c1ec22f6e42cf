"""Per-layer statistics of the dynamic blocks (MoE, hash attention, MoD), as a case.

Each such block accumulates its own statistics over the step's forwards and exposes them as
`block.last_stats` (`dynmo.model.stats`); this case hands them to the metrics as
`<block>_<stat>` (e.g. `moe_tokens_per_expert`) and clears them every step.
"""

from __future__ import annotations

from typing import Any

from dynmo.dynamics.case import Case


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
        out: dict[str, dict[int, Any]] = {}
        for i, layer in self.host.layers().items():
            for key, value in (getattr(layer, "last_stats", None) or {}).items():
                if isinstance(value, (int, float, list)):
                    out.setdefault(f"{prefix}_{key}", {})[i] = value
        return out
