"""dynmo's compiled MTTKRP against SPLATT and pyttb, side by side in one run.

Produces the table in docs/bench/tensor-mttkrp.md (linked from docs/tensors.md).

    python benchmarks/bench_mttkrp.py --splatt PATH/TO/splatt [--work DIR] [--rank 16] [--threads 2]
                                      [--repeats 5] [--pyttb-max-nnz 4e6] [--only NAME,...] [--json OUT]
                                      [--reorders none,lexi,degree] [--splatt-reorders lexi]

The tensors are made by `dynmo tensor generate` (GenTensor-style targets, and `--like` siblings of
the word n-gram tensors of the plays from `dynmo tensor ngram`), written once into --work and
reused. Every tool reads the same .tns file: when `splatt check` finds empty slices or duplicates
it writes the fixed tensor (its CPD refuses them) and that file is used by all three.

Per tensor and mode, float64, at --rank and --threads, the median of --repeats rounds; the
contenders take turns within each round, so a change of the machine's load strikes them alike:
- dynmo: every format of `dynmo.tensor.kernels` (conversion timed apart, one untimed run first),
  on the tensor relabelled by every ordering of --reorders (`dynmo.tensor.reorder`; default
  `none`, the tensor as read; the relabelling timed apart like conversion, the relabelled tensor
  and its permutations written once into --work; the factors relabelled with it, so every
  ordering computes the same MTTKRP); dynmo's best is the minimum over formats x orderings;
- SPLATT (a subprocess; skipped with a note when --splatt is absent), two iterations a run, the
  second counted: `splatt bench -a csf -a coord [-a splatt]` (pure MTTKRP per mode; `csf` is one
  tiled tree, `splatt` its 3-mode algorithm) and `splatt cpd --csf=one|two|all`, whose per-mode
  figure also holds the normal-equations update of that mode (an upper bound) and whose all-mode
  figure is its MTTKRP timer over the two iterations (a mean); SPLATT's best is the minimum over
  all of these, per mode and for all modes;
- pyttb: `sptensor.mttkrp`, every mode up to --pyttb-max-nnz nonzeros, mode 0 only above.
SPLATT and pyttb read the tensor as made: an ordering is a preprocessing step of dynmo's
(`dynmo tensor advise`, `cp --reorder`). With --splatt-reorders ORD,... SPLATT also runs, in the
same rounds, on the ORD-relabelled file; those figures are shown apart and are not SPLATT's best.

Then the ratio of dynmo's fastest format to SPLATT's best per mode and for all modes, their
geometric means over the tensors, and dynmo's speedup over pyttb. The load average is printed
before every tensor: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dynmo.tensor.cli import main as tensor_main
from dynmo.tensor.kernels import FORMATS, convert, mttkrp, set_threads
from dynmo.tensor.kernels.common import stacked
from dynmo.tensor.reorder import METHODS, reorder, write_perms
from dynmo.tensor.tns import read_tns, write_tns

ORDERINGS = ("none", *METHODS)

# name -> the `dynmo tensor generate` arguments that make it (plays siblings need the plays first)
TENSORS = {
    "gen3-flat": ["--sizes", "1000,1000,1000", "--density", "3e-3", "--seed", "11"],
    "gen3-skew": ["--sizes", "2000,3000,5000", "--density", "2e-4", "--fiber-density", "0.002",
                  "--cv-fibers-per-slice", "2", "--cv-nnz-per-fiber", "2", "--seed", "12"],
    "gen4": ["--sizes", "200,300,400,500", "--density", "2.5e-4", "--seed", "13"],
    "gen5": ["--sizes", "60,80,100,120,140", "--density", "1.5e-4", "--seed", "14"],
    "plays3-x2": ["--like", "{plays3}", "--scale", "2", "--seed", "15"],
    "plays4-x2": ["--like", "{plays4}", "--scale", "2", "--seed", "16"],
    "plays5-x2": ["--like", "{plays5}", "--scale", "2", "--seed", "17"],
}


def make(name: str, work: Path) -> Path:
    out = work / f"{name}.tns"
    if out.exists():
        return out
    args = TENSORS[name]
    for k in (3, 4, 5):
        if f"{{plays{k}}}" in args:
            plays = work / f"plays{k}.tns"
            if not plays.exists():
                _run_cli(["ngram", "--order", str(k), "--out", str(plays)])
            args = [a.replace(f"{{plays{k}}}", str(plays)) for a in args]
    _run_cli(["generate", *args, "--out", str(out)])
    return out


def _run_cli(argv: list[str]) -> None:
    print("$ dynmo tensor " + " ".join(argv), flush=True)
    if tensor_main(argv) != 0:
        raise SystemExit(f"dynmo tensor {argv[0]} failed")


def splatt_fixed(splatt: str, path: Path, work: Path) -> Path:
    """The tensor SPLATT's CPD accepts: `splatt check --fix` output when it finds a fault, else `path`."""
    fixed = work / f"{path.stem}.fixed.tns"
    if fixed.exists():
        return fixed
    probe = subprocess.run([splatt, "check", str(path)], capture_output=True, text=True)
    if re.search(r"(EMPTY SLICES|DUPLICATE)", probe.stdout, re.I):
        subprocess.run([splatt, "check", str(path), f"--fix={fixed}"], capture_output=True, text=True, check=True)
        return fixed
    return path


