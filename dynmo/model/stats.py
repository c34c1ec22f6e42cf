"""Per-layer statistics of a step (MoE loads, MoD rows, skipped attention tiles, exits).

A layer accumulates them over the forwards (microbatches) of one step in a `StepStats` and
exposes a summary as `layer.last_stats` ({} before its first forward), cleared by
`layer.reset_stats()`. Forwards that are not training work (a probe that measures how much a
block changed) run under `paused()`, so they leave every layer's statistics as they were.
"""

from __future__ import annotations

import weakref

import torch

_paused = 0
_live: "weakref.WeakSet[StepStats]" = weakref.WeakSet()  # every StepStats alive, for `Paused`


class Paused:
    """Forwards inside this block leave every `StepStats` as it was. The forwards still add (a
    layer's code is the same paused or not), and leaving the block restores what every
    `StepStats` held on entering it: a compiled unit's graph then does not depend on the pause
    (a check of a global flag inside the forward made the compiler guard on it, so a checkpoint's
    recomputation ran another graph than the forward, which saved other tensors, and backward
    failed). One object may be entered again after it was left: torch's checkpoint enters its
    recomputation context once per recomputation, and a zero-bubble schedule recomputes a
    checkpointed layer twice, for the input gradient and again for the weight gradient."""

    def __init__(self):
        self._kept: list[tuple[StepStats, int, dict]] = []

    def __enter__(self) -> "Paused":
        global _paused
        _paused += 1
        self._kept = [(s, s.forwards, dict(s.sums)) for s in list(_live)]  # sums are replaced, never changed in place
        return self

    def __exit__(self, *exc) -> None:
        global _paused
        _paused -= 1
        for s, forwards, sums in self._kept:
            s.forwards, s.sums = forwards, sums
        self._kept = []


def paused() -> Paused:
    """A context inside which forwards leave the `StepStats` as they were (`Paused`)."""
    return Paused()


def is_paused() -> bool:
    """Whether forwards now are outside training work (`paused`), e.g. a recomputation: for
    hooks, outside a compiled graph (the noise injector's)."""
    return _paused > 0


class StepStats:
    """Sums of per-forward quantities since the last reset. Values are python numbers or lists,
    or tensors, summed where they are (on the device, no synchronisation per forward); the
    metrics read them once per step (`as_numbers`). Each sum is replaced by a new value, never
    changed in place, so `Paused` can keep and restore them."""

    def __init__(self):
        self.forwards = 0
        self.sums: dict[str, float | list[float]] = {}
        _live.add(self)

    def add(self, **values) -> None:
        self.forwards += 1
        for key, v in values.items():
            if isinstance(v, list):
                old = self.sums.get(key)
                self.sums[key] = v if old is None else [a + b for a, b in zip(old, v)]
            elif key not in self.sums:  # the first value as it is: an addition to 0 would be one more operator
                self.sums[key] = v
            else:
                self.sums[key] = self.sums[key] + v

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
