"""A dataset of generated sparse tensors over a grid of features, with an index of what was asked
and what came out.

    dynmo tensor dataset --grid GRID.toml --out DIR [--like REAL.tns ...]

GRID.toml (configs/tensor-grid.toml is an example):

    seed = 1                     # tensor k gets seed + k
    values = "uniform"
    [grid]                       # every combination of these lists is one tensor
    sizes = [[100, 100, 100], [40, 50, 60, 70]]
    density = [1e-4, 1e-3]
    slice_density = [1.0]
    fiber_density = [0.01, 0.05]
    cv_fibers_per_slice = [0.5]
    cv_nnz_per_fiber = [0.5, 1.0]
    [like]                       # with --like: a sibling of each real tensor at each scale
    scale = [1.0]

Every grid point is planned (`generate.plan`) before anything is written, so a point the sizes
cannot hold ends the command in one line naming it. Tensor k goes to `DIR/tNNNNN.tns` (written
under a temporary name and renamed when whole; a killed run's temporary files are removed by
the next), then its features are measured on the written
file and its row appended to `DIR/index.csv` (rewritten whole and renamed, so a row is never half
there): `file` (relative to DIR), `seed`, `requested_<name>` for each target, and
`measured_<name>` for each feature, named as in `dynmo tensor features --json` (`measured_nnz`,
`measured_density`, ..., and `measured_<kind>_<modes>_<stat>` for every distribution's
statistics, full precision). `index.parquet` is the same table (DuckDB), written at the end.

Resumable: DIR keeps a copy of the grid (`grid.toml`); a run on a DIR that holds the same grid
skips the tensors its index lists and makes the rest (a tensor written but not yet listed is
made again, the same, from its seed); a DIR with another grid is refused.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
import tomllib
from pathlib import Path
from typing import Callable

from dynmo.tensor.features import features
from dynmo.tensor.generate import VALUES, GenerateError, Request, generate, plan
from dynmo.tensor.tns import read_tns, write_tns

TARGETS = ("density", "slice_density", "fiber_density", "cv_fibers_per_slice", "cv_nnz_per_fiber")
GRID_KEYS = ("sizes", *TARGETS)


class DatasetError(ValueError):
    """A grid or folder the dataset cannot be made from; one line that says why."""


def load_grid(text: str, where: str) -> dict:
    """The grid's settings, checked: {"seed", "values", "grid": {key: [values]}, "like": {"scale": [...]}}."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise DatasetError(f"{where}: not TOML ({e})") from None
    unknown = set(doc) - {"seed", "values", "grid", "like"}
    if unknown:
        raise DatasetError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; use seed, values, [grid], [like]")
    grid = doc.get("grid", {})
    bad = set(grid) - set(GRID_KEYS)
    if bad:
        raise DatasetError(f"{where}: unknown [grid] key(s) {', '.join(sorted(bad))}; use {', '.join(GRID_KEYS)}")
    for key, value in grid.items():
        if not isinstance(value, list) or not value:
            raise DatasetError(f"{where}: [grid] {key} must be a non-empty list")
    for sizes in grid.get("sizes", []):
        if not (isinstance(sizes, list) and len(sizes) >= 3 and all(isinstance(s, int) and s >= 1 for s in sizes)):
            raise DatasetError(f"{where}: [grid] sizes {sizes!r}: each entry is a list of 3 or more sizes >= 1")
    if grid and "sizes" not in grid or grid and "density" not in grid:
        raise DatasetError(f"{where}: [grid] needs sizes and density")
    values = doc.get("values", "uniform")
    if values not in VALUES:
        raise DatasetError(f"{where}: values {values!r}: choose one of {', '.join(VALUES)}")
    seed = doc.get("seed", 1)
    if not isinstance(seed, int) or seed < 0:
        raise DatasetError(f"{where}: seed {seed!r}: give a whole number >= 0")
    scales = doc.get("like", {}).get("scale", [1.0])
    if not isinstance(scales, list) or not scales or not all(isinstance(s, (int, float)) and s > 0 for s in scales):
        raise DatasetError(f"{where}: [like] scale must be a list of numbers > 0")
    return {"seed": seed, "values": values, "grid": grid, "like": {"scale": [float(s) for s in scales]}}