def _splatt_bench(splatt: str, path: Path, order: int, a) -> dict[str, list[float]]:
    """{"bench-ALG": [seconds per mode]} of one `splatt bench` run, from its second iteration."""
    algs = ["csf", "coord"] + (["splatt"] if order == 3 else [])
    cmd = [splatt, "bench", str(path), *sum((["-a", x] for x in algs), []), "-i", "2", "-r", str(a.rank),
           "-t", str(a.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    found, cur = {}, None
    for line in p.stdout.splitlines():
        head = re.match(r"\*\* (\w+) \*\*", line.strip())
        if head:
            cur = "bench-" + head.group(1).lower()
            found[cur] = [[] for _ in range(order)]
        m = re.match(r"\s+mode (\d+) ([\d.]+)s", line)
        if m and cur:
            found[cur][int(m.group(1)) - 1].append(float(m.group(2)))
    return {k: [v[-1] for v in modes] for k, modes in found.items() if all(modes)}


def _splatt_cpd(splatt: str, path: Path, order: int, csf: str, a) -> tuple[list[float], float] | None:
    """([seconds per mode of the second iteration, the update included], MTTKRP seconds per iteration)."""
    cmd = [splatt, "cpd", str(path), "-r", str(a.rank), "-i", "2", "--tol=0", "-t", str(a.threads),
           f"--csf={csf}", "--nowrite", "-v"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    modes = [[] for _ in range(order)]
    for m in re.finditer(r"mode = (\d+) \(([\d.]+)s\)", p.stdout):
        modes[int(m.group(1)) - 1].append(float(m.group(2)))
    total = re.search(r"MTTKRP\s+([\d.]+)s", p.stdout)
    if not all(modes) or not total:
        return None
    return [v[-1] for v in modes], float(total.group(1)) / len(modes[0])


def splatt_round(splatt: str, path: Path, order: int, a) -> dict[str, dict]:
    """{variant: {"modes": [s per mode], "all": s}} of one run of every SPLATT variant that runs."""
    out = {k: {"modes": v, "all": sum(v)} for k, v in _splatt_bench(splatt, path, order, a).items()}
    for csf in ("one", "two", "all"):
        r = _splatt_cpd(splatt, path, order, csf, a)
        if r:
            out[f"cpd-csf={csf}"] = {"modes": r[0], "all": r[1]}
    return out


def _pyttb_tensor(t):
    try:
        import pyttb
    except ImportError:
        return None
    return pyttb.sptensor(t.coords.T.astype(np.int64), t.values.reshape(-1, 1).astype(np.float64), t.sizes, copy=False)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _medians(runs: list[dict]) -> dict:
    """Per variant present in every run: the median per mode and of the all-mode figure."""
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {k: {"modes": [statistics.median(r[k]["modes"][m] for r in runs) for m in range(len(runs[0][k]["modes"]))],
                "all": statistics.median(r[k]["all"] for r in runs)} for k in keys}


def variant(fmt: str, ordering: str) -> str:
    """dynmo's key for a format on a relabelled tensor: `csf` for the tensor as read, `csf+lexi` after lexi."""
    return fmt if ordering == "none" else f"{fmt}+{ordering}"


def relabelled(t, path: Path, ordering: str, work: Path):
    """(the tensor relabelled by `ordering`, perms, seconds of the relabelling, its file in `work`); the file
    and its permutations are written once and reused, the relabelling itself is always run (and timed)."""
    t0 = time.perf_counter()
    new, perms = reorder(t, ordering)
    secs = time.perf_counter() - t0
    out = work / f"{path.stem}.{ordering}.tns"
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        write_tns(new, tmp)
        write_perms(perms, out)
        tmp.replace(out)
    return new, perms, secs, out


def one_tensor(name: str, path: Path, a) -> dict:
    """Every contender on one tensor, interleaved: each of --repeats rounds times every dynmo format on
    every ordering once per mode, runs every SPLATT variant once and pyttb once per mode; the figures
    are the medians."""
    t = read_tns(path)
    load = os.getloadavg()[0]
    print(f"\n{name}: order {t.order}, sizes {'x'.join(map(str, t.sizes))}, nnz {t.nnz}; load {load:.1f}", flush=True)
    row = {"name": name, "order": t.order, "sizes": list(t.sizes), "nnz": t.nnz, "load": load}
    set_threads(a.threads)
    rng = np.random.default_rng(0)
    factors = [rng.random((s, a.rank)) for s in t.sizes]
    outs = [np.empty((s, a.rank)) for s in t.sizes]
    runs, info, files = {}, {}, {}  # runs[key] = (layout, factors, stack)
    for ordering in a.reorders:
        if ordering == "none":
            tt, fac, rsecs = t, factors, 0.0
        else:
            tt, perms, rsecs, files[ordering] = relabelled(t, path, ordering, Path(a.work))
            fac = [f[p] for f, p in zip(factors, perms)]  # the same MTTKRP, relabelled
            print(f"  reorder {ordering}: {rsecs:.2f} s", flush=True)
        for fmt in FORMATS:
            key = variant(fmt, ordering)
            t0 = time.perf_counter()
            lay = convert(tt, fmt, "float64")
            info[key] = {"format": fmt, "reorder": ordering, "reorder_seconds": rsecs,
                         "convert": time.perf_counter() - t0, "bytes_per_nnz": lay.nbytes / t.nnz}
            runs[key] = (lay, fac, stacked(fac, lay.dtype))
            for m in range(t.order):  # compiles (or loads the cache) and warms the caches, untimed
                mttkrp(lay, fac, m, outs[m], runs[key][2])
    px = _pyttb_tensor(t)
    pmodes = list(range(t.order)) if t.nnz <= a.pyttb_max_nnz else [0]
    sre = [o for o in a.splatt_reorders if o in files] if a.splatt else []
    dyn, spl, py, spl_re = [], [], [], {o: [] for o in sre}
    for _ in range(a.repeats):
        one = {}
        for key, (lay, fac, stk) in runs.items():
            secs = [_timed(lambda: mttkrp(lay, fac, m, outs[m], stk)) for m in range(t.order)]
            one[key] = {"modes": secs, "all": sum(secs)}
        dyn.append(one)
        if a.splatt:
            spl.append(splatt_round(a.splatt, path, t.order, a))
            for o in sre:
                spl_re[o].append(splatt_round(a.splatt, files[o], t.order, a))
        if px is not None:
            py.append({m: _timed(lambda: px.mttkrp(factors, m)) for m in pmodes})
    row["dynmo"] = _medians(dyn)
    for key in runs:
        row["dynmo"][key].update(info[key])
    for key, v in row["dynmo"].items():
        print(f"  dynmo {key:<13} " + " ".join(f"{s * 1e3:8.1f}" for s in v["modes"]) +
              f"  all {v['all'] * 1e3:8.1f} ms  (convert {v['convert']:.1f} s)", flush=True)
    if spl:
        row["splatt"] = _medians(spl)
        for k, v in row["splatt"].items():
            print(f"  splatt {k:<13} " + " ".join(f"{s * 1e3:8.1f}" for s in v["modes"]) +
                  f"  all {v['all'] * 1e3:8.1f} ms", flush=True)
    for o, rs in spl_re.items():
        row.setdefault("splatt_reordered", {})[o] = _medians(rs)
        for k, v in row["splatt_reordered"][o].items():
            print(f"  splatt {o}:{k:<13} " + " ".join(f"{s * 1e3:8.1f}" for s in v["modes"]) +
                  f"  all {v['all'] * 1e3:8.1f} ms", flush=True)
    if py:
        row["pyttb"] = {"modes": {m: statistics.median(r[m] for r in py) for m in pmodes}}
        print("  pyttb  " + " ".join(f"m{m} {s * 1e3:.0f}" for m, s in row["pyttb"]["modes"].items()) + " ms", flush=True)
    row["load_after"] = os.getloadavg()[0]
    return row


def summarize(rows: list[dict]) -> dict:
    """Per tensor: dynmo's fastest per mode and all modes, SPLATT's best, pyttb; ratios and geomeans."""
    per_mode_ratios, all_ratios, pyttb_speedups, zero = [], [], [], []
    for r in rows:
        d = r["dynmo"]
        r["dynmo_best_modes"] = [min((d[f]["modes"][m], f) for f in d) for m in range(r["order"])]
        r["dynmo_best_all"] = min((d[f]["all"], f) for f in d)
        if r.get("splatt"):
            s = r["splatt"]
            r["splatt_best_modes"] = [min((s[k]["modes"][m], k) for k in s) for m in range(r["order"])]
            r["splatt_best_all"] = min((s[k]["all"], k) for k in s)
            # SPLATT prints its times rounded; a fast mode can read 0 s. No ratio is known then: it is
            # named (None here, "SPLATT 0 s" in the table) and left out of the geomeans, not divided by.
            r["ratio_modes"] = [dm[0] / sm[0] if sm[0] > 0 else None
                                for dm, sm in zip(r["dynmo_best_modes"], r["splatt_best_modes"])]
            r["ratio_all"] = r["dynmo_best_all"][0] / r["splatt_best_all"][0] if r["splatt_best_all"][0] > 0 else None
            per_mode_ratios += [x for x in r["ratio_modes"] if x is not None]
            all_ratios += [r["ratio_all"]] if r["ratio_all"] is not None else []
            zero += [f"{r['name']} mode {m}" for m, x in enumerate(r["ratio_modes"]) if x is None]
            zero += [f"{r['name']} all modes"] if r["ratio_all"] is None else []
        for o, s in r.get("splatt_reordered", {}).items():
            r.setdefault("splatt_reordered_best", {})[o] = {
                "modes": [min((s[k]["modes"][m], k) for k in s) for m in range(r["order"])],
                "all": min((s[k]["all"], k) for k in s)}
        if r.get("pyttb"):
            r["pyttb_speedup"] = [secs / r["dynmo_best_modes"][m][0] for m, secs in r["pyttb"]["modes"].items()]
            pyttb_speedups += r["pyttb_speedup"]
    g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None  # noqa: E731
    return {"tensors": rows, "geomean_ratio_modes": g(per_mode_ratios), "worst_ratio_mode": max(per_mode_ratios, default=None),
            "geomean_ratio_all": g(all_ratios), "worst_ratio_all": max(all_ratios, default=None),
            "geomean_pyttb_speedup": g(pyttb_speedups), "least_pyttb_speedup": min(pyttb_speedups, default=None),
            "splatt_zero": zero}


def orderings_of(summary: dict) -> list[str]:
    """The orderings dynmo ran, in the order first met."""
    seen = []
    for r in summary["tensors"]:
        for v in r["dynmo"].values():
            o = v.get("reorder", "none")
            if o not in seen:
                seen.append(o)
    return seen or ["none"]


def table(summary: dict) -> str:
    """One row per tensor and mode. With the tensor as read only: a column per format; with orderings: a
    column per ordering (its fastest format named), then dynmo's best over formats x orderings."""
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    ords = orderings_of(summary)
    plain = ords == ["none"]
    sre = sorted({o for r in summary["tensors"] for o in r.get("splatt_reordered_best", {})})
    fmts = [f for f in FORMATS if all(f in r["dynmo"] for r in summary["tensors"])]
    if plain:
        head = [f"dynmo {f}" for f in fmts]
    else:
        head = [f"dynmo {o} (format)" for o in ords] + ["dynmo best (format+ordering)"]
    head += ["SPLATT best (variant)", "dynmo best / SPLATT"] + [f"SPLATT on {o} file (variant)" for o in sre]
    lines = ["| tensor | nnz | mode | " + " | ".join(head) + " | pyttb | pyttb / dynmo best |",
             "| --- | ---: | --- | " + " | ".join("---:" for _ in head) + " | ---: | ---: |"]
    for r in summary["tensors"]:
        d = r["dynmo"]
        for m in [*range(r["order"]), "all"]:
            sec = lambda k: d[k]["modes"][m] if m != "all" else d[k]["all"]  # noqa: E731
            if plain:
                cells = [ms(sec(f)) for f in fmts]
            else:
                cells = []
                for o in ords:
                    ks = [k for k in d if d[k].get("reorder", "none") == o]
                    best = min(ks, key=sec)
                    cells.append(f"{ms(sec(best))} ({d[best].get('format', best)})")
                b = r["dynmo_best_modes"][m] if m != "all" else r["dynmo_best_all"]
                cells.append(f"{ms(b[0])} ({b[1] if '+' in b[1] else b[1] + '+none'})")
            if "splatt_best_all" in r:
                sb = r["splatt_best_modes"][m] if m != "all" else r["splatt_best_all"]
                ratio = r["ratio_modes"][m] if m != "all" else r["ratio_all"]
                sp = [f"{ms(sb[0])} ({sb[1]})", f"{ratio:.2f}" if ratio is not None else "SPLATT 0 s"]
            else:
                sp = ["not run", ""]
            for o in sre:
                sb = r.get("splatt_reordered_best", {}).get(o)
                sb = (sb["modes"][m] if m != "all" else sb["all"]) if sb else None
                sp.append(f"{ms(sb[0])} ({sb[1]})" if sb else "")
            py = r.get("pyttb", {}).get("modes", {})
            pyc = [ms(py[m]), f"{py[m] / r['dynmo_best_modes'][m][0]:.0f}x"] if m in py else ["", ""]
            lines.append(f"| {r['name']} | {r['nnz']} | {m} | " + " | ".join(cells) + " | " + " | ".join(sp + pyc) + " |")
    fmt = lambda x, p="{:.2f}": p.format(x) if x is not None else "n/a"  # noqa: E731
    lines += ["", f"dynmo's fastest {'format' if plain else 'format x ordering'} / SPLATT's best: per mode geomean {fmt(summary['geomean_ratio_modes'])}, "
              f"worst {fmt(summary['worst_ratio_mode'])}; all modes geomean {fmt(summary['geomean_ratio_all'])}, "
              f"worst {fmt(summary['worst_ratio_all'])}. pyttb / dynmo's fastest, per mode: geomean "
              f"{fmt(summary['geomean_pyttb_speedup'], '{:.0f}x')}, least {fmt(summary['least_pyttb_speedup'], '{:.0f}x')}."]
    if summary.get("splatt_zero"):
        lines.append(f"SPLATT reported 0 s (under its printed resolution; no ratio, left out of the geomeans) for "
                     f"{len(summary['splatt_zero'])}: {', '.join(summary['splatt_zero'])}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--splatt", help="the splatt executable (built from its public source); left out: no SPLATT")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "dynmo-bench-mttkrp"),
                    help="folder for the generated tensors (reused when present)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pyttb-max-nnz", type=float, default=4e6, help="above this, pyttb runs mode 0 only")
    ap.add_argument("--only", help="comma-separated tensor names (default: all of " + ", ".join(TENSORS) + ")")
    ap.add_argument("--json", help="write every figure as JSON")
    ap.add_argument("--reorders", default="none",
                    help="comma-separated orderings dynmo's formats run on, among " + ", ".join(ORDERINGS) +
                    " (default none: the tensor as read); dynmo's best is the minimum over formats x orderings")
    ap.add_argument("--splatt-reorders", default="",
                    help="comma-separated orderings among --reorders whose relabelled file SPLATT also runs on "
                    "(shown apart, not SPLATT's best)")
    a = ap.parse_args(argv)
    a.reorders = [o for o in a.reorders.split(",") if o]
    a.splatt_reorders = [o for o in a.splatt_reorders.split(",") if o]
    bad = [o for o in a.reorders if o not in ORDERINGS] or not a.reorders
    if bad or len(set(a.reorders)) != len(a.reorders):
        print(f"--reorders {','.join(a.reorders)}: give distinct names among {', '.join(ORDERINGS)}", file=sys.stderr)
        return 2
    bad = [o for o in a.splatt_reorders if o not in a.reorders or o == "none"]
    if bad:
        print(f"--splatt-reorders {','.join(bad)}: give orderings among --reorders other than none", file=sys.stderr)
        return 2
    names = a.only.split(",") if a.only else list(TENSORS)
    bad = [n for n in names if n not in TENSORS]
    if bad:
        print(f"--only {','.join(bad)}: give names among {', '.join(TENSORS)}", file=sys.stderr)
        return 2
    if a.splatt and not os.access(a.splatt, os.X_OK):
        print(f"note: --splatt {a.splatt} is not an executable; SPLATT skipped", file=sys.stderr)
        a.splatt = None
    if not a.splatt:
        print("note: no SPLATT given (--splatt PATH); its columns are left out", file=sys.stderr)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        path = make(name, work)
        if a.splatt:
            path = splatt_fixed(a.splatt, path, work)
        rows.append(one_tensor(name, path, a))
    summary = summarize(rows)
    print(f"\nrank {a.rank}, {a.threads} threads, float64, median of {a.repeats}, orderings "
          f"{','.join(a.reorders)}; times in ms\n")
    if a.json:  # before the table, so that every figure is kept
        Path(a.json).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
