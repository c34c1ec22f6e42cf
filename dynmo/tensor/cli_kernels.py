"""`dynmo tensor mttkrp`, `reorder` and `cp`: the compiled MTTKRP kernels from the command line.

    dynmo tensor mttkrp FILE --rank R --mode M|all --format auto|coo|csf|hicoo [--reorder none|auto|METHOD]
                        [--threads N] [--repeats K] [--dtype float64|float32] [--memory-gb G] [--json OUT]
    dynmo tensor reorder FILE --method lexi|bfs-mcs|degree|random --out OUT [--seed S]
    dynmo tensor cp FILE --rank R [--format auto|F|numpy] [--reorder auto|none|METHOD] [--threads N] ...

The argument definitions (`add_commands`, `add_cp_options`) and the handlers (`HANDLERS`); cli.py
registers them.
"""

from __future__ import annotations

import os
import statistics
import time

from dynmo.jsonio import InputError
from dynmo.tensor import cli_args

EXAMPLES = {
    "mttkrp": ["dynmo tensor mttkrp plays3.tns --rank 16 --mode all --format csf --threads 2 --repeats 5",
               "dynmo tensor mttkrp big.tns --format auto --reorder auto --json mttkrp.json"],
    "reorder": ["dynmo tensor reorder plays3.tns --method lexi --out plays3-lexi.tns"],
}
FORMAT_HELP = "coo, csf (a tree per mode), hicoo (blocked), or auto (the advisor's pick from the features)"


def add_commands(sub, command) -> None:
    """The `mttkrp` and `reorder` parsers; `command(sub, name, help, text, examples)` makes one."""
    from dynmo.tensor.reorder import METHODS

    k = command(sub, "mttkrp", "time the compiled MTTKRP of a .tns file in a format and ordering",
                "Time the matricized tensor times Khatri-Rao product (MTTKRP, the cost of CP-ALS) of a "
                "sparse tensor, per mode, in a storage format and index ordering, with random factors; "
                "the conversion is timed apart.", EXAMPLES["mttkrp"])
    k.add_argument("file", help=cli_args.TNS_HELP)
    k.add_argument("--rank", type=int, default=16, help="R, the factors' columns (default 16)")
    k.add_argument("--mode", default="all", help="the mode (0-based) or all (default)")
    k.add_argument("--format", default="auto", help=f"{FORMAT_HELP} (default auto)")
    k.add_argument("--reorder", default="none", help=f"none (default), auto, or {', '.join(METHODS)}")
    k.add_argument("--threads", type=int, help="threads (default: every core)")
    k.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported (default 5)")
    k.add_argument("--dtype", default="float64", help="float64 (default) or float32")
    k.add_argument("--memory-gb", type=float, metavar="G", help="refuse a format that would take more than G GB")
    k.add_argument("--json", metavar="OUT", help="write the times as JSON")
    cli_args.header(k)
    cli_args.overwrite(k, "--json")
    r = command(sub, "reorder", "relabel a .tns file's indices (lexi, bfs-mcs, degree, random)",
                "Renumber every mode's indices so that nonzeros sharing indices sit together; write the "
                "tensor and, beside it, one file per mode whose line k holds the old index of new index k.",
                EXAMPLES["reorder"])
    r.add_argument("file", help=cli_args.TNS_HELP)
    r.add_argument("--method", required=True, help=", ".join(METHODS))
    r.add_argument("--out", required=True, help="the .tns file to write; OUT's stem.modeM.perm beside it")
    r.add_argument("--seed", type=int, default=0, help="for --method random (default 0)")
    cli_args.header(r)
    r.add_argument("--overwrite", action="store_true", help="replace OUT and its .perm files if they exist")


def add_cp_options(c) -> None:
    c.add_argument("--format", default="auto", help=f"{FORMAT_HELP}, or numpy (no compiled kernel; default auto)")
    c.add_argument("--reorder", default="none", help="none (default), auto, lexi, bfs-mcs, degree or random")
    c.add_argument("--threads", type=int, help="threads of the compiled kernels (default: every core)")


def _check_choices(args, formats: tuple[str, ...]) -> None:
    from dynmo.tensor.reorder import METHODS

    if args.format not in (*formats, "auto"):
        raise InputError(f"--format {args.format}: give {', '.join(formats)} or auto")
    if args.reorder not in ("none", "auto", *METHODS):
        raise InputError(f"--reorder {args.reorder}: give none, auto, {', '.join(METHODS)}")
    if args.threads is not None and args.threads < 1:
        raise InputError(f"--threads {args.threads}: give 1 or more")
    if args.format != "numpy":
        try:
            import numba  # noqa: F401
        except ImportError:
            raise InputError("the compiled kernels need numba: pip install 'dynmo[tensor]' (or --format numpy "
                             "for cp)") from None


