"""From per-layer times and a layout to per-stage times (the simulator's input)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dynmo.layout import Layout, LayoutError


def stage_times(layer_times, layout: Layout, speeds: Sequence[float] | None = None) -> np.ndarray:
    """Sum layer times over each stage of `layout`.

    layer_times: one time per layer, or one row of per-microbatch times per layer.
    speeds: optional relative speed of each stage's worker (time is divided by it).
    Returns shape (stages,) or (stages, microbatches), ready for `simulate`.
    """
    a = np.asarray(layer_times, dtype=float)
    if a.ndim not in (1, 2) or a.shape[0] != layout.num_layers:
        raise LayoutError(
            f"{a.shape[0] if a.ndim else 0} layer times for a layout of {layout.num_layers} layers"
        )
    out = np.add.reduceat(a, np.asarray(layout.boundaries[:-1]), axis=0)
    if speeds is not None:
        sp = np.asarray(speeds, dtype=float)
        if sp.shape != (layout.num_stages,) or np.any(sp <= 0):
            raise LayoutError(f"need {layout.num_stages} positive stage speeds")
        out = out / (sp if out.ndim == 1 else sp[:, None])
    return out
