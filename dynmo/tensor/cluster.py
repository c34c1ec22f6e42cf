"""The features of a tensor on several machines: `dynmo tensor features FILE --dask ADDRESS`.

Dask distributed schedules the work (`--dask local:N` starts a `LocalCluster` of N worker
processes here; any other value is a scheduler's address); every worker must see the input: a
`.tns` file, cut into byte ranges of whole lines, or a folder of `.tns` shards (their nonzeros
together are the tensor).

Two rounds of tasks, a map and a reduce by key (what a distributed GROUP BY does):

1. per piece of input: parse it with the single-machine reader's checks, and for each
   grouping the features need (every mode: repeated coordinates; every mode but 0: the fibers
   of mode 0; per pair (a, b), a > b, the modes but a, i.e. (rest, b): the fibers of mode a),
   count the piece's nonzeros per key; split those (key, count) rows into P parts by a hash of
   the key's `rest` columns (the slice), so a slice and all its fibers meet in one part;
2. per part: add up the counts of equal keys from every piece, then take the moments
   (`features.Moments`) of the fibers' counts, of their sums per slice and of their number per
   slice, and look for a coordinate counted twice.

The parts' moments add up to the whole's (integers), so every statistic equals the in-memory
path's. A lost worker's tasks are run again by Dask on another (the tasks are pure).
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from dynmo.tensor.coo import TensorError
from dynmo.tensor.features import Distribution, DuplicateError, Moments, TensorFeatures, assemble, count_product
from dynmo.tensor.tns import MAX_SIZE, TensorFileError, _first_bad_line, _open, _read_header

PIECE_BYTES = 1 << 26  # a task's share of a file: 64 MiB of text
PRIMES = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                   0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x27D4EB2F165667C5, 0x94D049BB133111EB], dtype=np.uint64)


class ClusterError(TensorError):
    """No Dask, or a cluster that cannot be reached or lost every worker."""


def _layout(p: Path, header: bool | None) -> tuple[int, int, tuple[int, ...] | None]:
    from dynmo.tensor.outofcore import tns_layout

    return tns_layout(p, header)


def pieces(path, header: bool | None) -> tuple[list[tuple[str, int, int, int, int]], tuple[int, ...] | None]:
    """The input as tasks' pieces (file, first byte, end byte, columns, lines to skip first) and
    the sizes a header gives (the first file's)."""
    p = Path(path)
    files = sorted(p.glob("*.tns")) if p.is_dir() else [p]
    if not files:
        raise TensorFileError(f"{path}: a folder with no .tns shards")
    out, head = [], None
    for k, f in enumerate(files):
        ncols, skip, sizes = _layout(f, header)
        head = head or sizes
        if out and ncols != out[0][3]:
            raise TensorFileError(f"{f}: {ncols - 1} modes where {files[0]} has {out[0][3] - 1}")
        size = f.stat().st_size
        stream, raw = _open(f)
        gz = stream is not raw
        raw.close()
        cuts = [0] if gz else list(range(0, size, PIECE_BYTES))  # a gzip file is one piece
        for i, lo in enumerate(cuts):
            hi = size if gz or i == len(cuts) - 1 else cuts[i + 1]
            out.append((str(f), lo, hi, ncols, skip if lo == 0 else 0))
    return out, head


def _text(file: str, lo: int, hi: int, skip: int) -> str:
    """The whole lines that start in [lo, hi) of the file (after `skip` lines at its start)."""
    stream, raw = _open(Path(file))
    with raw, stream:
        if stream is not raw:  # gzip: the whole file
            data = stream.read()
        else:
            raw.seek(max(0, lo - 1))
            if lo > 0 and raw.read(1) != b"\n":
                raw.readline()  # the line that started before lo is the previous piece's
            start = raw.tell()
            data = raw.read(max(0, hi - start))
            if data and not data.endswith(b"\n"):
                data += raw.readline()
    text = data.decode("latin-1")
    for _ in range(skip):
        text = text.split("\n", 1)[1] if "\n" in text else ""
    return text


def _groupings(order: int) -> list[tuple[str, list[int], int]]:
    """(name, key columns, how many leading columns the part hash reads) of each grouping."""
    out = [("all", list(range(order)), order), ("fiber0", list(range(1, order)), order - 1)]
    for a in range(1, order):
        for b in range(a):
            rest = [m for m in range(order) if m not in (a, b)]
            out.append((f"{a},{b}", rest + [b], len(rest)))
    return out


def _runs(keys: np.ndarray, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of keys [n, k] (sorted) and the sum of `counts` (default 1) over each."""
    if keys.shape[0] == 0:
        return keys, np.zeros(0, dtype=np.int64)
    order = np.lexsort(keys.T[::-1])
    keys = keys[order]
    new = np.concatenate(([True], np.any(keys[1:] != keys[:-1], axis=1)))
    starts = np.flatnonzero(new)
    c = np.ones(keys.shape[0], dtype=np.int64) if counts is None else counts[order].astype(np.int64)
    return keys[starts], np.add.reduceat(c, starts)


def _part_of(keys: np.ndarray, lead: int, parts: int) -> np.ndarray:
    h = np.zeros(keys.shape[0], dtype=np.uint64)
    for m in range(lead):
        h += keys[:, m].astype(np.uint64) * PRIMES[m % len(PRIMES)]
    h ^= h >> np.uint64(29)
    return (h % np.uint64(parts)).astype(np.int64)


def map_piece(piece: tuple[str, int, int, int, int], parts: int) -> dict:
    """Round 1: {"nnz", "top" (largest 1-based index per mode), grouping -> [per part (keys, counts)]}."""
    file, lo, hi, ncols, skip = piece
    order = ncols - 1
    row = np.dtype([("i", np.int64, (order,)), ("v", np.float64)])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            arr = np.loadtxt(io.StringIO(_text(file, lo, hi, skip)), dtype=row, comments="#", ndmin=1)
    except (ValueError, OverflowError) as e:
        raise _first_bad_line(Path(file), _layout(Path(file), None)[1], ncols, e) from None
    idx = arr["i"]
    out: dict = {"nnz": int(idx.shape[0]), "top": [0] * order}
    if idx.shape[0]:
        if idx.min() < 1 or not np.isfinite(arr["v"]).all():
            raise _first_bad_line(Path(file), _layout(Path(file), None)[1], ncols)
        out["top"] = [int(x) for x in idx.max(axis=0)]
    idx = (idx - 1).astype(np.int32 if int(idx.max(initial=0)) <= 2**31 else np.int64)  # half the bytes to move
    del arr
    for name, cols, lead in _groupings(order):
        keys, counts = _runs(idx[:, cols])
        counts = counts.astype(np.int32)
        where = _part_of(keys, lead, parts)
        out[name] = [(keys[where == p], counts[where == p]) for p in range(parts)]
    return out


def select_part(mapped: dict, part: int) -> dict:
    """One part of a piece's round-1 result (a task on the worker that holds the piece, so only
    the part travels to the part's reduce task)."""
    return {name: value[part] for name, value in mapped.items() if isinstance(value, list) and name != "top"}


def reduce_part(order: int, *selected: dict) -> dict:
    """Round 2 for one part, from each piece's share of it: grouping -> the moments its
    distributions get from this part (or a repeated coordinate)."""
    out: dict = {}
    for name, cols, lead in _groupings(order):
        keys = np.concatenate([m[name][0] for m in selected])
        counts = np.concatenate([m[name][1] for m in selected])
        keys, counts = _runs(keys, counts)
        if name == "all":
            out["duplicate"] = [int(x) + 1 for x in keys[np.argmax(counts)]] if counts.size and counts.max() > 1 \
                else None
            continue
        out[name] = {"fibers": counts}
        if name != "fiber0" and lead == 0:  # a matrix: one slice, all of it
            one = np.array([counts.sum()] if counts.size else [], dtype=np.int64)
            out[name] = {"fibers": counts, "slices": one, "fps": np.array([counts.size] if counts.size else [])}
        elif name != "fiber0":
            slices, per_slice = _runs(keys[:, :lead], counts)
            _, fibers_per_slice = _runs(keys[:, :lead])
            out[name] = {"fibers": counts, "slices": per_slice, "fps": fibers_per_slice}
        out[name] = {k: Moments.of(v) if v.size else None for k, v in out[name].items()}
    return out


def _add(a: Moments | None, b: Moments | None) -> Moments | None:
    return b if a is None else a if b is None else a + b


def client_for(address: str):
    """A Dask client: `local:N` starts a LocalCluster of N worker processes (closed with it)."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise ClusterError("--dask needs Dask distributed: pip install distributed (or pip install "
                           "'dynmo[tensor]')") from None
    if address.startswith("local:"):
        try:
            n = int(address.split(":", 1)[1])
        except ValueError:
            n = 0
        if n < 1:
            raise ClusterError(f"--dask {address}: give local:N with N >= 1 worker processes")
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None)
        return Client(cluster), cluster
    try:
        return Client(address, timeout="20s"), None
    except (OSError, TimeoutError) as e:
        raise ClusterError(f"--dask {address}: cannot reach the scheduler ({e})") from None


def features_on_dask(path, address: str, *, sizes=None, header: bool | None = None, parts: int = 0,
                     progress: Callable[[str], None] | None = None) -> TensorFeatures:
    """`features.features` of a .tns file or folder of shards, computed on Dask (see the module)."""
    say = progress or (lambda msg: None)
    todo, head = pieces(path, header)
    order = todo[0][3] - 1
    client, cluster = client_for(address)
    try:
        parts = parts or max(1, 2 * len(client.scheduler_info()["workers"]))
        say(f"features on Dask: {len(todo)} pieces, {parts} parts, "
            f"{len(client.scheduler_info()['workers'])} workers")
        mapped = client.map(map_piece, todo, parts=parts, pure=False)
        reduced = [client.submit(reduce_part, order, *[client.submit(select_part, f, p, pure=False) for f in mapped],
                                 pure=False) for p in range(parts)]
        heads = client.gather([client.submit(lambda m: (m["nnz"], m["top"]), f, pure=False) for f in mapped])
        results = client.gather(reduced)
    except (TensorFileError, TensorError):
        raise
    except Exception as e:  # the cluster's own failures: lost workers, a task that kept failing
        raise ClusterError(f"--dask {address}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") \
            from None
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    nnz = sum(n for n, _ in heads)
    if nnz == 0:
        raise TensorFileError(f"{path}: no nonzeros")
    top = [max(t[m] for _, t in heads) for m in range(order)]
    dims = tuple(int(s) for s in sizes) if sizes is not None else head if head is not None else tuple(top)
    if len(dims) != order:
        raise TensorFileError(f"{path}: {len(dims)} sizes for a tensor with {order} modes")
    for m, (s, h) in enumerate(zip(dims, top)):
        if h > s or s > MAX_SIZE:
            raise TensorFileError(f"{path}: index {h} in column {m + 1} is beyond size {s}")
    dup = next((r["duplicate"] for r in results if r["duplicate"]), None)
    if dup:
        raise DuplicateError(f"coordinate {tuple(dup)} (1-based) appears twice", None)  # lines unknown here
    total = {name: {} for name, _, _ in _groupings(order)[1:]}
    for r in results:
        for name in total:
            for k, mom in r[name].items():
                total[name][k] = _add(total[name].get(k), mom)
    fibers = {0: Distribution("nnz_per_fiber", (0,), count_product(dims[1:]), None, moments=total["fiber0"]["fibers"])}
    slices, fps = [], []
    for a in range(1, order):
        for b in range(a):
            rest = [m for m in range(order) if m not in (a, b)]
            slice_all, t = count_product(dims[m] for m in rest), total[f"{a},{b}"]
            if a not in fibers:
                fibers[a] = Distribution("nnz_per_fiber", (a,), slice_all * dims[b], None, moments=t["fibers"])
            slices.append(Distribution("nnz_per_slice", (b, a), slice_all, None, moments=t["slices"]))
            fps.append(Distribution("fibers_per_slice", (b, a), slice_all, None, fiber_mode=a, moments=t["fps"]))
    return assemble(str(path), dims, nnz, slices, [fibers[m] for m in range(order)], fps)