def read(file: str, header):
    from dynmo.tensor.coo import TensorError
    from dynmo.tensor.tns import TensorFileError, read_tns

    if not os.path.isfile(file):
        raise InputError(f"{file}: no such file")
    try:
        if file.endswith(".parquet"):
            from dynmo.tensor.parquet import read_parquet

            return read_parquet(file)
        return read_tns(file, header=header)
    except (TensorFileError, TensorError) as e:
        raise InputError(str(e)) from None


def choose(t, fmt: str, reorder: str) -> tuple[str, str, str]:
    """(format, reordering, why) with `auto` replaced by the advisor's pick."""
    if fmt != "auto" and reorder != "auto":
        return fmt, reorder, ""
    from dynmo.tensor.advise import AdviseError, advise, load_model, tensor_inputs

    try:
        a = advise(tensor_inputs(t), load_model())
    except AdviseError as e:
        raise InputError(f"--format/--reorder auto: {e}; or name a format") from None
    best = min((c for c in a["candidates"] if fmt in ("auto", c["format"]) and reorder in ("auto", c["reorder"])),
               key=lambda c: c["predicted_seconds"])
    return best["format"], best["reorder"], f" (the advisor's pick: {a['reason']})"


def prepare(t, fmt: str, reorder: str, dtype: str, memory_gb: float | None):
    """(layout, permutations or None, seconds to reorder and convert), refusing what would not fit."""
    from dynmo.tensor.kernels import convert
    from dynmo.tensor.kernels.memory import bytes_at_most

    need = bytes_at_most(fmt, t.nnz, t.sizes, 4 if dtype == "float32" else 8)
    if memory_gb is not None and need > memory_gb * 2**30:
        raise InputError(f"--format {fmt} may take up to {need / 2**30:.2f} GB for {t.nnz} nonzeros, over --memory-gb "
                         f"{memory_gb:g}; give more, or a smaller format (coo or hicoo)")
    t0 = time.perf_counter()
    perms = None
    if reorder != "none":
        from dynmo.tensor.reorder import reorder as relabel

        t, perms = relabel(t, reorder)
    return convert(t, fmt, dtype), perms, time.perf_counter() - t0


def mttkrp_cmd(args) -> int:
    from dynmo.tensor.kernels import FORMATS, set_threads, time_mttkrp


    _check_choices(args, FORMATS)
    if not 1 <= args.rank <= 1000:
        raise InputError(f"--rank {args.rank}: give 1 to 1000")
    if not 1 <= args.repeats <= 1000:
        raise InputError(f"--repeats {args.repeats}: give 1 to 1000")
    if args.dtype not in ("float64", "float32"):
        raise InputError(f"--dtype {args.dtype}: give float64 or float32")
    if args.memory_gb is not None and not args.memory_gb > 0:
        raise InputError(f"--memory-gb {args.memory_gb}: give a positive number of GB")
    if args.mode != "all" and not args.mode.isdigit():
        raise InputError(f"--mode {args.mode}: give a mode number (0-based) or all")
    cli_args.check_out(args.json, args.overwrite, "--json")
    t = read(args.file, args.header)
    if args.mode != "all" and int(args.mode) >= t.order:
        raise InputError(f"--mode {args.mode}: the tensor has modes 0 to {t.order - 1}")
    modes = list(range(t.order)) if args.mode == "all" else [int(args.mode)]
    fmt, reorder, why = choose(t, args.format, args.reorder)
    lay, _, convert_s = prepare(t, fmt, reorder, args.dtype, args.memory_gb)
    threads = set_threads(args.threads)
    secs = time_mttkrp(lay, args.rank, modes, args.repeats)
    per_nnz = lay.nbytes / t.nnz
    print(f"{args.file}: order {t.order}, sizes {'x'.join(map(str, t.sizes))}, nnz {t.nnz}; format {fmt}, "
          f"reorder {reorder}{why}; rank {args.rank}, {threads} threads, {args.dtype}")
    for m, s in zip(modes, secs):
        print(f"mode {m}: {s * 1e3:.2f} ms (median of {args.repeats})")
    print(f"all: {sum(secs) * 1e3:.2f} ms; conversion {convert_s:.2f} s; {per_nnz:.1f} bytes per nonzero")
    if args.json:
        from dynmo.jsonio import dumps

        doc = {"file": args.file, "format": fmt, "reorder": reorder, "rank": args.rank, "threads": threads,
               "dtype": args.dtype, "repeats": args.repeats, "nnz": t.nnz,
               "modes": [{"mode": m, "seconds": s} for m, s in zip(modes, secs)],
               "convert_seconds": convert_s, "bytes_per_nnz": per_nnz}
        cli_args.write(args.json, dumps(doc, indent=1) + "\n")
    return 0


