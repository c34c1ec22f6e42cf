"""Sparse tensors as Parquet: a binary COO that reads many times faster than `.tns` text.

    dynmo tensor convert FILE.tns OUT.parquet     (`outofcore.convert_to_parquet`)
    dynmo tensor features OUT.parquet [--memory-gb G]

A file holds one row per nonzero, in the .tns file's order: columns `i0` .. `i{N-1}` (INTEGER,
1-based as in .tns) and `v` (DOUBLE), and the mode sizes as the key-value metadata
`dynmo_sizes` ("I,J,K"). `outofcore.convert_to_parquet` writes it by DuckDB in blocks, so a
tensor larger than memory converts within `--memory-gb`; the in-memory reader (`read_parquet`)
checks what the text reader checks: indices whole and >= 1, within the sizes, values finite.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dynmo.tensor import duck
from dynmo.tensor.coo import SparseTensor
from dynmo.tensor.tns import MAX_SIZE, TensorFileError

SIZES_KEY = "dynmo_sizes"


def _columns(con, p: Path) -> tuple[int, bool]:
    """(the order, whether values are there) of a dynmo Parquet tensor (columns i0.. [, v]), or
    TensorFileError."""
    try:
        cols = [r[0] for r in con.execute("DESCRIBE SELECT * FROM read_parquet(?)", [str(p)]).fetchall()]
    except Exception as e:  # duckdb's errors for a file that is not Parquet
        raise TensorFileError(f"{p}: not a Parquet file ({str(e).splitlines()[0]})") from None
    order = sum(1 for c in cols if c.startswith("i") and c[1:].isdigit())
    if order < 2 or cols[:order] != [f"i{m}" for m in range(order)]:
        raise TensorFileError(f"{p}: expected index columns i0, i1, ... first (a file of `dynmo tensor convert`), "
                              f"found {', '.join(cols)}")
    return order, "v" in cols[order:]


def _meta_sizes(con, p: Path) -> tuple[int, ...] | None:
    rows = con.execute("SELECT key::VARCHAR, value::VARCHAR FROM parquet_kv_metadata(?)", [str(p)]).fetchall()
    text = dict(rows).get(SIZES_KEY)
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise TensorFileError(f"{p}: its {SIZES_KEY} metadata {text!r} is not a list of sizes") from None


def view(con, p: Path) -> tuple[int, list[int], tuple[int, ...] | None]:
    """Table t (r, i0, ...) of 0-based indices over the file, for `outofcore`; (nnz, largest
    1-based index per mode, the sizes its metadata gives)."""
    if not p.is_file():
        raise TensorFileError(f"{p}: no such file")
    order, has_values = _columns(con, p)
    idx = ", ".join(f"i{m} - 1 AS i{m}" for m in range(order))
    con.execute(f"CREATE VIEW t AS SELECT file_row_number AS r, {idx}{', v' if has_values else ''} "
                f"FROM read_parquet('{p}', file_row_number=true)")
    agg = ", ".join(f"max(i{m}) + 1, min(i{m}) + 1" for m in range(order))
    row = con.execute(f"SELECT count(*), {agg} FROM t").fetchone()
    nnz, tops, lows = int(row[0]), [int(x or 0) for x in row[1::2]], [int(x or 1) for x in row[2::2]]
    if nnz == 0:
        raise TensorFileError(f"{p}: no nonzeros")
    if min(lows) < 1:
        bad = con.execute(f"SELECT min(r) FROM t WHERE least({', '.join(f'i{m}' for m in range(order))}) < 0").fetchone()[0]
        raise TensorFileError(f"{p}: row {int(bad) + 1}: an index below 1")
    return nnz, tops, _meta_sizes(con, p)


def sizes(p: Path, con, given, meta, top: list[int]) -> tuple[int, ...]:
    """The mode sizes (given, the metadata's, or the largest indices), every index within them."""
    dims = tuple(int(s) for s in given) if given is not None else meta if meta is not None else tuple(top)
    if len(dims) != len(top):
        raise TensorFileError(f"{p}: {len(dims)} sizes for a tensor with {len(top)} modes")
    if any(s > MAX_SIZE for s in dims):
        raise TensorFileError(f"{p}: a mode size over {MAX_SIZE} is not supported")
    for m, (s, h) in enumerate(zip(dims, top)):
        if h > s:
            row = con.execute(f"SELECT min(r) FROM t WHERE i{m} >= {s}").fetchone()[0]
            raise TensorFileError(f"{p}: row {int(row) + 1}: index {h} in column {m + 1} is beyond size {s}")
    return dims


def read_parquet(path, *, sizes_: tuple[int, ...] | None = None, values: bool = True) -> SparseTensor:
    """The whole tensor of a dynmo Parquet file, in memory (as `tns.read_tns`)."""
    duckdb = duck.require()
    p = Path(path)
    with duckdb.connect() as con:
        nnz, top, meta = view(con, p)
        dims = sizes(p, con, sizes_, meta, top)
        order = len(top)
        values = values and "v" in [r[0] for r in con.execute("DESCRIBE t").fetchall()]
        got = con.execute(f"SELECT {', '.join(f'i{m}' for m in range(order))}{', v' if values else ''} FROM t "
                          "ORDER BY r").fetchnumpy()
    c = np.stack([got[f"i{m}"] for m in range(order)]).astype(np.int32 if max(dims) <= 2**31 else np.int64)
    v = None
    if values:
        v = np.asarray(got["v"], dtype=np.float64)
        if not np.isfinite(v).all():
            raise TensorFileError(f"{p}: row {int(np.argmin(np.isfinite(v))) + 1}: a value that is not a finite number")
    return SparseTensor(c, v, dims, str(path))
