"""Generate a large JSON-lines corpus for `dynmo data prepare` (docs/bench/data-prepare.md).

    python benchmarks/make_corpus.py OUT_DIR --files 24 --mb 128 [--seed 0] [--level 3]

writes OUT_DIR/part-00000.jsonl.zst ... : each file holds about `--mb` MiB of text (the "text"
fields' UTF-8 bytes) as JSON lines `{"id": N, "text": "..."}`, compressed with zstandard at
`--level`. The words are the bundled Shakespeare plays' vocabulary (every word-like token of
the plays, lower-cased, with its count there), drawn with those frequencies; sentences of 4-30
words with a capital first letter and a stop, a number in 8 % of them, paragraphs of 4
sentences on average (each sentence ends one with probability 1/4). Document lengths are
log-normal, the spread of web text: about 2.5 KB median, 4.4 KB mean, from about 150 B to
180 KB. Everything comes from one seeded generator per file (seed, file index),
so the same arguments give the same bytes, and files can be written in any order.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

WORD = re.compile(r"[A-Za-z][A-Za-z']*")


def vocabulary() -> tuple[list[str], np.ndarray]:
    """The plays' words, most frequent first, and their cumulative probabilities."""
    from dynmo.data.corpus import corpus_files

    counts: Counter[str] = Counter()
    for f in corpus_files([]):
        counts.update(w.lower() for w in WORD.findall(f.read_text(encoding="utf-8")))
    words = [w for w, _ in counts.most_common()]
    freq = np.array([counts[w] for w in words], dtype=np.float64)
    return words, np.cumsum(freq / freq.sum())


def documents(rng: np.random.Generator, words: list[str], cdf: np.ndarray, text_bytes: int):
    """Documents until `text_bytes` of text: each a list of paragraphs of sentences."""
    made = 0
    cap = [w.capitalize() for w in words]
    while made < text_bytes:
        want = int(np.clip(rng.lognormal(np.log(2700), 1.1), 200, 200_000))
        n_words = max(want // 6, 4)  # about 6 bytes a word with its space
        ids = np.searchsorted(cdf, rng.random(n_words), side="right").clip(max=len(words) - 1)
        cuts = np.cumsum(rng.integers(4, 31, size=n_words // 4 + 2))
        cuts = cuts[cuts < n_words]
        paras, sents, start = [], [], 0
        stops = rng.choice([". ", ". ", ". ", "? ", "! ", "; "], size=cuts.size + 1)
        numbers = rng.random(cuts.size + 1) < 0.08
        for k, end in enumerate([*cuts.tolist(), n_words]):
            chunk = ids[start:end]
            if chunk.size:
                s = [cap[chunk[0]], *(words[i] for i in chunk[1:].tolist())]
                if numbers[k]:
                    s.insert(len(s) // 2, str(int(rng.integers(1, 10_000))))
                sents.append(" ".join(s) + stops[k])
            start = end
            if sents and (rng.random() < 0.25 or end == n_words):
                paras.append("".join(sents).rstrip())
                sents = []
        text = "\n\n".join(paras)
        made += len(text.encode("utf-8"))
        yield text


def write_file(path: Path, index: int, seed: int, mb: float, level: int, words, cdf) -> tuple[int, int]:
    import zstandard

    rng = np.random.default_rng([seed, index])
    tmp = path.with_name(path.name + ".part")
    docs = 0
    text_bytes = 0
    with open(tmp, "wb") as raw, zstandard.ZstdCompressor(level=level).stream_writer(raw) as z:
        buf: list[str] = []
        for text in documents(rng, words, cdf, int(mb * (1 << 20))):
            buf.append(json.dumps({"id": docs, "text": text}, ensure_ascii=False))
            docs += 1
            text_bytes += len(text.encode("utf-8"))
            if len(buf) >= 256:
                z.write(("\n".join(buf) + "\n").encode("utf-8"))
                buf = []
        if buf:
            z.write(("\n".join(buf) + "\n").encode("utf-8"))
    tmp.replace(path)
    return docs, text_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--files", type=int, default=24)
    p.add_argument("--mb", type=float, default=128, help="text per file, MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level", type=int, default=3, help="zstandard level")
    p.add_argument("--first", type=int, default=0, help="index of the first file to write")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    words, cdf = vocabulary()
    print(f"vocabulary: {len(words)} words from the plays", file=sys.stderr)
    for i in range(a.first, a.first + a.files):
        path = out / f"part-{i:05d}.jsonl.zst"
        if path.exists():
            continue
        t = time.perf_counter()
        docs, text = write_file(path, i, a.seed, a.mb, a.level, words, cdf)
        print(f"{path}: {docs} documents, {text / 1e6:.1f} MB text, {path.stat().st_size / 1e6:.1f} MB on disk, "
              f"{time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
