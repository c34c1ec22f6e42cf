"""`dynmo data prepare SRC... --tokenizer T --out DIR`: a corpus -> token shards (docs/data.md).

Bad input is one line and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import os
import sys

from dynmo.data.corpus import DataError

USAGE = "dynmo data prepare SRC... --tokenizer T --out DIR [--field F] [--workers N] [--memory-gb G]"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynmo data prepare", description=(
        "Tokenize sources (.txt/.md files or folders, .jsonl[.gz|.zst], .parquet, datasets saved with "
        "save_to_disk) into token shards that `data.prepared` trains on. Rerun the same command to resume."))
    p.add_argument("sources", nargs="+", metavar="SRC")
    p.add_argument("--tokenizer", required=True, metavar="T",
                   help="a Hugging Face checkpoint folder, a tokenizer.json, or bpe:N (a byte-level BPE of N tokens "
                        "trained on the sources' first 64 M characters)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, empty, or this same "
                   "preparation's unfinished work, which is resumed)")
    p.add_argument("--field", default="text", help="the JSON field or column holding the text (default: text)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: the cores)")
    p.add_argument("--memory-gb", type=float, default=1.0, help="memory for the workers together (default: 1.0)")
    p.add_argument("--shard-mb", type=float, default=64, help="input text per shard, MB (default: 64)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}\n\nverbs:\n  prepare    tokenize a corpus into token shards (dynmo data prepare --help)")
        return 0
    if argv[0] != "prepare":
        print(f"dynmo data: unknown verb {argv[0]!r}; usage: {USAGE}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv[1:])
    if args.workers < 1:
        print(f"dynmo data prepare: error: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    from dynmo.data.prepare import prepare_folder

    try:
        m = prepare_folder(args.sources, args.tokenizer, args.out, field=args.field, workers=args.workers,
                           memory_gb=args.memory_gb, shard_mb=args.shard_mb, quiet=args.quiet)
    except DataError as e:
        print(f"dynmo data prepare: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"dynmo: {args.out}: {m['docs']} documents, {m['tokens']} tokens ({m['dtype']}) in "
              f"{len(m['shards'])} shards", file=sys.stderr)
    return 0
