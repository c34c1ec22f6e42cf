"""PNG plots of a trace replay (matplotlib, Agg backend; no display needed).

    write_plots(results, "plots/", title="skew, 24 stages x 30 dp")
      stage_loads.png   per policy: stage load (s per microbatch) of every stage over the steps
      bubble.png        bubble ratio per step, one line per policy
      layout.png        per policy: the stage boundaries (layer index) over the steps
      iteration.png     simulated step time (+ migration and decide time) per policy

    write_link_delay_plot(replay_link_delays(...), "plots/link_delay.png")
      mean step time per policy against the injected link delay, link-aware (solid) and
      compute-only (dashed) balancing
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from dynmo.sim.replay import PolicyResult


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, n)
    return math.ceil(n / cols), cols


def write_plots(results: Sequence[PolicyResult], out_dir: str | Path, title: str = "") -> list[Path]:
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    n = len(results)
    rows, cols = _grid(n)

    # stage loads: a heatmap per policy (stage x step), one colour scale for all
    vmax = max((max(max(l) for l in r.stage_loads) for r in results if r.stage_loads), default=1.0) * 1e3
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False, sharex=True,
                             layout="constrained")
    im = None
    for ax, r in zip(axes.flat, results):
        S = max(len(l) for l in r.stage_loads)
        grid = np.full((S, len(r.stage_loads)), np.nan)
        for k, loads in enumerate(r.stage_loads):
            grid[: len(loads), k] = np.asarray(loads) * 1e3
        im = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest", vmin=0, vmax=vmax,
                       cmap="viridis")
        ax.set_title(r.policy, fontsize=9)
        ax.set_ylabel("stage")
        ax.set_xlabel("step")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, label="stage load (ms per microbatch)", shrink=0.8)
    fig.suptitle(f"Stage loads over time{': ' + title if title else ''} (blank: released workers)", fontsize=10)
    paths.append(_save(fig, out / "stage_loads.png", plt))

    # bubble ratio over time
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        ax.plot(r.bubble_ratio, label=r.policy, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("bubble ratio")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Bubble ratio over time{': ' + title if title else ''}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "bubble.png", plt))

    # layout over time: stage boundaries (layer index) vs step
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False, sharex=True, sharey=True,
                             layout="constrained")
    for ax, r in zip(axes.flat, results):
        steps = np.arange(len(r.layouts))
        width = max(len(b) for b in r.layouts)
        for j in range(1, width - 1):
            ys = [b[j] if j < len(b) - 1 else np.nan for b in r.layouts]
            ax.step(steps, ys, where="post", lw=0.9)
        ax.set_title(r.policy, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("first layer of stage")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"Layout over time (stage boundaries){': ' + title if title else ''}", fontsize=10)
    paths.append(_save(fig, out / "layout.png", plt))

    # step time
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        ax.plot(np.asarray(r.iteration_s) + np.asarray(r.overhead_s), label=r.policy, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds (iteration + migration + decide)")
    ax.set_title(f"Simulated step time{': ' + title if title else ''}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "iteration.png", plt))
    return paths


def write_link_delay_plot(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Rows of `dynmo.sim.replay.replay_link_delays`: mean simulated step time against the
    delay factor, one colour per policy, solid with link-aware and dashed with compute-only
    balancing."""
    plt = _plt()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for i, p in enumerate(policies):
        for mode, style in (("measure", "-"), ("free", "--")):
            pts = sorted((r["factor"], r["mean_iteration_s"]) for r in rows if r["policy"] == p and r["links"] == mode)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, marker="o", color=f"C{i}", lw=1.2,
                        label=f"{p} ({'link-aware' if mode == 'measure' else 'compute-only'})")
    ax.set_xlabel("injected link delay (x base per transfer)")
    ax.set_ylabel("mean simulated step time (s)")
    ax.set_title(f"Link delay{': ' + title if title else ''}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
