"""Fitting the advisor: label a dataset's tensors by measuring every candidate, fit, evaluate.

    dynmo tensor fit-advisor runs/advisor-train --held-out runs/advisor-test --out advisor.json

Labels: for every tensor of a `dynmo tensor dataset` folder (its index.csv) or a .tns file, and
every candidate (format x reordering), the all-mode MTTKRP seconds at the rank and threads given:
each mode's least time over `repeats` rounds that interleave the candidates, summed
(`time_candidates` says why). They are appended, a tensor's candidates together, to `labels.csv` in
the dataset's folder (beside a .tns file: FILE.labels.csv), so a run stopped half way goes on at
the tensor where it was; labels of another rank or thread count are measured again.
Fit: per candidate, ridge regression of its log time over the tensor's best (advise.py) on the
standardized features, every candidate with the same ridge, chosen among RIDGES by leave-one-out
on the training tensors: the one whose picks, each made by a model fitted without that tensor, are
the least slower than the best candidate in geometric mean. A large ridge leaves only the
intercepts, each candidate's mean log ratio to the best, so when the features do not help the fit
falls back to the best fixed choice.
Evaluate: on each held-out tensor, the measured time of the pick over the best candidate's; the
geometric mean and the worst, against the best single fixed candidate.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np

from dynmo.tensor.advise import FEATURES, VERSION, advise, tensor_inputs, vector

REORDERS = ("none", "lexi", "bfs-mcs", "degree")
RIDGES = (1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 1e3)  # times the number of tensors
TIME_RIDGE = 1e-2  # the best candidate's time: shown, never picks, so not selected by leave-one-out


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


LABEL_FIELDS = ["file", "format", "reorder", "rank", "threads", "rounds", "seconds"]
MAX_ROUNDS = 200
CONTEND = 3.0


def _read_labels(path: Path, rank: int, threads: int) -> dict[tuple[str, str, str], float]:
    """The labels of `path` taken at this rank and threads (others are measured again)."""
    if not path.is_file():
        return {}
    with open(path) as fh:
        r = csv.DictReader(fh)
        if r.fieldnames != LABEL_FIELDS:
            raise ValueError(f"{path}: labels of another version (median timings); move it aside to measure again")
        out: dict[tuple[str, str, str], float] = {}
        for x in r:  # a tensor labelled again (--again) adds rounds: the least of all counts, as within a run
            if int(x["rank"]) == rank and int(x["threads"]) == threads:
                key = (x["file"], x["format"], x["reorder"])
                out[key] = min(out.get(key, math.inf), float(x["seconds"]))
        return out


def time_candidates(layouts: dict, sizes, rank: int, repeats: int, budget: float = 0.0, run=None,
                    clock=time.perf_counter) -> tuple[dict, dict]:
    """({candidate: all-mode seconds}, {candidate: rounds}): each mode's least time over the rounds, summed.

    The least, not the median: a shared machine's load can only slow a run, and a 2-thread run of
    a few milliseconds is slowed several times over whenever one of its threads waits for a core,
    so on a busy machine even the median of many runs measures the load; the fastest of enough
    runs is the kernel's own cost. Rounds interleave the candidates (one all-mode pass of each per
    round, the starting candidate rotated), so a burst of load falls on all of them alike instead
    of on whichever was being timed then. Every candidate gets `repeats` rounds; then those within
    CONTEND times the best so far (the ones a pick could be wrong between) get more rounds while
    the timed runs have taken less than `budget` seconds, at most MAX_ROUNDS: the close calls get
    the time, not the candidates many times slower. One untimed pass of each first (compiles,
    warms the caches). `run(layout, mode)` runs one MTTKRP (the kernels' by default).
    """
    if run is None:
        from dynmo.tensor.kernels import mttkrp
        from dynmo.tensor.kernels.common import stacked

        rng = np.random.default_rng(0)
        factors = [rng.random((s, rank)) for s in sizes]
        cache: dict = {}

        def run(lay, m):
            if lay.dtype not in cache:
                cache[lay.dtype] = (stacked(factors, lay.dtype),
                                    [np.empty((s, rank), dtype=lay.dtype) for s in sizes])
            st, outs = cache[lay.dtype]
            mttkrp(lay, factors, m, outs[m], st)

    names = list(layouts)
    modes = range(len(sizes))
    for c in names:
        for m in modes:
            run(layouts[c], m)
    best = {c: [math.inf] * len(sizes) for c in names}
    rounds = dict.fromkeys(names, 0)
    spent, k, todo = 0.0, 0, names
    while todo:
        for c in todo[k % len(todo):] + todo[:k % len(todo)]:
            for m in modes:
                t0 = clock()
                run(layouts[c], m)
                dt = clock() - t0
                best[c][m] = min(best[c][m], dt)
                spent += dt
            rounds[c] += 1
        k += 1
        if k >= repeats:
            lead = min(sum(v) for v in best.values())
            todo = [c for c in names if sum(best[c]) <= CONTEND * lead] if spent < budget and k < MAX_ROUNDS else []
    return {c: float(sum(v)) for c, v in best.items()}, rounds


def label(source: str, rank: int, threads: int, repeats: int, say: Callable[[str], None],
          measure: bool = True, budget: float = 0.0, again: bool = False) -> list[dict]:
    """[{"file", "inputs", "seconds": {(format, reorder): s}}] for every tensor of `source`, measured if not yet
    (with `measure` False: only the tensors whose every candidate is labelled already). A tensor's
    candidates are timed together (`time_candidates`) and written together, so a stopped run resumes
    at a whole tensor."""
    from dynmo.tensor.kernels import convert, set_threads
    from dynmo.tensor.reorder import reorder
    from dynmo.tensor.tns import read_tns

    files, out = tensor_files(source)
    done = _read_labels(out, rank, threads)
    set_threads(threads)
    rows = []
    for f in files:
        complete = all((f.name, fmt, reo) in done for fmt, reo in candidates())
        if not measure and not complete:
            continue
        t = read_tns(f)
        if measure and (again or not complete):
            layouts = {}
            for reo in REORDERS:
                tr = reorder(t, reo)[0] if reo != "none" else t
                for fmt, r in candidates():
                    if r == reo:
                        layouts[(fmt, reo)] = convert(tr, fmt)
                del tr
            got, rounds = time_candidates(layouts, t.sizes, rank, repeats, budget)
            del layouts
            new = not out.exists()
            with open(out, "a", newline="") as fh:
                w = csv.writer(fh)
                if new:
                    w.writerow(LABEL_FIELDS)
                for (fmt, reo), s in got.items():
                    w.writerow([f.name, fmt, reo, rank, threads, rounds[(fmt, reo)], repr(s)])
                    done[(f.name, fmt, reo)] = min(s, done.get((f.name, fmt, reo), math.inf))
        secs = {c: done[(f.name, *c)] for c in candidates()}
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
    seen = ~np.isnan(x)
    mean = np.where(seen.any(axis=0), np.where(seen, x, 0.0).sum(axis=0) / np.maximum(1, seen.sum(axis=0)), 0.0)
    x = np.where(seen, x, mean)  # as `predict` takes a feature the inputs lack: no say
    scale = x.std(axis=0)
    scale[scale == 0] = 1.0
    z = np.hstack([np.ones((len(rows), 1)), (x - mean) / scale])
    cands = candidates()
    logs = np.log([[r["seconds"][c] for c in cands] for r in rows])
    best = logs.min(axis=1)
    # The target is each candidate's log time over the tensor's best: what the pick is judged by,
    # free of how large the tensor is (which moves every candidate alike and would take the fit).
    y = logs - best[:, None]
    loo = {ridge: _loo_geomean(z, y, ridge) for ridge in RIDGES}
    ridge = min(RIDGES, key=lambda k: (round(loo[k], 6), -k))  # the least; on a tie the larger ridge
    coef = _solve(z, y, ridge)
    time_coef = _solve(z, best[:, None], TIME_RIDGE)[:, 0]
    return {"version": VERSION, "rank": rank, "threads": threads, "features": list(FEATURES),
            "mean": [float(v) for v in mean], "scale": [float(v) for v in scale],
            "low": [float(v) for v in x.min(axis=0)], "high": [float(v) for v in x.max(axis=0)],
            "time_coef": [float(c) for c in time_coef],
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
