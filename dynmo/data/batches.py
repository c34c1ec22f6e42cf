"""Each step's windows, drawn from prepared folders: memory-mapped shards, a blend, held-out documents.

Validation holds out documents, never the train stream's tail: document g of a folder (counted
over its shards in order) validates when a hash of g falls below `val_fraction` (at least one
document when the fraction is > 0). The others, back to back, are the train stream.

Step k draws `global_batch` windows of seq_len + 1 tokens. Window n = k * global_batch + b comes
from the folder that a golden-ratio sequence puts it in (its share of windows follows
`data.weights` within a window or two at any length, Megatron's blend without its state), and
starts where a generator seeded by (seed, split, k) puts it: the same on every rank, for any
layout, data-parallel size or restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynmo.data.corpus import DataError
from dynmo.data.manifest import read_manifest
from dynmo.data.shards import Shard

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
TRAIN, VAL = 0, 1


def held_out(n_docs: int, fraction: float) -> np.ndarray:
    """Which of `n_docs` documents validate: a splitmix64 hash of each index below `fraction`."""
    if fraction <= 0 or n_docs == 0:
        return np.zeros(n_docs, dtype=bool)
    with np.errstate(over="ignore"):
        z = np.arange(n_docs, dtype=np.uint64) * GOLDEN + GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
    out = u < fraction
    if not out.any():
        out[int(np.argmin(u))] = True
    return out


class Stream:
    """A split of one folder: runs of consecutive documents of that split, shard by shard."""

    def __init__(self, shards: list[Shard], split_of: list[np.ndarray], split: int):
        self.shards = shards
        rs, st, ln = [], [], []
        for s, (shard, flags) in enumerate(zip(shards, split_of)):
            mine = flags == bool(split)
            if not mine.any():
                continue
            edges = np.flatnonzero(np.diff(np.concatenate([[False], mine, [False]]).astype(np.int8)))
            for a, b in zip(edges[::2], edges[1::2]):
                rs.append(s)
                st.append(shard.starts[a])
                ln.append(shard.starts[b - 1] + shard.lengths[b - 1] - shard.starts[a])
        self.run_shard = np.asarray(rs, dtype=np.int64)
        self.run_start = np.asarray(st, dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(np.asarray(ln, dtype=np.int64))])
        self.total = int(self.cum[-1])

    def window(self, pos: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        got = 0
        r = int(np.searchsorted(self.cum, pos, side="right")) - 1
        while got < length:
            off = pos + got - int(self.cum[r])
            take = min(length - got, int(self.cum[r + 1]) - pos - got)
            s, a = int(self.run_shard[r]), int(self.run_start[r]) + off
            out[got : got + take] = self.shards[s].tokens[a : a + take]
            got += take
            r += 1
        return out


def _open(folder: Path, val_fraction: float) -> tuple[Stream, Stream]:
    m = read_manifest(folder)
    shards = [Shard.open(folder, s["name"], s["tokens"]) for s in m["shards"]]
    flags = held_out(sum(s.lengths.size for s in shards), val_fraction)
    cuts = np.cumsum([0] + [s.lengths.size for s in shards])
    split_of = [flags[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    return Stream(shards, split_of, TRAIN), Stream(shards, split_of, VAL)


@dataclass
class TokenData:
    train: list[Stream]
    val: list[Stream]
    weights: np.ndarray  # cumulative, normalised
    seq_len: int
    seed: int

    @classmethod
    def load(cls, folders: Path | str | list, seq_len: int, val_fraction: float, seed: int,
             weights: list[float] | None = None) -> "TokenData":
        folders = [Path(folders)] if isinstance(folders, (str, Path)) else [Path(f) for f in folders]
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        w = np.asarray(weights or [1.0] * len(folders), dtype=np.float64)
        if w.size != len(folders) or not (w > 0).all():
            raise DataError(f"data.weights needs one weight > 0 per data.prepared folder, got {list(w)}")
        train, val = [], []
        for f in folders:
            t, v = _open(f, val_fraction)
            if val_fraction == 0:
                v = t
            for name, part in (("train", t), ("validation", v)):
                if part.total < seq_len + 2:
                    raise DataError(f"the {name} split of {f} has {part.total} tokens, fewer than model.seq_len + 2 = "
                                    f"{seq_len + 2}; use more text or a shorter model.seq_len")
            train.append(t)
            val.append(v)
        return cls(train=train, val=val, weights=np.cumsum(w / w.sum()), seq_len=seq_len, seed=seed)

    def sources(self, step: int, global_batch: int) -> np.ndarray:
        """The folder each of the step's windows comes from (the blend)."""
        n = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.uint64)
        with np.errstate(over="ignore"):
            u = (n * GOLDEN >> np.uint64(11)).astype(np.float64) * 2.0**-53
        return np.minimum(np.searchsorted(self.weights, u, side="right"), len(self.weights) - 1)

    def batch(self, step: int, global_batch: int, split: str = "train") -> np.ndarray:
        """[global_batch, seq_len + 1] int64 windows for `step`; the same on every rank."""
        streams = self.train if split == "train" else self.val
        rng = np.random.default_rng([self.seed, TRAIN if split == "train" else VAL, step])
        L = self.seq_len + 1
        if len(streams) == 1:
            src = np.zeros(global_batch, dtype=np.int64)
            starts = rng.integers(0, streams[0].total - L, size=global_batch)
        else:
            src = self.sources(step, global_batch)
            starts = rng.integers(0, np.asarray([streams[s].total - L for s in src]))
        return np.stack([streams[s].window(int(p), L) for s, p in zip(src, starts)])
