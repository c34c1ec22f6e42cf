"""Whether a `dynmo data prepare` fits this machine, checked before anything is written.

Memory: the workers together stay within `--memory-gb` (`prepare.batch_bytes` sizes their
batches for it), so the check is `--memory-gb` against the memory available now
(`dynmo.machine.memory_available`).

Disk: the shards take their tokens' bytes (2 or 4 a token) and 8 bytes a document for the
offsets. The tokens are estimated before encoding from the text's size and the tokenizer's
tokens per byte on the first `SAMPLE_BYTES` of the sources. The text's size is known for plain
text and uncompressed JSON lines (their file sizes, an over-estimate by the JSON around the
text); for compressed or columnar sources it is not known before they are read, and the disk
is not checked for them (what can be checked still is). A resumed preparation needs only
what its finished shards do not already hold.
"""

from __future__ import annotations

from pathlib import Path

from dynmo import machine
from dynmo.data.corpus import DataError
from dynmo.data.sources import SourceFile, records

SAMPLE_BYTES = 1 << 20
MARGIN = 1.10  # the sample's tokens per byte, the end of each document, rounding


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GB"


def check_memory(memory_gb: float) -> None:
    have = machine.memory_available()
    want = memory_gb * 2**30
    if have is not None and want > have:
        raise DataError(f"--memory-gb {memory_gb:g} asks for {_gb(want)} but {_gb(have)} of memory is available; "
                        f"give --memory-gb {max(have / 2**30 * 0.9, 0.01):.2f} or less (it bounds the workers together)")


def plain_bytes(files: list[SourceFile]) -> int | None:
    """The text's bytes when every source's size says it (plain text, uncompressed JSON lines)."""
    plain = all(f.kind == "text" or (f.kind == "jsonl" and f.path.name.lower().endswith(".jsonl")) for f in files)
    return sum(f.size for f in files) if plain else None


def tokens_per_byte(files: list[SourceFile], field: str, blob: str) -> float:
    """Tokens per byte of text on the first `SAMPLE_BYTES` of the sources, with this tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(blob)
    texts, size = [], 0
    for rec in records(files, field):
        text = rec.text()[: SAMPLE_BYTES - size]
        texts.append(text)
        size += len(text.encode("utf-8"))
        if size >= SAMPLE_BYTES:
            break
    if size == 0:
        return 0.0
    return sum(len(e.ids) for e in tok.encode_batch(texts)) / size


def check_disk(out: Path, files: list[SourceFile], field: str, blob: str, itemsize: int) -> None:
    text = plain_bytes(files)
    if text is None:
        return
    have = machine.disk_free(out)
    if have is None:
        return
    held = sum(p.stat().st_size for p in out.glob("shard-*")) if out.is_dir() else 0
    need = text * tokens_per_byte(files, field, blob) * itemsize * MARGIN - held
    if need > have:
        raise DataError(f"the shards need about {_gb(need)} ({_gb(text)} of text) but {out} has {_gb(have)} free; "
                        "give an --out on a larger disk, or prepare the sources in parts")
