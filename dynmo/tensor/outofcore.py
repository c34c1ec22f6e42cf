"""The features of a tensor larger than memory: the same numbers as `features.features`, with
peak memory within a budget, by DuckDB's out-of-core aggregation.

    features_within(path, memory_gb, tmp_dir, sizes=None, header=None, progress=None)
    convert_to_parquet(src, out, memory_gb, tmp_dir, ...)     (`dynmo tensor convert`)

How. The file is read in blocks of a few tens of MB (numpy's reader on each block, the same
checks as `tns.read_tns`: whole indices >= 1, finite values, within the sizes) and appended to a
table in a DuckDB database file under `tmp_dir`; DuckDB then computes every distribution with
GROUP BY, spilling to `tmp_dir` past its memory limit. A distribution needs only its nonempty
groups' count, sum, largest, smallest and sum of squares (`features.Moments`), which one
aggregate over the groups gives exactly (integers), so the statistics equal the in-memory
path's (both round the same exact rationals once).

Per pair of modes (a, b), a > b, with `rest` the other modes: the fibers of free mode a are the
groups of (rest, b): one GROUP BY, kept as a table of (rest, count); its counts are the nonzeros
per fiber of mode a (taken once per a), their sums per `rest` the nonzeros per slice of free modes
(b, a), and the number of its rows per `rest` the fibers per slice. The fibers of free mode 0
(every mode but 0) and the duplicate check (every mode) are one more GROUP BY each.

Why DuckDB: its hash aggregation spills by itself, runs on every core and needs no partition
count chosen ahead; partitioning the keys to disk with numpy and counting each partition (the
alternative) was not built. Measured in docs/bench/tensor-out-of-core.md.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from dynmo.tensor import duck, parquet
from dynmo.tensor.coo import TensorError
from dynmo.tensor.features import Distribution, DuplicateError, Moments, TensorFeatures, assemble, count_product
from dynmo.tensor.tns import MAX_SIZE, TensorFileError, _first_bad_line, _open, layout, line_numbers

BLOCK_BYTES = 1 << 25  # text read per block: 32 MiB, about 1.5M lines of a 4-mode tensor


def _blocks(path: Path, skip: int):
    """The file's text after its first `skip` lines, in blocks of whole lines."""
    stream, raw = _open(path)
    with raw, stream:
        rest = b""
        for _ in range(skip):
            line = stream.readline()
            if not line:
                return
        while True:
            data = stream.read(BLOCK_BYTES)
            if not data:
                if rest.strip():
                    yield rest.decode("latin-1")
                return
            data = rest + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            rest = data[cut:]
            yield data[:cut].decode("latin-1")


def _load(con, path: Path, ncols: int, skip: int, say, values: bool = False) -> tuple[int, list[int]]:
    """Append the file's nonzeros to table t (r, i0, ..., i{N-1}[, v]), 0-based indices in file
    order; (nnz, largest 1-based index per mode)."""
    order = ncols - 1
    cols = ", ".join(f"i{m} INTEGER" for m in range(order))
    con.execute(f"CREATE TABLE t (r BIGINT, {cols}{', v DOUBLE' if values else ''})")
    row = np.dtype([("i", np.int64, (order,)), ("v", np.float64)])
    nnz, top = 0, [0] * order
    for text in _blocks(path, skip):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a block of comments only
                arr = np.loadtxt(io.StringIO(text), dtype=row, comments="#", ndmin=1)
        except (ValueError, OverflowError) as e:
            raise _first_bad_line(path, skip, ncols, e) from None
        if arr.size == 0:
            continue
        idx = arr["i"]
        if idx.min() < 1 or not np.isfinite(arr["v"]).all():
            raise _first_bad_line(path, skip, ncols)
        if idx.max() > MAX_SIZE:
            raise TensorFileError(f"{path}: a mode size over {MAX_SIZE} is not supported")
        block = {"r": np.arange(nnz, nnz + idx.shape[0], dtype=np.int64)}
        for m in range(order):
            block[f"i{m}"] = (idx[:, m] - 1).astype(np.int32)
        if values:
            block["v"] = arr["v"]
        top = [max(a, int(b)) for a, b in zip(top, idx.max(axis=0))]
        con.register("block", block)
        con.execute("INSERT INTO t SELECT * FROM block")
        con.unregister("block")
        nnz += idx.shape[0]
        del arr, idx, block
        say(f"read {nnz} nonzeros")
    return nnz, top


def _moments(con, groups: str) -> Moments:
    """The moments of column c over the rows of the query `groups`."""
    n, total, mx, mn, sumsq = con.execute(
        f"SELECT count(*), sum(c::HUGEINT), max(c), min(c), sum(c::HUGEINT * c) FROM ({groups})").fetchone()
    return Moments(int(n), int(total), int(mx), int(mn), int(sumsq))


def tns_layout(p: Path, header: bool | None) -> tuple[int, int, tuple[int, ...] | None]:
    """(columns a line holds, lines before the first nonzero, the header's sizes or None) of a
    .tns file, with the in-memory reader's errors for one that holds no tensor of order >= 2."""
    name = str(p)
    ncols, skip, head_sizes, _ = layout(p, header)
    if ncols == 0:
        raise TensorFileError(f"{name}: no nonzeros (the file is empty, or holds only comments"
                              f"{' and its header' if head_sizes else ''})")
    if ncols == 1:
        raise _first_bad_line(p, skip, ncols)
    if ncols == 2:
        raise TensorError("a tensor of order 1 has no slices; features need at least 2 modes")
    return ncols, skip, head_sizes


