"""Features out: a readable table, one CSV row per tensor, and the distributions' plot.

The JSON document is `TensorFeatures.to_dict()` (dynmo.tensor.features). The CSV is wide, one
row per tensor under a header, so the features of many tensors stack into one data set:
the general features, then `KIND_MODES_STAT` for every distribution (`nnz_per_slice_0-1_cv`:
the cv of nonzeros per slice of free modes 0 and 1).
"""

from __future__ import annotations

import csv
import io

import numpy as np

from dynmo.tensor.features import KINDS, STATS, TensorFeatures

GENERAL = ("name", "order", "nnz", "density", "slice_cnt", "fiber_cnt", "nnz_slice_cnt", "nnz_fiber_cnt",
           "slice_density", "fiber_density")


def fmt(x) -> str:
    """Integers whole, other numbers to six significant digits (what FeaTensor prints)."""
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    return f"{x:.6g}"


def _modes(modes) -> str:
    return "-".join(str(m) for m in modes)


def csv_row(f: TensorFeatures) -> dict[str, str]:
    row = {"name": f.name, "order": str(f.order)}
    row |= {f"size_{m}": str(s) for m, s in enumerate(f.sizes)}
    row |= {k: fmt(getattr(f, k)) for k in GENERAL[2:]}
    for d in f.distributions:
        stats = d.stats()
        row |= {f"{d.kind}_{_modes(d.free_modes)}_{s}": fmt(stats[s]) for s in STATS}
    return row


def to_csv(f: TensorFeatures) -> str:
    row = csv_row(f)
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(row), lineterminator="\n")
    w.writeheader()
    w.writerow(row)
    return out.getvalue()


def table(f: TensorFeatures) -> str:
    """The features as text: the general ones, then one table per kind (a row per choice of modes)."""
    lines = [f"tensor {f.name or '(unnamed)'}: order {f.order}, sizes {' x '.join(map(str, f.sizes))}, "
             f"nnz {f.nnz}, density {fmt(f.density)}",
             f"slices {f.slice_cnt} ({f.nnz_slice_cnt} nonempty, {fmt(f.slice_density)}), "
             f"fibers {f.fiber_cnt} ({f.nnz_fiber_cnt} nonempty, {fmt(f.fiber_density)})"]
    for kind in KINDS:
        ds = f.of(kind)
        head = ["free modes"] + list(STATS)
        rows = [[",".join(map(str, d.free_modes))] + [fmt(v) for v in d.stats().values()] for d in ds]
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        note = " (fibers of the higher free mode)" if kind == "fibers_per_slice" else ""
        lines += ["", f"{kind}{note}:", "  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines) + "\n"


def plot(f: TensorFeatures, path: str) -> None:
    """Log-log distributions: how many slices (fibers) hold k nonzeros, one line per mode choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    titles = {"nnz_per_slice": "nonzeros per slice", "nnz_per_fiber": "nonzeros per fiber",
              "fibers_per_slice": "fibers per slice"}
    for ax, kind in zip(axes, KINDS):
        for d in f.of(kind):
            c = np.sort(d.counts)
            starts = np.flatnonzero(np.concatenate(([True], c[1:] != c[:-1])))
            ax.loglog(c[starts], np.diff(np.append(starts, c.size)), marker=".", linestyle="none", markersize=4,
                      alpha=0.7, label=f"free modes {_modes(d.free_modes)}")
        ax.set_title(titles[kind])
        ax.set_xlabel("count k (nonempty only)")
        ax.set_ylabel("groups with count k")
        ax.legend(fontsize=7)
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(f"{f.name}: order {f.order}, sizes {' x '.join(map(str, f.sizes))}, nnz {f.nnz}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
