"""The advisor: which format and ordering make MTTKRP fastest, predicted from features alone.

Inputs are cheap features: the order, nnz, the sizes and, per mode, the nonempty slices, the cv
and largest count of nonzeros per nonempty slice, and how far the mode's numbering already puts
its heavy slices first (`heavy_first`). One `bincount` per mode and a sort of its nonempty slices:
the tensor is never timed, sorted by nonzero or converted. They come from the tensor
(`tensor_inputs`) or, for an order-3 tensor, from the JSON of `dynmo tensor features`
(`json_inputs`, so `features --memory-gb` on a tensor larger than memory feeds it too); that JSON
holds no numbering, so `heavy_first` is missing there and counts as its training mean (no say).

The model (`advisor.json` beside this file, or one refitted by `dynmo tensor fit-advisor`) is a
JSON file: per candidate (format, reordering) the coefficients of a ridge regression of the log
of its measured all-mode MTTKRP time over the tensor's best candidate's on the standardized
features; one more regression of the best's log time (shown, never deciding); and each feature's
range over the training tensors: a feature outside it is clipped to it before predicting, so a
tensor unlike any seen is not extrapolated along a line. No code runs when it is loaded. The pick
is the candidate of the least predicted ratio.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

MODEL = Path(__file__).with_name("advisor.json")
VERSION = 2
FEATURES = ("log_nnz", "order", "log_size_mean", "log_size_max", "log_size_min", "log_density",
            "log_nnz_per_slice_mean", "log_nnz_per_slice_min", "log1p_cv_mean", "log1p_cv_max",
            "slice_density_mean", "slice_density_min", "log_max_share_max", "log_factor_rows",
            "heavy_first")


class AdviseError(ValueError):
    """Input the advisor cannot use; one line that says why."""


def tensor_inputs(t) -> dict:
    """The advisor's inputs of a SparseTensor: per mode the nonzeros of each nonempty slice."""
    modes = []
    for m, s in enumerate(t.sizes):
        cnt = np.bincount(t.coords[m], minlength=s)
        nz = cnt[cnt > 0].astype(np.float64)
        mean = nz.mean()
        modes.append({"size": int(s), "nz_cnt": int(nz.size), "cv_onlynz": float(nz.std() / mean), "max": int(nz.max()),
                      "heavy_first": heavy_first(cnt)})
    return {"order": t.order, "nnz": t.nnz, "modes": modes}


def heavy_first(cnt: np.ndarray) -> float:
    """How far a mode's numbering already puts its heavy slices first: the rank correlation of a
    nonempty slice's nonzero count with its index, negated (1: numbered heaviest first, as `degree`
    numbers them; about 0: numbered at random; 0 when every slice holds as many).

    Whether an ordering pays off depends on the numbering the tensor comes with, which the counts
    alone cannot see: words numbered by first appearance are already nearly heaviest first, a
    sibling's slices are numbered at random. It costs two sorts of the nonempty slices per mode
    (not of the nonzeros)."""
    idx = np.flatnonzero(cnt)
    if idx.size < 3:
        return 0.0
    c = cnt[idx].astype(np.float64)
    _, inv, n = np.unique(c, return_inverse=True, return_counts=True)
    rc = (np.cumsum(n) - (n + 1) / 2.0)[inv]  # ties (many slices of one nonzero) share their mean rank
    ri = np.arange(idx.size, dtype=np.float64)  # idx is ascending: its ranks are its positions
    sd = rc.std() * ri.std()
    return float(-np.mean((rc - rc.mean()) * (ri - ri.mean())) / sd) if sd > 0 else 0.0


def json_inputs(doc: dict) -> dict:
    """The same inputs from `dynmo tensor features --json` of an order-3 tensor (its slices of two free
    modes are the third mode's slices), but `heavy_first`: the JSON holds no numbering."""
    try:
        order, sizes, nnz = int(doc["order"]), [int(s) for s in doc["sizes"]], int(doc["nnz"])
        slices = doc["nnz_per_slice"]
    except (KeyError, TypeError, ValueError):
        raise AdviseError("not the JSON of `dynmo tensor features` (order, sizes, nnz, nnz_per_slice)") from None
    if order != 3:
        raise AdviseError(f"a features JSON of order {order}: its slices are not one mode's slices; give the .tns "
                          "(advise reads only per-mode counts from it)")
    modes = [None] * 3
    for e in slices:
        (m,) = set(range(3)) - set(e["free_modes"])
        modes[m] = {"size": sizes[m], "nz_cnt": int(e["nz_cnt"]), "cv_onlynz": float(e["cv_onlynz"]),
                    "max": int(e["max"])}
    if any(x is None for x in modes):
        raise AdviseError("the features JSON lacks a slice entry of some mode")
    return {"order": order, "nnz": nnz, "modes": modes}


