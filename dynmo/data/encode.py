"""One worker of `dynmo data prepare`: it reads the whole document stream and encodes its shards.

The stream is cut into shards by the documents' sizes alone: a shard closes after the document
that takes it to `shard_bytes` of input, so which documents land in which shard, and so every
byte written, is the same for any number of workers. A worker that reaches the start of a shard
no one has claimed claims it (it creates the shard's .part file, exclusively) and encodes it;
it reads past the others' documents without decoding them: while one worker encodes a shard,
the next one reaching a free shard takes it, so the work spreads evenly whatever the shards'
count. A worker skips shards an earlier run finished (their .json is there) and encodes its own
in batches of about `batch_bytes` of text, appending each batch's ids to the shard's file: its
memory is the batch's, whatever the corpus' size. It encodes with `encode_batch_fast` where the
tokenizers library has it (0.20 on): `encode_batch`'s ids, post-processor included, without
the character offsets nothing here reads, about 10 % less work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dynmo.data.shards import ShardWriter, shard_name, token_dtype
from dynmo.data.sources import SourceFile, records

PROGRESS_EVERY_S = 0.5


@dataclass
class Job:
    out: Path
    files: list[SourceFile]
    field: str
    tokenizer: str  # the tokenizer's JSON
    eos: int
    vocab_size: int
    shard_bytes: int
    batch_bytes: int
    worker: int
    workers: int


@dataclass
class Tally:
    read: int = 0  # bytes of the source files read from disk
    docs: int = 0
    tokens: int = 0


def run(job: Job, report: Callable[[Tally], None] = lambda t: None) -> int:
    """Encode this worker's unfinished shards; return the number of shards of the whole stream."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(job.tokenizer)
    # the same ids without the character offsets, which nothing here reads (tokenizers >= 0.20)
    encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    dtype = token_dtype(job.vocab_size)
    tally, progress = Tally(), [0]
    shard, limit, filled = 0, job.shard_bytes, 0  # the shard being cut, where it closes, bytes so far
    writer: ShardWriter | None = None
    batch: list[str] = []
    batch_size = 0
    last = time.monotonic()

    def claim(j: int) -> ShardWriter | None:
        if (job.out / f"{shard_name(j)}.json").exists():
            return None
        try:
            return ShardWriter(job.out, j, dtype)
        except FileExistsError:  # another worker's
            return None

    def flush() -> None:
        nonlocal batch, batch_size
        if batch:
            docs = [e.ids for e in encode_batch(batch)]
            tally.tokens += writer.add(docs, job.eos)
            tally.docs += len(docs)
        batch, batch_size = [], 0

    writer = claim(0)
    try:
        for rec in records(job.files, job.field, progress):
            if writer is not None:
                text = rec.text()
                batch.append(text)
                batch_size += len(text)
                if batch_size >= job.batch_bytes:
                    flush()
            filled += rec.size
            if filled >= limit:  # this document closes the shard
                if writer is not None:
                    flush()
                    writer.finish({"input_bytes": filled})
                shard, limit, filled = shard + 1, job.shard_bytes, 0
                writer = claim(shard)
            now = time.monotonic()
            if now - last > PROGRESS_EVERY_S:
                tally.read, last = progress[0], now
                report(tally)
        if filled:  # the last shard, cut short by the stream's end
            if writer is not None:
                flush()
                writer.finish({"input_bytes": filled})
                writer = None
            shard += 1
    finally:
        if writer is not None:
            writer.abandon()
    tally.read = progress[0]
    report(tally)
    return shard
