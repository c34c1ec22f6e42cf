"""`dynmo tensor advise` and `fit-advisor`: argument definitions and handlers (cli.py registers them).

    dynmo tensor advise FILE.tns|FEATURES.json [--model MODEL.json] [--json OUT]
    dynmo tensor fit-advisor DATASET|FILE.tns ... --out MODEL.json [--held-out DATASET|FILE.tns ...]
                             [--rank R] [--threads N] [--repeats K] [--budget S] [--again]
"""

from __future__ import annotations

import sys
import time

from dynmo.jsonio import InputError
from dynmo.tensor import cli_args

EXAMPLES = {
    "advise": ["dynmo tensor advise plays3.tns", "dynmo tensor advise big-features.json --json advice.json"],
    "fit-advisor": ["dynmo tensor dataset --grid benchmarks/tensor-advisor/train3.toml --out runs/advisor-train3",
                    "dynmo tensor fit-advisor runs/advisor-train3 --held-out runs/advisor-test3 --out my-advisor.json"],
}


def add_commands(sub, command) -> None:
    a = command(sub, "advise", "the format and ordering predicted fastest for MTTKRP, from features alone",
                "Predict each candidate format and ordering's all-mode MTTKRP time from the tensor's features "
                "(per-mode slice counts; no kernel is run) and name the fastest, with the reason in one line.",
                EXAMPLES["advise"])
    a.add_argument("file", help="a .tns file, or the JSON of `dynmo tensor features` (order 3; e.g. from "
                                "--memory-gb for a tensor larger than memory)")
    a.add_argument("--model", help="an advisor model of `fit-advisor` (default: the one shipped)")
    a.add_argument("--json", metavar="OUT", help="write the pick and every candidate's predicted seconds")
    cli_args.header(a)
    cli_args.overwrite(a, "--json")
    f = command(sub, "fit-advisor", "fit the advisor's model on tensors timed on this machine",
                "Measure every candidate's all-mode MTTKRP on each tensor of the datasets (labels.csv "
                "beside them; resumed when stopped), fit the advisor's model, and report its accuracy on "
                "the held-out tensors.", EXAMPLES["fit-advisor"])
    f.add_argument("train", nargs="+", help="dataset folders of `dynmo tensor dataset`, or .tns files")
    f.add_argument("--held-out", nargs="*", default=[], help="dataset folders or .tns files to evaluate on")
    f.add_argument("--out", required=True, help="the model JSON to write")
    f.add_argument("--rank", type=int, default=16, help="rank of the timed MTTKRP (default 16)")
    f.add_argument("--threads", type=int, default=2, help="threads of the timed MTTKRP (default 2)")
    f.add_argument("--repeats", type=int, default=5,
                   help="rounds over the candidates at least; each mode's least time counts (default 5)")
    f.add_argument("--budget", type=float, default=6.0,
                   help="more rounds while a tensor's timed runs took less than this many seconds (default 6)")
    f.add_argument("--again", action="store_true",
                   help="time every tensor again, labelled or not; each label is the least of all its runs")
    f.add_argument("--labelled-only", action="store_true",
                   help="measure nothing: fit and evaluate on the tensors whose labels are complete already")
    cli_args.overwrite(f, "--out")


def advise_cmd(args) -> int:
    from dynmo.jsonio import dumps, read_json
    from dynmo.tensor.advise import AdviseError, advise, json_inputs, load_model, tensor_inputs
    from dynmo.tensor.cli_kernels import read

    cli_args.check_out(args.json, args.overwrite, "--json")
    t0 = time.perf_counter()
    try:
        model = load_model(args.model)
        if args.file.endswith(".json"):
            inp = json_inputs(read_json(args.file))
        else:
            t = read(args.file, args.header)
            t0 = time.perf_counter()  # the reading is CP's too; what advise adds starts here
            inp = tensor_inputs(t)
        a = advise(inp, model)
    except AdviseError as e:
        raise InputError(str(e)) from None
    secs = time.perf_counter() - t0
    print(f"{args.file}: pick {a['pick']['format']} with reorder {a['pick']['reorder']}: {a['reason']}")
    for c in a["candidates"]:
        print(f"  {c['format']:<6} {c['reorder']:<8} {c['predicted_seconds'] * 1e3:10.3f} ms predicted, "
              f"{c['predicted_ratio']:.2f}x the best")
    print(f"(features and prediction in {secs * 1e3:.1f} ms)")
    if args.json:
        cli_args.write(args.json, dumps({"pick": a["pick"], "candidates": a["candidates"], "reason": a["reason"]},
                                indent=1) + "\n")
    return 0


def fit_cmd(args) -> int:
    from pathlib import Path

    from dynmo.jsonio import dumps
    from dynmo.tensor.advise_fit import evaluate, fit, label, tensor_files

    cli_args.check_out(args.out, args.overwrite, "--out")
    if not 1 <= args.rank <= 1000 or args.threads < 1 or not 1 <= args.repeats <= 100 or not 0 <= args.budget <= 3600:
        raise InputError("--rank 1 to 1000, --threads 1 or more, --repeats 1 to 100, --budget 0 to 3600 seconds")
    if args.again and args.labelled_only:
        raise InputError("--again times every tensor, --labelled-only none: give one of them")
    try:
        for src in [*args.train, *args.held_out]:
            tensor_files(src)
    except ValueError as e:
        raise InputError(str(e)) from None
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    train = [r for src in args.train for r in label(src, args.rank, args.threads, args.repeats, say,
                                                        not args.labelled_only, args.budget, args.again)]
    if len(train) < 4:
        raise InputError(f"{len(train)} training tensors: give at least 4")
    model = fit(train, args.rank, args.threads)
    report = {"train": evaluate(model, train)}
    if args.held_out:
        held = [r for src in args.held_out for r in label(src, args.rank, args.threads, args.repeats, say,
                                                        not args.labelled_only, args.budget, args.again)]
        report["held_out"] = evaluate(model, held)
    model["accuracy"] = {k: {x: v[x] for x in ("geomean", "worst", "best_fixed", "best_fixed_geomean",
                                              "best_fixed_worst")} for k, v in report.items()}
    cli_args.write(args.out, dumps(model, indent=1) + "\n")
    for k, v in report.items():
        print(f"{k}: {len(v['tensors'])} tensors; pick / best: geomean {v['geomean']:.3f}, worst {v['worst']:.3f}; "
              f"best fixed ({v['best_fixed']}): geomean {v['best_fixed_geomean']:.3f}, worst {v['best_fixed_worst']:.3f}")
        for row in v["tensors"]:
            print(f"  {row['file']:<28} pick {row['pick']:<14} best {row['best']:<14} {row['ratio']:.3f}")
    print(f"{Path(args.out)}: the model ({len(model['candidates'])} candidates, {len(train)} tensors)")
    return 0


HANDLERS = {"advise": advise_cmd, "fit-advisor": fit_cmd}