def features_within(path, memory_gb: float, tmp_dir, *, sizes=None, header: bool | None = None,
                    progress: Callable[[str], None] | None = None) -> TensorFeatures:
    """`features.features` of a .tns file (or a .parquet of `dynmo tensor convert`) with DuckDB
    holding at most DUCKDB_SHARE of `memory_gb` and its spills in a temporary folder under
    `tmp_dir` (removed at the end, whatever happens)."""
    p, say = Path(path), progress or (lambda msg: None)
    if p.suffix == ".parquet":
        with duck.within(memory_gb, tmp_dir, "features") as con:
            nnz, top, head_sizes = parquet.view(con, p)
            return _features(con, str(path), parquet.sizes(p, con, sizes, head_sizes, top), nnz, say)
    ncols, skip, head_sizes = tns_layout(p, header)
    with duck.within(memory_gb, tmp_dir, "features") as con:
        nnz, top = _load(con, p, ncols, skip, say)
        if nnz == 0:
            raise TensorFileError(f"{path}: no nonzeros (the file is empty, or holds only comments"
                                  f"{' and its header' if head_sizes else ''})")
        return _features(con, str(path), _sizes(p, con, sizes, head_sizes, top, header), nnz, say)


def _sizes(p: Path, con, sizes, head_sizes, top: list[int], header) -> tuple[int, ...]:
    """The mode sizes (given, the header's, or the largest indices), every index within them."""
    if sizes is not None:
        dims, what = tuple(int(s) for s in sizes), "--sizes"
        if len(dims) != len(top):
            raise TensorFileError(f"{p}: {len(dims)} sizes given for a tensor with {len(top)} modes")
    elif head_sizes is not None:
        dims, what = tuple(head_sizes), "its sizes line"
    else:
        dims, what = tuple(top), ""
    if any(s > MAX_SIZE for s in dims):
        raise TensorFileError(f"{p}: a mode size over {MAX_SIZE} is not supported")
    for m, (s, h) in enumerate(zip(dims, top)):
        if h > s:
            row = con.execute(f"SELECT min(r) FROM t WHERE i{m} >= {s}").fetchone()[0]
            line = line_numbers(p, [int(row)], header=header)[0]
            raise TensorFileError(f"{p}:{line}: index {h} in column {m + 1} is beyond size {s} "
                                  f"({what} says mode {m + 1} has {s})")
    return dims


def _features(con, name: str, sizes: tuple[int, ...], nnz: int, say) -> TensorFeatures:
    n = len(sizes)
    every = ", ".join(f"i{m}" for m in range(n))
    dup = con.execute(f"SELECT min(r), max(r) FROM t GROUP BY {every} HAVING count(*) > 1 LIMIT 1").fetchone()
    if dup is not None:
        coord = con.execute(f"SELECT {every} FROM t WHERE r = {int(dup[1])}").fetchone()
        raise DuplicateError(f"coordinate {tuple(int(x) + 1 for x in coord)} (1-based) appears twice",
                             (int(dup[0]), int(dup[1])))
    say("features: no coordinate repeats")
    fibers = {0: Distribution("nnz_per_fiber", (0,), count_product(sizes[1:]), None,
                              moments=_moments(con, f"SELECT count(*) AS c FROM t GROUP BY "
                                                    f"{', '.join(f'i{m}' for m in range(1, n))}"))}
    slices, fps = [], []
    pairs = [(a, b) for a in range(1, n) for b in range(a)]  # FeaTensor's order
    for k, (a, b) in enumerate(pairs, 1):
        rest = [m for m in range(n) if m not in (a, b)]
        slice_all = count_product(sizes[m] for m in rest)
        keys = ", ".join(f"i{m}" for m in rest)
        con.execute(f"CREATE OR REPLACE TEMP TABLE f AS SELECT {keys}{', ' if keys else ''}count(*) AS c "
                    f"FROM t GROUP BY {keys}{', ' if keys else ''}i{b}")
        if a not in fibers:
            fibers[a] = Distribution("nnz_per_fiber", (a,), slice_all * sizes[b], None,
                                     moments=_moments(con, "SELECT c FROM f"))
        by = f" GROUP BY {keys}" if keys else ""
        free = (b, a)
        slices.append(Distribution("nnz_per_slice", free, slice_all, None,
                                   moments=_moments(con, f"SELECT sum(c) AS c FROM f{by}")))
        fps.append(Distribution("fibers_per_slice", free, slice_all, None, fiber_mode=a,
                                moments=_moments(con, f"SELECT count(*) AS c FROM f{by}")))
        say(f"features: slices of modes ({b}, {a}) done, {k} of {len(pairs)}")
    con.execute("DROP TABLE IF EXISTS f")
    return assemble(name, sizes, nnz, slices, [fibers[m] for m in range(n)], fps)


def convert_to_parquet(src, out, memory_gb: float, tmp_dir, *, sizes_=None, header: bool | None = None, say=None) -> tuple[int, tuple[int, ...]]:
    """Write the .tns file `src` as Parquet `out` (a temporary name renamed into place when
    whole); (nnz, sizes)."""
    p, say = Path(src), say or (lambda msg: None)
    ncols, skip, head_sizes = tns_layout(p, header)
    part = Path(out).with_name(f".{Path(out).name}.part")
    try:
        with duck.within(memory_gb, tmp_dir, "convert") as con:
            nnz, top = _load(con, p, ncols, skip, say, values=True)
            if nnz == 0:
                raise TensorFileError(f"{src}: no nonzeros")
            dims = _sizes(p, con, sizes_, head_sizes, top, header)
            cols = ", ".join(f"i{m} + 1 AS i{m}" for m in range(ncols - 1))
            con.execute(f"COPY (SELECT {cols}, v FROM t ORDER BY r) TO '{part}' "
                        f"(FORMAT parquet, KV_METADATA {{{parquet.SIZES_KEY}: '{','.join(map(str, dims))}'}})")
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
    return nnz, dims
