"""Fitting the advisor: label a dataset's tensors by measuring every candidate, fit, evaluate.

    dynmo tensor fit-advisor runs/advisor-train --held-out runs/advisor-test --out advisor.json

Labels: for every tensor of a `dynmo tensor dataset` folder (its index.csv) or a .tns file, and
every candidate (format x reordering), the all-mode MTTKRP seconds (each mode's median over the
repeats, summed) at the rank and threads given, appended to `labels.csv` in the dataset's folder
(beside a .tns file: FILE.labels.csv), so a run stopped half way goes on where it was.
Fit: per candidate, ridge regression of log seconds on the standardized features (advise.py),
every candidate with the same ridge, chosen among RIDGES by leave-one-out on the training tensors:
the one whose picks, each made by a model fitted without that tensor, are the least slower than
the best candidate in geometric mean. A large ridge leaves only the intercepts, each candidate's
mean log time, so when the features do not help the fit falls back to the best fixed choice.
Evaluate: on each held-out tensor, the measured time of the pick over the best candidate's; the
geometric mean and the worst, against the best single fixed candidate.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Callable

import numpy as np

from dynmo.tensor.advise import FEATURES, advise, tensor_inputs, vector

REORDERS = ("none", "lexi", "bfs-mcs", "degree")
RIDGES = (1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 1e3)  # times the number of tensors


def candidates() -> list[tuple[str, str]]:
    from dynmo.tensor.kernels import FORMATS

    return [(f, r) for r in REORDERS for f in FORMATS]


def tensor_files(source: str) -> tuple[list[Path], Path]:
    """(the tensors of a dataset folder or one .tns, where their labels go)."""
    p = Path(source)
    if p.is_dir():
        index = p / "index.csv"
        if not index.is_file():
            raise ValueError(f"{source}: a folder without index.csv; make it with `dynmo tensor dataset`")
        with open(index) as fh:
            return [p / row["file"] for row in csv.DictReader(fh)], p / "labels.csv"
    if not p.is_file():
        raise ValueError(f"{source}: no such file or folder")
    return [p], p.with_name(p.name + ".labels.csv")


def _read_labels(path: Path) -> dict[tuple[str, str, str], float]:
    if not path.is_file():
        return {}
    with open(path) as fh:
        return {(r["file"], r["format"], r["reorder"]): float(r["seconds"]) for r in csv.DictReader(fh)}


def label(source: str, rank: int, threads: int, repeats: int, say: Callable[[str], None],
          measure: bool = True) -> list[dict]:
    """[{"file", "inputs", "seconds": {(format, reorder): s}}] for every tensor of `source`, measured if not yet
    (with `measure` False: only the tensors whose every candidate is labelled already)."""
    from dynmo.tensor.kernels import convert, set_threads, time_mttkrp
    from dynmo.tensor.reorder import reorder
    from dynmo.tensor.tns import read_tns

    files, out = tensor_files(source)
    done = _read_labels(out)
    set_threads(threads)
    rows = []
    for f in files:
        if not measure and any((f.name, fmt, reo) not in done for fmt, reo in candidates()):
            continue
        t = read_tns(f)
        secs = {}
        for reo in REORDERS:
            todo = [fmt for fmt, r in candidates() if r == reo and (f.name, fmt, reo) not in done]
            tr = reorder(t, reo)[0] if todo and reo != "none" else t
            for fmt in todo:
                s = sum(time_mttkrp(convert(tr, fmt), rank, list(range(t.order)), repeats))
                done[(f.name, fmt, reo)] = s
                new = not out.exists()
                with open(out, "a", newline="") as fh:
                    w = csv.writer(fh)
                    if new:
                        w.writerow(["file", "format", "reorder", "seconds"])
                    w.writerow([f.name, fmt, reo, repr(s)])
            for fmt, r in candidates():
                if r == reo:
                    secs[(fmt, reo)] = done[(f.name, fmt, reo)]
        say(f"{f.name}: nnz {t.nnz}, best {min(secs, key=secs.get)} {min(secs.values()) * 1e3:.1f} ms")
        rows.append({"file": str(f), "inputs": tensor_inputs(t), "seconds": secs})
    return rows


def _solve(z: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
    """Ridge coefficients (features + 1 x candidates) of every column of `y`; the intercept is not shrunk."""
    pen = ridge * z.shape[0] * np.eye(z.shape[1])
    pen[0, 0] = 0.0
    return np.linalg.solve(z.T @ z + pen, z.T @ y)


def _loo_geomean(z: np.ndarray, y: np.ndarray, ridge: float) -> float:
    """Geometric mean over the tensors of the measured time of the pick of a model fitted without it, over
    the best candidate's."""
    logs = []
    for i in range(z.shape[0]):
        keep = np.arange(z.shape[0]) != i
        pick = int(np.argmin(z[i] @ _solve(z[keep], y[keep], ridge)))
        logs.append(y[i, pick] - y[i].min())
    return math.exp(float(np.mean(logs)))


def fit(rows: list[dict], rank: int, threads: int) -> dict:
    x = np.array([vector(r["inputs"], rank) for r in rows])
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale == 0] = 1.0
    z = np.hstack([np.ones((len(rows), 1)), (x - mean) / scale])
    cands = candidates()
    y = np.log([[r["seconds"][c] for c in cands] for r in rows])
    loo = {ridge: _loo_geomean(z, y, ridge) for ridge in RIDGES}
    ridge = min(RIDGES, key=lambda k: (round(loo[k], 6), -k))  # the least; on a tie the larger ridge
    coef = _solve(z, y, ridge)
    return {"version": 1, "rank": rank, "threads": threads, "features": list(FEATURES),
            "mean": [float(v) for v in mean], "scale": [float(v) for v in scale],
            "low": [float(v) for v in x.min(axis=0)], "high": [float(v) for v in x.max(axis=0)],
            "candidates": [{"format": f, "reorder": r, "coef": [float(c) for c in coef[:, k]]}
                           for k, (f, r) in enumerate(cands)],
            "ridge": ridge, "leave_one_out_geomean": loo[ridge], "trained_on": len(rows)}


def evaluate(model: dict, rows: list[dict]) -> dict:
    """Per tensor the pick's measured time over the best's, their geometric mean and worst, and the
    same for the best single fixed candidate."""
    per, ratios = [], []
    for r in rows:
        a = advise(r["inputs"], model)
        pick = (a["pick"]["format"], a["pick"]["reorder"])
        best = min(r["seconds"].values())
        ratios.append(r["seconds"][pick] / best)
        per.append({"file": Path(r["file"]).name, "pick": "+".join(pick),
                    "best": "+".join(min(r["seconds"], key=r["seconds"].get)), "ratio": ratios[-1]})
    fixed = {c: math.exp(np.mean([math.log(r["seconds"][c] / min(r["seconds"].values())) for r in rows]))
             for c in candidates()}
    best_fixed = min(fixed, key=fixed.get)
    return {"tensors": per, "geomean": math.exp(np.mean(np.log(ratios))), "worst": max(ratios),
            "best_fixed": "+".join(best_fixed), "best_fixed_geomean": fixed[best_fixed],
            "best_fixed_worst": max(r["seconds"][best_fixed] / min(r["seconds"].values()) for r in rows)}
