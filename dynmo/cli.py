"""`dynmo VERB ...`: each verb is one module with a `main(argv) -> int`.

Verbs are imported lazily so `dynmo balance` never pays for importing torch.
"""

from __future__ import annotations

import importlib
import sys


VERBS = {
    "train": ("dynmo.launch", "train a pipeline-parallel model (launches torchrun)"),
    "balance": ("dynmo.balance.cli", "decide a layout for a cost problem (JSON in, JSON out)"),
    "simulate": ("dynmo.sim.cli", "simulate pipeline schedules at cluster scale"),
    "export": ("dynmo.export", "write a llama/mixtral checkpoint as a Hugging Face model folder"),
    "bench": ("dynmo.bench", "headline benchmark: real 2-rank runs per case + paper-scale simulation"),
    "data": ("dynmo.data.cli", "prepare a corpus: token shards that training reads (data.prepared)"),
    "tensor": ("dynmo.tensor.cli", "sparse tensors: features of .tns files, tensors made from text"),
}
# Verbs that run PyTorch check its version first. `balance` and `simulate` are pure numpy, and
# `bench` trains through `dynmo train` subprocesses (checked there), so `bench --no-real` needs no torch.
NEEDS_TORCH = frozenset({"train", "export"})


EXAMPLES = """\
examples:
  dynmo train --nproc 2 --config configs/default.toml --steps 50 --out runs/default
  dynmo simulate --trace docs/bench/traces/skewed-static.jsonl --stages 8 --dp 4
  echo '{"costs": [1, 4, 4, 4, 1, 1, 1, 2], "stages": 3}' | dynmo balance --input -"""


def _usage(examples: bool = False) -> str:
    lines = ["usage: dynmo VERB [options]   (dynmo VERB --help for a verb's options)", "", "verbs:"]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in VERBS.items()]
    return "\n".join(lines) + ("\n\n" + EXAMPLES if examples else "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(examples=True))
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"dynmo: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    problem = None
    if verb in NEEDS_TORCH:
        from dynmo import requirements  # reads package metadata: only verbs that need torch pay for it

        problem = requirements.check_torch()
    if problem:  # before importing torch: an old one would fail later, deep inside a worker
        print(f"dynmo: error: {problem}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
