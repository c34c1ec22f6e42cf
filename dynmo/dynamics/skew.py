"""Injected, known imbalance for tests, demos and benchmarks (`[skew]`, configs/skewed.toml).

From `skew.start_step` on, the MLP of each listed block runs `skew.factor` times: the extra
passes are real forward and backward work whose result is multiplied by zero (y + 0 * z == y),
so the model's math is unchanged and only its cost moves. A forward hook on the block's `mlp`
does it, so it works on every block that has one, on every path through the block (with
`parallel.unit = "sublayer"`, on the block's MLP half).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dynmo.dynamics.case import Case


class Skew(Case):
    name = "skew"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.skew.factor > 1

    def __init__(self, host):
        super().__init__(host)
        self.opts = host.cfg.skew
        self.hooked: dict[int, tuple[nn.Module, object]] = {}  # layer -> (its mlp, hook handle)

    def before_step(self, step: int) -> list[dict]:
        on = step >= self.opts.start_step
        want = {
            i: block.mlp
            for i, block in self.host.blocks().items()
            if on and self.host.block_number(i) in self.opts.blocks and getattr(block, "mlp", None) is not None
        }
        for i, (mlp, handle) in list(self.hooked.items()):
            if want.get(i) is not mlp:  # switched off, or the layer left or was rebuilt by a migration
                handle.remove()
                del self.hooked[i]
        for i, mlp in want.items():
            if i not in self.hooked:
                self.hooked[i] = (mlp, mlp.register_forward_hook(self._extra_passes))
        if on and step == self.opts.start_step:
            return [{"type": "dynamism", "case": "skew", "blocks": self.opts.blocks, "factor": self.opts.factor}]
        return []

    def _extra_passes(self, mlp: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        for _ in range(self.opts.factor - 1):
            out = out + 0.0 * mlp.forward(*args)  # .forward: not through the hooks again
        return out