def vector(inp: dict, rank: int = 16) -> np.ndarray:
    """The features, named as FEATURES."""
    nnz, modes = inp["nnz"], inp["modes"]
    ls = np.log([m["size"] for m in modes])
    per = np.log([nnz / m["nz_cnt"] for m in modes])
    cv = np.log1p([m["cv_onlynz"] for m in modes])
    sd = np.array([m["nz_cnt"] / m["size"] for m in modes])
    share = np.log([m["max"] / nnz for m in modes])
    heavy = [m.get("heavy_first") for m in modes]
    return np.array([math.log(nnz), inp["order"], ls.mean(), ls.max(), ls.min(), math.log(nnz) - ls.sum(),
                     per.mean(), per.min(), cv.mean(), cv.max(), sd.mean(), sd.min(), share.max(),
                     math.log(sum(m["size"] for m in modes) * rank),
                     float(np.mean(heavy)) if None not in heavy else math.nan])  # nan: not in the inputs


def load_model(path=None) -> dict:
    p = Path(path) if path else MODEL
    try:
        doc = json.loads(p.read_text())
        assert doc["version"] == VERSION and doc["features"] == list(FEATURES)
        for c in doc["candidates"]:
            assert len(c["coef"]) == len(FEATURES) + 1 and c["format"] and c["reorder"]
        assert len(doc["time_coef"]) == len(FEATURES) + 1
        assert len(doc["mean"]) == len(doc["scale"]) == len(doc["low"]) == len(doc["high"]) == len(FEATURES)
    except FileNotFoundError:
        raise AdviseError(f"{p}: no such model; fit one with `dynmo tensor fit-advisor`") from None
    except (ValueError, KeyError, TypeError, AssertionError):
        raise AdviseError(f"{p}: not an advisor model of this version (refit it with `dynmo tensor fit-advisor`)") from None
    return doc


def predict(model: dict, x: np.ndarray) -> list[dict]:
    """Every candidate's predicted all-mode seconds: the predicted time of the tensor's best candidate
    times the candidate's predicted ratio to it. Only the ratios decide the pick."""
    mean = np.array(model["mean"])
    x = np.where(np.isnan(x), mean, x)  # a feature the inputs lack counts as the training mean: no say
    x = np.clip(x, model["low"], model["high"])  # outside the training range: at its edge, not extrapolated
    z = np.concatenate(([1.0], (x - mean) / np.array(model["scale"])))
    best = float(z @ np.array(model["time_coef"]))
    out = []
    for c in model["candidates"]:
        r = float(z @ np.array(c["coef"]))
        out.append({"format": c["format"], "reorder": c["reorder"], "predicted_ratio": math.exp(r),
                    "predicted_seconds": math.exp(best + r)})
    return out


def advise(inp: dict, model: dict) -> dict:
    """{"pick": {"format", "reorder"}, "candidates": [...], "reason": one line}."""
    cands = sorted(predict(model, vector(inp, model["rank"])), key=lambda c: c["predicted_ratio"])
    best, nxt = cands[0], cands[1] if len(cands) > 1 else cands[0]
    cv = max(m["cv_onlynz"] for m in inp["modes"])
    per = inp["nnz"] / max(1, min(m["nz_cnt"] for m in inp["modes"]))
    reason = (f"{best['format']}+{best['reorder']} predicted {best['predicted_seconds'] * 1e3:.3g} ms for all modes, "
              f"{nxt['predicted_ratio'] / best['predicted_ratio']:.2f}x less than the next "
              f"({nxt['format']}+{nxt['reorder']}), for {inp['nnz']} nonzeros, order {inp['order']}, "
              f"cv of nonzeros per slice up to {cv:.2f}, a mode's mean nonzeros per nonempty slice up to {per:.0f}")
    return {"pick": {"format": best["format"], "reorder": best["reorder"]}, "candidates": cands, "reason": reason}
