"""Plots of the real runs over the steps."""

from __future__ import annotations

from pathlib import Path


def write_real_plots(name: str, runs: dict[str, list[list[dict]]], out_dir: Path) -> None:
    """The real runs over the steps: stage compute (uniform vs dynmo), dynmo's layout, and
    tokens/s per worker of every variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    shown = [v for v in ("uniform", "dynmo", "repack") if runs.get(v)]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 3.2), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, v in zip(axes.flat, shown):
        recs = runs[v][0]
        for j in range(max(len(r["stage_compute_s"]) for r in recs)):
            ax.plot([r["step"] for r in recs], [r["stage_compute_s"][j] if j < len(r["stage_compute_s"]) else float("nan")
                                                for r in recs], label=f"stage {j}", lw=1)
        ax.set_title(f"{name}: {v}", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes.flat[0].set_ylabel("stage compute (s per step)")
    fig.savefig(out_dir / "real_stage_loads.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.2), layout="constrained")
    recs = runs["dynmo"][0]
    inner = max(len(r["layout"]) for r in recs) - 2
    for j in range(inner):
        ax.step([r["step"] for r in recs], [r["layout"][j + 1] if j + 1 < len(r["layout"]) - 1 else float("nan")
                                            for r in recs], where="post", label=f"boundary {j + 1}")
    ax.set_title(f"{name}: dynmo's layout", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("first layer of stage")
    ax.legend(fontsize=7)
    fig.savefig(out_dir / "real_layout.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.2), layout="constrained")
    for v, rs in runs.items():
        recs = rs[0][1:]
        ax.plot([r["step"] for r in recs], [r["tokens_per_s"] / r.get("workers", 2) for r in recs], label=v, lw=1)
    ax.set_title(f"{name}: tokens/s per worker", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.savefig(out_dir / "real_per_worker.png", dpi=110)
    plt.close(fig)
