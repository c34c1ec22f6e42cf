"""`dynmo tensor generate` against GenTensor: targets met, speed, siblings under CP-ALS.

Produces the tables in docs/bench/tensor-generate.md (linked from docs/tensors.md).

    python benchmarks/bench_tensor_generate.py --gentensor-src DIR [--featensor-src DIR] [--out DIR]
                                               [--parts grid,speed,siblings] [--big 100e6]

DIR is a checkout of GenTensor (GitHub sparcityeu/GenTensor), built here with
`gcc -O2 -fopenmp genten.c -lm`; --featensor-src builds FeaTensor too, and then every tensor is
also read back by FeaTensor (its `map` method) besides `dynmo tensor features` (equal on every
tensor tested; the table says where they would differ).

grid: GenTensor-style requests (3 and 4 modes, densities 5e-5 to 2e-3, cvs 0.3 to 1.2), each made
by both tools with the same seed; the five targets read back; the table gives each tool's
largest relative error over the five and the worst target.
speed: a 12M-nonzero request, whole command against whole command (each writes its .tns), and
--big nonzeros by dynmo alone (peak memory from os.wait4).
siblings: real tensors (the word n-gram tensors of the plays) and their siblings at scale 1 and 2:
each mode's nonzeros per slice (density, cv), CP-ALS rank 10 seconds per iteration and fit.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_tensor_features import build_featensor, featensor_json, timed, with_header  # noqa: E402

from dynmo.tensor import features, read_tns  # noqa: E402
from dynmo.tensor.cp import cp_als  # noqa: E402
from dynmo.tensor.sibling import sibling, spread_of  # noqa: E402

TARGETS = ("density", "slice_density", "fiber_density", "cv_fibers_per_slice", "cv_nnz_per_fiber")
# (sizes, density, fiber density, slice density, cv fibers per slice, cv nnz per fiber)
GRID = [
    ((1000, 1000, 1000), 2e-4, 0.02, 1.0, 0.3, 0.3),
    ((1000, 1000, 1000), 2e-4, 0.02, 1.0, 1.2, 1.2),
    ((2000, 3000, 4000), 5e-5, 0.005, 0.9, 0.6, 0.8),
    ((500, 800, 1200), 2e-3, 0.1, 1.0, 0.5, 1.0),
    ((500, 800, 1200), 1e-3, 0.05, 0.8, 1.0, 0.5),
    ((100, 120, 140, 160), 1e-4, 0.01, 0.5, 0.8, 0.6),
    ((100, 120, 140, 160), 5e-4, 0.05, 1.0, 0.4, 1.1),
    ((60, 80, 100, 300), 2e-3, 0.1, 1.0, 1.2, 0.4),
]


def read_back(path: Path, featensor: Path | None, tmp: Path) -> tuple[dict, dict | None]:
    """The five targets as dynmo's features read them, and as FeaTensor's do (or None)."""
    t = read_tns(path, values=False)
    f = features(t).to_dict()
    m = t.order
    pick = lambda lst, modes: next(e for e in lst if e["free_modes"] == modes)  # noqa: E731
    ours = {"density": f["density"],
            "slice_density": pick(f["nnz_per_slice"], [m - 2, m - 1])["nz_density"],
            "fiber_density": pick(f["nnz_per_fiber"], [m - 1])["nz_density"],
            "cv_fibers_per_slice": pick(f["fibers_per_slice"], [m - 2, m - 1])["cv_onlynz"],
            "cv_nnz_per_fiber": pick(f["nnz_per_fiber"], [m - 1])["cv_onlynz"]}
    if featensor is None:
        return ours, None
    with open(path, "rb") as src:
        has_header = src.readline().strip().isdigit()  # GenTensor writes an order and a sizes line
    hdr = path
    if not has_header:  # FeaTensor takes the first two lines for a header
        hdr = tmp / "hdr.tns"
        with_header(path, hdr, m, t.sizes)
    subprocess.run([str(featensor), "-i", str(hdr), "-o", str(tmp / "fea.json"), "-c", "0", "-m", "map"], check=True,
                   stdout=subprocess.DEVNULL)
    d = featensor_json(tmp / "fea.json")
    ids = lambda e: sorted([e["id1"], e["id2"]])  # noqa: E731
    sl = next(e for e in d["slices"] if ids(e) == [m - 2, m - 1])
    fps = next(e for e in d["fibperslice"] if ids(e) == [m - 2, m - 1])
    fib = next(e for e in d["fibers"] if e["id"] == m - 1)
    theirs = {"density": d["base"]["sparsity"], "slice_density": sl["nz_density"], "fiber_density": fib["nz_density"],
              "cv_fibers_per_slice": fps["cv_onlynz"], "cv_nnz_per_fiber": fib["cv_onlynz"]}
    return ours, theirs


def worst(got: dict, want: dict) -> tuple[float, str]:
    errs = {k: abs(got[k] / want[k] - 1) for k in TARGETS}
    k = max(errs, key=errs.get)
    return errs[k], k


def grid(gentensor: Path, featensor: Path | None, out: Path) -> None:
    print(f"\n{'sizes':<20} {'density':>8} {'fib':>6} {'slc':>4} {'cv f/s':>6} {'cv nz/f':>7} | "
          f"{'GenTensor worst':>15} {'target':<20} | {'dynmo worst':>11} {'target':<20} {'FeaTensor agrees':>16}")
    for sizes, d, f, s, c, v in GRID:
        want = dict(zip(TARGETS, (d, s, f, c, v)))
        gt = out / "gt.tns"
        subprocess.run([str(gentensor), str(len(sizes)), *map(str, sizes), "-d", str(d), "-f", str(f), "-s", str(s),
                        "-c", str(c), "-v", str(v), "-r", "1", "-o", str(gt)], check=True, stdout=subprocess.DEVNULL)
        dy = out / "dy.tns"
        subprocess.run([sys.executable, "-m", "dynmo.cli", "tensor", "generate", "--sizes", ",".join(map(str, sizes)),
                        "--density", str(d), "--fiber-density", str(f), "--slice-density", str(s),
                        "--cv-fibers-per-slice", str(c), "--cv-nnz-per-fiber", str(v), "--seed", "1", "--out", str(dy),
                        "--overwrite"], check=True, stdout=subprocess.DEVNULL)
        g_ours, g_fea = read_back(gt, featensor, out)
        d_ours, d_fea = read_back(dy, featensor, out)
        agree = "-" if g_fea is None else str(all(math.isclose(a[k], b[k], rel_tol=1e-5)
                                                  for a, b in ((g_ours, g_fea), (d_ours, d_fea)) for k in TARGETS))
        ge, gk = worst(g_ours, want)
        de, dk = worst(d_ours, want)
        print(f"{'x'.join(map(str, sizes)):<20} {d:>8.0e} {f:>6} {s:>4} {c:>6} {v:>7} | {ge:>15.1%} {gk:<20} | "
              f"{de:>11.1%} {dk:<20} {agree:>16}", flush=True)


def speed(gentensor: Path, out: Path, big: float) -> None:
    sizes, d, f = (2000, 3000, 4000), 5e-4, 0.01
    print(f"\nwriting {sizes} at density {d} ({round(d * math.prod(sizes)):,} nonzeros), whole commands, median of 3")
    gt = [timed([str(gentensor), "3", *map(str, sizes), "-d", str(d), "-f", str(f), "-c", "0.6", "-v", "0.8",
                 "-r", "1", "-o", str(out / "gt12.tns")]) for _ in range(3)]
    args = ["--sizes", ",".join(map(str, sizes)), "--density", str(d), "--fiber-density", str(f),
            "--cv-fibers-per-slice", "0.6", "--cv-nnz-per-fiber", "0.8", "--overwrite"]
    dy = [timed([sys.executable, "-m", "dynmo.cli", "tensor", "generate", *args, "--out", str(out / "dy12.tns")])
          for _ in range(3)]
    dy1 = [timed([sys.executable, "-m", "dynmo.cli", "tensor", "generate", *args, "--values", "ones",
                  "--out", str(out / "dy12b.tns")]) for _ in range(3)]
    for name, runs in (("GenTensor", gt), ("dynmo (uniform values, 7 digits)", dy), ("dynmo (--values ones)", dy1)):
        print(f"  {name:<34} {statistics.median(w for w, _ in runs):6.2f} s  {max(m for _, m in runs):7.0f} MB")
    if big:
        n = round(big)
        side = round((n / 5e-4) ** (1 / 3))
        path = out / "big.tns"
        w, m = timed([sys.executable, "-m", "dynmo.cli", "tensor", "generate", "--sizes", f"{side},{side},{side}",
                      "--density", str(n / side ** 3), "--fiber-density", "0.05", "--values", "ones",
                      "--out", str(path), "--overwrite"])
        print(f"  dynmo {n:,} nonzeros ({side}^3): {w:.1f} s, {m:.0f} MB peak, {path.stat().st_size / 2**30:.1f} GiB")
        path.unlink()


def siblings(out: Path) -> None:
    from dynmo.data.corpus import corpus_files
    from dynmo.tensor.ngram import ngram_tensor

    texts = [f.read_text(encoding="utf-8", errors="replace") for f in corpus_files([])]
    print(f"\n{'tensor':<22} {'nnz':>9} {'mode density (min..max ratio)':>30} {'mode cv ratio':>14} "
          f"{'CP s/iter':>9} {'ratio':>6} {'fit':>6}")
    for order in (3, 4):
        real = ngram_tensor(texts, order)
        rs = spread_of(real)
        r_cp = cp_als(real, 10, 5)
        r_s = statistics.median(r_cp.seconds[1:])
        print(f"{'plays' + str(order) + ' (real)':<22} {real.nnz:>9} {'':>30} {'':>14} {r_s:>9.3f} {'':>6} "
              f"{r_cp.fit:>6.3f}")
        for scale in (1.0, 2.0):
            t, dropped = sibling(rs, scale, seed=1)
            ss = spread_of(t)
            dens = [g.nonempty / g.size / (w.nonempty / w.size) for g, w in zip(ss.modes, rs.modes)]
            cvs = [g.cv / w.cv for g, w in zip(ss.modes, rs.modes)]
            cp = cp_als(t, 10, 5)
            s = statistics.median(cp.seconds[1:])
            print(f"{f'  sibling x{scale:g}':<22} {t.nnz:>9} {min(dens):>14.4f}..{max(dens):<14.4f} "
                  f"{min(cvs):>6.4f}..{max(cvs):<6.4f} {s:>9.3f} {s / r_s / scale:>6.3f} {cp.fit:>6.3f}"
                  + (f"  ({dropped} repeats dropped)" if dropped else ""), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gentensor-src", type=Path, required=True)
    ap.add_argument("--featensor-src", type=Path)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_tensor_generate"))
    ap.add_argument("--parts", default="grid,speed,siblings")
    ap.add_argument("--big", type=float, default=0.0, help="also generate this many nonzeros with dynmo (e.g. 100e6)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gentensor = args.out / "genten"
    subprocess.run(["gcc", "-O2", "-fopenmp", str(args.gentensor_src / "genten.c"), "-lm", "-o", str(gentensor)],
                   check=True, capture_output=True)
    featensor = build_featensor(args.featensor_src, args.out) if args.featensor_src else None
    parts = args.parts.split(",")
    t0 = time.perf_counter()
    if "grid" in parts:
        grid(gentensor, featensor, args.out)
    if "speed" in parts:
        speed(gentensor, args.out, args.big)
    if "siblings" in parts:
        siblings(args.out)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
