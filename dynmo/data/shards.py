"""One token shard on disk: Megatron-LM's indexed-dataset layout, written by streaming.

    shard-NNNNN.bin    the token ids of its documents, back to back (uint16 when the vocabulary
                       fits, else 32-bit), every document ending in the tokenizer's EOS
    shard-NNNNN.idx    Megatron's index: b"MMIDIDX\\x00\\x00", version 1, the dtype code, the
                       document count twice, each document's length (int32) and byte offset
                       (int64), then the document indices 0..n (int64)
    shard-NNNNN.json   its figures and the SHA-256 of both files; written last, by a rename, so
                       a shard without it is unfinished work and is never read

`ShardWriter` claims a shard by creating its .claim file (exclusively: one worker per shard),
appends the ids to it batch by batch, so a shard never sits in memory, and `finish` renames the
.bin, then the .idx, then the .json into place.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynmo.data.corpus import DataError

MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}  # Megatron's codes
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
HASH_CHUNK = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else 32 bits (int32, Megatron's code for it: ids stay < 2**31)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Appends documents' ids to `folder/shard-NNNNN.bin.part`; `finish` publishes the shard."""

    def __init__(self, folder: Path, index: int, dtype: np.dtype):
        self.folder, self.name, self.dtype = folder, shard_name(index), np.dtype(dtype)
        self.lengths: list[int] = []
        self.hash = hashlib.sha256()
        # FileExistsError: another worker has claimed this shard (the claim stays until the run ends)
        open(folder / f"{self.name}.claim", "xb").close()
        self.tmp = folder / f"{self.name}.bin.part"
        self.file = open(self.tmp, "wb")

    def add(self, docs: list[list[int]], eos: int) -> int:
        """Append documents (each gets `eos` at its end); returns the tokens written."""
        if not docs:
            return 0
        for d in docs:
            d.append(eos)
        lengths = [len(d) for d in docs]
        flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype, count=sum(lengths))
        blob = flat.tobytes()
        self.file.write(blob)
        self.hash.update(blob)
        self.lengths.extend(lengths)
        return int(flat.size)

    def finish(self, extra: dict) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        idx = index_bytes(lengths, self.dtype)
        info = {"name": self.name, "docs": int(lengths.size), "tokens": int(lengths.astype(np.int64).sum()),
                "bin_sha256": self.hash.hexdigest(), "idx_sha256": hashlib.sha256(idx).hexdigest(), **extra}
        os.replace(self.tmp, self.folder / f"{self.name}.bin")
        _atomic_write(self.folder / f"{self.name}.idx", idx)
        _atomic_write(self.folder / f"{self.name}.json", (json.dumps(info, sort_keys=True) + "\n").encode())
        return info

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def index_bytes(lengths: np.ndarray, dtype: np.dtype) -> bytes:
    n = int(lengths.size)
    pointers = np.zeros(n, dtype=np.int64)
    if n:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    head = MAGIC + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[np.dtype(dtype)]) + struct.pack("<QQ", n, n + 1)
    return head + lengths.astype("<i4").tobytes() + pointers.astype("<i8").tobytes() + np.arange(n + 1, dtype="<i8").tobytes()


def read_index(path: Path) -> tuple[np.dtype, np.ndarray]:
    """A .idx file's token dtype and per-document lengths."""
    blob = path.read_bytes()
    head = len(MAGIC) + 8 + 1 + 16
    if len(blob) < head or blob[: len(MAGIC)] != MAGIC:
        raise DataError(f"{path} is not a token index (no MMIDIDX header); prepare the folder again")
    code = blob[len(MAGIC) + 8]
    n, _ = struct.unpack("<QQ", blob[len(MAGIC) + 9 : head])
    if code not in CODE_DTYPES or len(blob) != head + n * 4 + n * 8 + (n + 1) * 8:
        raise DataError(f"{path} is truncated or damaged; prepare the folder again")
    return CODE_DTYPES[code], np.frombuffer(blob, dtype="<i4", count=n, offset=head).astype(np.int64)


@dataclass
class Shard:
    """A finished shard, memory-mapped: its ids and each document's start and length in tokens."""

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def open(cls, folder: Path, name: str, tokens: int) -> "Shard":
        dtype, lengths = read_index(folder / f"{name}.idx")
        path = folder / f"{name}.bin"
        if path.stat().st_size != tokens * dtype.itemsize or int(lengths.sum()) != tokens:
            raise DataError(f"{path} holds {path.stat().st_size} bytes, not the {tokens} tokens its manifest "
                            "records: truncated or damaged; prepare the folder again")
        ids = np.memmap(path, dtype=dtype, mode="r") if tokens else np.zeros(0, dtype)
        starts = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size:
            np.cumsum(lengths[:-1], out=starts[1:])
        return cls(tokens=ids, starts=starts, lengths=lengths)
