"""The tokenizer's own throughput, the yardstick of `dynmo data prepare` (docs/bench/data-prepare.md).

    python benchmarks/encode_reference.py TOKENIZER_JSON FILE... [--workers 2] [--field text] [--batch-mb 8]

Runs `--workers` processes (spawned, as `dynmo data prepare`'s are); process w takes files
w, w + workers, ... of the JSON-lines files given (.jsonl, .jsonl.zst, .jsonl.gz), decompresses
them, takes each line's `--field` and hands the texts to `Tokenizer.encode_batch` in batches of
about `--batch-mb` MB, and does nothing else: no ids are kept or written. It prints the
documents, tokens and text bytes encoded and the wall time. Timed as a whole process beside
`dynmo data prepare` over the same files, the ratio of the two is what preparing adds to
tokenizing.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import sys
import time


def _open(path: str):
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True),
                                 1 << 20)
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)


def encode_files(tok_path: str, files: list[str], field: str, batch_bytes: int, out) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    docs = tokens = size = 0
    batch: list[str] = []
    held = 0

    def flush() -> int:
        return sum(len(e.ids) for e in tok.encode_batch(batch))

    for path in files:
        with _open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                text = json.loads(line)[field]
                batch.append(text)
                held += len(text)
                size += len(text)
                if held >= batch_bytes:
                    tokens += flush()
                    docs += len(batch)
                    batch, held = [], 0
    if batch:
        tokens += flush()
        docs += len(batch)
    out.put((docs, tokens, size))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tokenizer")
    p.add_argument("files", nargs="+")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--field", default="text")
    p.add_argument("--batch-mb", type=float, default=8)
    a = p.parse_args(argv)
    t = time.perf_counter()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=encode_files, args=(a.tokenizer, a.files[w :: a.workers], a.field,
                                                     int(a.batch_mb * (1 << 20)), q)) for w in range(a.workers)]
    for pr in procs:
        pr.start()
    results = [q.get() for _ in procs]
    for pr in procs:
        pr.join()
    docs, tokens, size = (sum(r[i] for r in results) for i in range(3))
    wall = time.perf_counter() - t
    print(f"encode_batch x{a.workers}: {docs} documents, {tokens} tokens, {size / 1e6:.1f} M characters in "
          f"{wall:.1f} s ({size / 1e6 / wall:.2f} M characters/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