def jobs(g: dict, likes: list[str]) -> list[dict]:
    """Every tensor of the dataset in order: {"seed", "request" | ("like", "scale")}; each grid
    point planned (DatasetError naming the point where the sizes cannot hold it)."""
    out = []
    grid = g["grid"]
    if grid:
        keys = [k for k in GRID_KEYS if k in grid]
        for point in itertools.product(*(grid[k] for k in keys)):
            asked = dict(zip(keys, point))
            seed = g["seed"] + len(out)
            req = Request(tuple(asked.pop("sizes")), seed=seed, values=g["values"], **asked)
            try:
                plan(req)
            except GenerateError as e:
                raise DatasetError(f"grid point {len(out)} (sizes {'x'.join(map(str, req.sizes))}, "
                                   f"{', '.join(f'{k} {getattr(req, k)}' for k in TARGETS)}): {e}") from None
            out.append({"seed": seed, "request": req})
    for path in likes:
        for scale in g["like"]["scale"]:
            out.append({"seed": g["seed"] + len(out), "like": path, "scale": scale})
    if not out:
        raise DatasetError("the grid has no [grid] points and no --like tensors: nothing to make")
    return out


def measured(doc: dict) -> dict[str, object]:
    """`measured_<name>` of a `features --json` document: the general features and every
    distribution's statistics (full precision)."""
    out: dict[str, object] = {}
    for key, value in doc.items():
        if key == "name" or isinstance(value, list) and value and isinstance(value[0], dict):
            continue
        out[f"measured_{key}"] = "x".join(map(str, value)) if key == "sizes" else value
    for kind in ("nnz_per_slice", "nnz_per_fiber", "fibers_per_slice"):
        for entry in doc[kind]:
            modes = "-".join(map(str, entry["free_modes"]))
            for stat, value in entry.items():
                if stat not in ("free_modes", "fiber_mode"):
                    out[f"measured_{kind}_{modes}_{stat}"] = value
    return out


def _requested(job: dict) -> dict[str, object]:
    if "request" in job:
        r = job["request"]
        return {"requested_sizes": "x".join(map(str, r.sizes)), **{f"requested_{k}": getattr(r, k) for k in TARGETS}}
    return {"requested_like": job["like"], "requested_scale": job["scale"]}


def _tensor(job: dict, values: str):
    if "request" in job:
        return generate(job["request"])
    from dynmo.tensor.sibling import load_spread, sibling

    return sibling(load_spread(job["like"]), job["scale"], job["seed"], values)[0]


def _write_index(folder: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    tmp = folder / ".index.csv.part"
    tmp.write_text(buf.getvalue())
    os.replace(tmp, folder / "index.csv")


def read_index(folder: Path) -> list[dict]:
    path = folder / "index.csv"
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def make(grid_text: str, grid_name: str, folder: Path, likes: list[str],
         say: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Make (or finish) the dataset in `folder`; (tensors made now, tensors in all)."""
    from dynmo.tensor import duck

    say = say or (lambda msg: None)
    duckdb = duck.require()
    todo = jobs(load_grid(grid_text, grid_name), likes)
    folder.mkdir(parents=True, exist_ok=True)
    saved = folder / "grid.toml"
    stamp = grid_text + "".join(f"\n# --like {p}" for p in likes)
    if saved.exists() and saved.read_text() != stamp:
        raise DatasetError(f"{folder} holds the dataset of another grid (its grid.toml differs); "
                           "give another --out, or pass --overwrite to start it again")
    saved.write_text(stamp)
    for stale in [*folder.glob("t[0-9]*.tns.tmp*"), *folder.glob(".index.*.part")]:
        stale.unlink()  # what a killed run was writing
    rows = read_index(folder)
    done = {row["file"] for row in rows}
    g = load_grid(grid_text, grid_name)
    made = 0
    for k, job in enumerate(todo):
        name = f"t{k:05d}.tns"
        if name in done:
            continue
        t = _tensor(job, g["values"])
        write_tns(t, folder / name)  # under a temporary name, renamed when whole
        doc = features(read_tns(folder / name, values=False)).to_dict()
        rows.append({"file": name, "seed": job["seed"], **_requested(job), **measured(doc)})
        _write_index(folder, rows)
        made += 1
        say(f"dataset: {name} ({len(rows)} of {len(todo)}), nnz {t.nnz}")
    part = folder / ".index.parquet.part"
    with duckdb.connect() as con:
        con.execute(f"COPY (SELECT * FROM read_csv('{folder / 'index.csv'}', header=true)) TO '{part}' "
                    "(FORMAT parquet)")
    os.replace(part, folder / "index.parquet")
    return made, len(todo)
