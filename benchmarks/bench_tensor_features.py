"""`dynmo tensor features` against FeaTensor, whole command against whole command, side by side.

Produces the table in docs/bench/tensor-features.md, and with --fixtures the FeaTensor fixtures
tests/data/featensor that tests/test_tensor_features.py reads.

    python benchmarks/bench_tensor_features.py --featensor-src DIR [--out DIR] [--cases a,b] [--repeat 3]
    python benchmarks/bench_tensor_features.py --featensor-src DIR --fixtures tests/data/featensor

DIR is a checkout of FeaTensor's source (GitHub sparcityeu/FeaTensor); it is built here with
gcc into --out (`gcc -O2 -fopenmp --std=c++17 -D_GLIBCXX_PARALLEL ...`). Without gcc or the
source, only dynmo's times are printed.

For each case the tensor is written as a plain FROSTT file (dynmo reads it) and as the same
file with an order line and a sizes line (FeaTensor skips the first two lines of every input),
both are run as separate processes, `--repeat` times each, and the table gives the median wall
time and the peak resident memory of each (GNU time's %M; the column is empty without it),
the speedup, and whether
every statistic agrees to FeaTensor's six printed digits. FeaTensor runs `-m map`, its only
method whose features are all of ours (its sort, group and hybrid methods pair other fibers
with slices, and give the features of the three largest modes only for order > 3).

Cases (CASES): tensors from a skewed sampler (indices drawn from a Pareto law, so a few slices
hold most nonzeros) of 3, 4 and 5 modes from 0.5M to 12M nonzeros, a uniform one, and the word
n-gram tensors of the Shakespeare plays (`dynmo tensor ngram`, real data) of 3 to 5 modes.

--fixtures DIR writes the test fixtures instead: small tensors (.tns.gz, or a recipe for the
n-gram ones) and FeaTensor's output on each, made valid JSON (tests/test_tensor_features.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynmo.tensor import features, from_coo, write_tns  # noqa: E402
from dynmo.tensor.features import GENERAL, STATS  # noqa: E402

# name -> (kind, parameters)
CASES = {
    "skew3-0.5M": ("skew", {"sizes": (2000, 3000, 4000), "nnz": 500_000}),
    "skew4-0.5M": ("skew", {"sizes": (300, 400, 500, 600), "nnz": 500_000}),
    "skew5-0.4M": ("skew", {"sizes": (200, 300, 400, 500, 600), "nnz": 400_000}),
    "uniform3-2M": ("uniform", {"sizes": (2000, 3000, 4000), "nnz": 2_000_000}),
    "skew5-4M": ("skew", {"sizes": (200, 300, 400, 500, 600), "nnz": 4_000_000}),
    "skew3-12M": ("skew", {"sizes": (2000, 3000, 4000), "nnz": 12_000_000}),
    "plays3": ("ngram", {"order": 3}),
    "plays4": ("ngram", {"order": 4}),
    "plays5": ("ngram", {"order": 5}),
}
DEFAULT = ["skew3-0.5M", "skew4-0.5M", "skew5-0.4M", "uniform3-2M", "plays3", "plays4", "plays5", "skew5-4M",
           "skew3-12M"]
FIXTURES = {
    "skew3-20k": ("skew", {"sizes": (300, 400, 500), "nnz": 20_000}),
    "skew4-10k": ("skew", {"sizes": (40, 50, 60, 70), "nnz": 10_000}),
    "skew5-8k": ("skew", {"sizes": (12, 15, 20, 25, 30), "nnz": 8_000}),
    "uniform3-5k": ("uniform", {"sizes": (60, 70, 80), "nnz": 5_000}),
    "plays3-3": ("ngram", {"order": 3, "plays": ["hamlet.md", "macbeth.md", "the-tempest.md"]}),
    "plays4-2": ("ngram", {"order": 4, "plays": ["othello.md", "king-lear.md"]}),
}


def skewed(sizes, nnz, seed=0, shape=1.3):
    """Distinct coordinates whose indices follow a Pareto law per mode, clipped to the size."""
    rng = np.random.default_rng(seed)
    got = np.empty((len(sizes), 0), dtype=np.int64)
    while got.shape[1] < nnz:
        m = int((nnz - got.shape[1]) * 1.3) + 1000
        draw = np.stack([np.minimum((rng.pareto(shape, m) * s / 20).astype(np.int64), s - 1) for s in sizes])
        got = np.unique(np.concatenate([got, draw], axis=1), axis=1)
    keep = rng.permutation(got.shape[1])[:nnz]
    return got[:, keep]


def uniform(sizes, nnz, seed=0):
    rng = np.random.default_rng(seed)
    cells = np.unique(rng.integers(0, int(np.prod(sizes)), size=int(nnz * 1.2)))
    cells = rng.permutation(cells)[:nnz]
    return np.array(np.unravel_index(cells, sizes))


def make(kind: str, p: dict, seed: int = 0):
    if kind == "ngram":
        from dynmo.data.corpus import corpus_files
        from dynmo.tensor.ngram import ngram_tensor

        files = [f for f in corpus_files([]) if not p.get("plays") or f.name in p["plays"]]
        return ngram_tensor([f.read_text(encoding="utf-8", errors="replace") for f in files], p["order"])
    coords = skewed(p["sizes"], p["nnz"], seed) if kind == "skew" else uniform(p["sizes"], p["nnz"], seed)
    rng = np.random.default_rng(seed + 1)
    return from_coo(coords, np.round(rng.random(coords.shape[1]), 3) + 0.001, check_duplicates=False)


def with_header(src: Path, dst: Path, order: int, sizes) -> None:
    with open(dst, "wb") as out:
        out.write(f"{order}\n{' '.join(map(str, sizes))}\n".encode())
        with open(src, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 24)


def build_featensor(src: Path, out: Path) -> Path | None:
    gcc = shutil.which("gcc")
    files = ["main.cpp", "tensor.cpp", "reduction.cpp", "util.cpp"]
    if not gcc or not all((src / f).exists() for f in files):
        return None
    exe = out / "featen"
    subprocess.run([gcc, "-O2", "-fopenmp", "--std=c++17", "-D_GLIBCXX_PARALLEL", *[str(src / f) for f in files],
                    "-lm", "-lstdc++", "-o", str(exe)], check=True, capture_output=True)
    return exe


TIME = shutil.which("time", path="/usr/bin:/bin")  # GNU time: it forks the command from itself


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak resident MB) of one process. The peak is GNU time's (%M): a process
    forked from this one would count this (large) process's pages in its own peak."""
    with tempfile.NamedTemporaryFile(mode="r") as rep:
        pre = [TIME, "-f", "%M", "-o", rep.name] if TIME else []
        t = time.perf_counter()
        p = subprocess.run([*pre, *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - t
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.decode(errors='replace').strip()[-500:]}")
        kb = rep.read().strip().splitlines()
    return wall, float(kb[-1]) / 1024 if kb else float("nan")


def featensor_json(path: Path) -> dict:
    """FeaTensor's JSON output made valid (a missing comma, trailing commas)."""
    text = path.read_text()
    text = re.sub(r'("nnzSliceCnt"\s*:\s*\d+)\s+"', r'\1, "', text)
    text = re.sub(r",\s*([}\]])", r"\1", text)
    return json.loads(text)


def same(ours, printed) -> bool:
    """FeaTensor prints counts whole (%d, %llu) and other numbers to six digits (%g)."""
    return ours == printed if isinstance(ours, int) else float(f"{ours:.6g}") == printed


def mismatches(ours: dict, theirs: dict) -> int:
    """Statistics that differ at FeaTensor's six printed digits."""
    bad = 0
    pairs = (("slices", "nnz_per_slice"), ("fibers", "nnz_per_fiber"), ("fibperslice", "fibers_per_slice"))
    for t_kind, o_kind in pairs:
        for w, g in zip(theirs[t_kind], ours[o_kind], strict=True):
            bad += sum(not same(g[k], w[k]) for k in STATS)
    bad += sum(not same(ours[o], theirs["base"][t]) for t, o in GENERAL.items())
    return bad


def write_fixtures(exe: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "_tmp"
    tmp.mkdir(exist_ok=True)
    for name, (kind, p) in FIXTURES.items():
        t = make(kind, p)
        plain = tmp / f"{name}.tns"
        write_tns(t, plain)
        if kind == "ngram":
            (out / f"{name}.recipe.json").write_text(json.dumps({"order": p["order"], "plays": p["plays"]}) + "\n")
        else:
            with open(plain, "rb") as f, gzip.GzipFile(out / f"{name}.tns.gz", "wb", mtime=0) as g:
                shutil.copyfileobj(f, g)
        hdr = tmp / f"{name}.hdr.tns"
        with_header(plain, hdr, t.order, t.sizes)
        subprocess.run([str(exe), "-i", str(hdr), "-o", str(tmp / "f.json"), "-c", "0", "-m", "map"], check=True,
                       stdout=subprocess.DEVNULL)
        theirs = featensor_json(tmp / "f.json")
        theirs["base"]["name"] = f"{name}.tns"
        (out / f"{name}.featensor.json").write_text(json.dumps(theirs, indent=0) + "\n")
        print(f"{name}: order {t.order}, nnz {t.nnz}, {mismatches(features(t).to_dict(), theirs)} statistics differ")
    shutil.rmtree(tmp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--featensor-src", type=Path, help="FeaTensor's source folder (built with gcc)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_tensor_features"), help="tensors and builds")
    ap.add_argument("--cases", default=",".join(DEFAULT), help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fixtures", type=Path, help="write the test fixtures into this folder instead")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    exe = build_featensor(args.featensor_src, args.out) if args.featensor_src else None
    if args.fixtures:
        if exe is None:
            sys.exit("--fixtures needs FeaTensor: give --featensor-src and have gcc")
        write_fixtures(exe, args.fixtures)
        return 0
    if exe is None:
        print("FeaTensor not built (no --featensor-src, or no gcc): dynmo's times only", file=sys.stderr)
    dynmo = [sys.executable, "-m", "dynmo.cli"] if not shutil.which("dynmo") else [shutil.which("dynmo")]
    rows = []
    print(f"{'case':<12} {'order':>5} {'nnz':>10} {'FeaTensor s':>11} {'MB':>6} {'dynmo s':>8} {'MB':>6} "
          f"{'speedup':>7} {'differ':>6}")
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        kind, p = CASES[name]
        plain = args.out / f"{name}.tns"
        if not plain.exists():
            write_tns(make(kind, p), plain)
        head = np.loadtxt(plain, max_rows=1)
        order = head.size - 1
        ours_json = args.out / f"{name}.dynmo.json"
        ours_cmd = [*dynmo, "tensor", "features", str(plain), "--quiet", "--json", str(ours_json), "--overwrite"]
        ours = [timed(ours_cmd) for _ in range(args.repeat)]
        doc = json.loads(ours_json.read_text())
        row = {"case": name, "order": order, "nnz": doc["nnz"], "dynmo_s": statistics.median(w for w, _ in ours),
               "dynmo_mb": max(m for _, m in ours)}
        if exe is not None:
            hdr = args.out / f"{name}.hdr.tns"
            if not hdr.exists():
                with_header(plain, hdr, order, doc["sizes"])
            fj = args.out / f"{name}.featensor.json"
            theirs = [timed([str(exe), "-i", str(hdr), "-o", str(fj), "-c", "0", "-m", "map"])
                      for _ in range(args.repeat)]
            row |= {"featensor_s": statistics.median(w for w, _ in theirs), "featensor_mb": max(m for _, m in theirs),
                    "differ": mismatches(doc, featensor_json(fj))}
            row["speedup"] = row["featensor_s"] / row["dynmo_s"]
        rows.append(row)
        f = lambda k, spec: format(row[k], spec) if k in row else "-"  # noqa: E731
        print(f"{name:<12} {order:>5} {row['nnz']:>10} {f('featensor_s', '11.2f')} {f('featensor_mb', '6.0f')} "
              f"{row['dynmo_s']:>8.2f} {row['dynmo_mb']:>6.0f} {f('speedup', '7.1f')} {f('differ', '6d')}", flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
