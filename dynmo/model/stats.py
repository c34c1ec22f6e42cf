"""Per-layer statistics of a step (MoE loads, MoD rows, skipped attention tiles, exits).

A layer accumulates them over the forwards (microbatches) of one step in a `StepStats` and
exposes a summary as `layer.last_stats` ({} before its first forward), cleared by
`layer.reset_stats()`. Forwards that are not training work (a probe that measures how much a
block changed) run under `paused()`, so they leave every layer's statistics as they were.
"""

from __future__ import annotations

import torch

_paused = 0


class Paused:
    """Forwards inside this block add nothing to any `StepStats`. One object may be entered again
    after it was left: torch's checkpoint enters its recomputation context once per
    recomputation, and a zero-bubble schedule recomputes a checkpointed layer twice, for the
    input gradient and again for the weight gradient (a generator's context runs once)."""

    def __enter__(self) -> "Paused":
        global _paused
        _paused += 1
        return self

    def __exit__(self, *exc) -> None:
        global _paused
        _paused -= 1


def paused() -> Paused:
    """A context inside which forwards add nothing to any `StepStats` (`Paused`)."""
    return Paused()


def is_paused() -> bool:
    """Whether forwards now are outside training work (`paused`), e.g. a recomputation."""
    return _paused > 0


class StepStats:
    """Sums of per-forward quantities since the last reset. Values are python numbers or lists,
    or tensors, summed where they are (on the device, no synchronisation per forward); the
    metrics read them once per step (`as_numbers`)."""

    def __init__(self):
        self.forwards = 0
        self.sums: dict[str, float | list[float]] = {}

    def add(self, **values) -> None:
        if _paused:
            return
        self.forwards += 1
        for key, v in values.items():
            if isinstance(v, list):
                old = self.sums.get(key)
                self.sums[key] = v if old is None else [a + b for a, b in zip(old, v)]
            else:
                self.sums[key] = self.sums.get(key, 0) + v

    def mean(self, key: str) -> float:
        return self.sums[key] / self.forwards if self.forwards else 0.0


def as_numbers(stats: list[dict]) -> list[dict]:
    """Copies of the dicts `stats` with each tensor value a python number (0-dim) or list. All
    the tensors of a device and kind (integer or float) come over in one transfer, so a step's
    statistics cost one synchronisation, not one per layer and statistic."""
    out = [dict(d) for d in stats]
    groups: dict[tuple, list] = {}
    for i, d in enumerate(stats):
        for key, v in d.items():
            if isinstance(v, torch.Tensor):
                groups.setdefault((v.device, v.is_floating_point()), []).append((i, key, v))
    for (_, is_float), items in groups.items():
        kind = torch.float64 if is_float else torch.int64
        flat = torch.cat([v.detach().reshape(-1).to(kind) for _, _, v in items]).tolist()
        at = 0
        for i, key, v in items:
            out[i][key] = flat[at] if v.dim() == 0 else flat[at:at + v.numel()]
            at += v.numel()
    return out