def reorder_cmd(args) -> int:
    from pathlib import Path

    from dynmo.tensor.reorder import METHODS, perm_paths, reorder, write_perms
    from dynmo.tensor.tns import write_tns

    if args.method not in METHODS:
        raise InputError(f"--method {args.method}: give {', '.join(METHODS)}")
    cli_args.check_out(args.out, args.overwrite, "--out")
    if Path(args.out).resolve() == Path(args.file).resolve():
        raise InputError(f"--out {args.out}: is the input; give another name")
    t = read(args.file, args.header)
    for p in perm_paths(args.out)[:t.order]:
        cli_args.check_out(str(p), args.overwrite, "--out's permutation")
    t0 = time.perf_counter()
    new, perms = reorder(t, args.method, args.seed)
    secs = time.perf_counter() - t0
    write_tns(new, args.out)
    paths = write_perms(perms, args.out)
    print(f"{args.out}: {args.file} reordered by {args.method} in {secs:.2f} s; permutations in "
          f"{', '.join(p.name for p in paths)}")
    return 0


def cp_cmd(args) -> int:
    from dynmo.tensor.cp import cp_als
    from dynmo.tensor.kernels import FORMATS

    _check_choices(args, (*FORMATS, "numpy"))
    if args.format == "numpy" and args.reorder not in ("none",):
        raise InputError("--reorder is for the compiled formats; leave it out with --format numpy")
    if not 1 <= args.rank <= 1000:
        raise InputError(f"--rank {args.rank}: give 1 to 1000")
    if not 1 <= args.iters <= 10_000:
        raise InputError(f"--iters {args.iters}: give 1 to 10000")
    cli_args.check_out(args.json, args.overwrite, "--json")
    t = read(args.file, args.header)
    fmt, reorder, why, lay, perms, prep = "numpy", "none", "", None, None, 0.0
    if args.format != "numpy":
        from dynmo.tensor.kernels import set_threads

        fmt, reorder, why = choose(t, args.format, args.reorder)
        lay, perms, prep = prepare(t, fmt, reorder, "float64", None)
        set_threads(args.threads)
    print(f"{args.file}: order {t.order}, sizes {'x'.join(map(str, t.sizes))}, nnz {t.nnz}; CP-ALS rank {args.rank}; "
          f"format {fmt}, reorder {reorder}{why}" + (f" (prepared in {prep:.2f} s)" if lay is not None else ""))
    target = t
    if perms is not None:
        from dynmo.tensor.reorder import relabel

        target = relabel(t, perms)
    res = cp_als(target, args.rank, args.iters, args.seed, layout=lay,
                 progress=lambda it, fit, s: print(f"iter {it + 1:>4}  fit {fit:.6f}  {s:.3f} s", flush=True))
    med = statistics.median(res.seconds)
    per_mode = [statistics.median(s[m] for s in res.mttkrp_seconds) for m in range(t.order)]
    print(f"fit {res.fit:.6f}; {med:.3f} s per iteration (median of {len(res.seconds)}); MTTKRP per mode: "
          + ", ".join(f"{m}: {s * 1e3:.1f} ms" for m, s in enumerate(per_mode)))
    if args.json:
        from dynmo.jsonio import dumps

        cli_args.write(args.json, dumps({"file": args.file, "order": t.order, "sizes": list(t.sizes), "nnz": t.nnz,
                                 "rank": args.rank, "format": fmt, "reorder": reorder, "fits": res.fits,
                                 "seconds": res.seconds, "seconds_per_iter": med,
                                 "mttkrp_seconds_per_mode": per_mode}, indent=1) + "\n")
    return 0


HANDLERS = {"mttkrp": mttkrp_cmd, "reorder": reorder_cmd, "cp": cp_cmd}
