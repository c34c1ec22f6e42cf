"""FROSTT `.tns` files in: one nonzero a line, 1-based indices, the value last, `#` comments.

Also read: the variant that starts with an order line and a sizes line (FeaTensor's input;
`header=True`, or detected: a first line with a single number cannot be a nonzero), and gzip
(by its magic bytes, whatever the name). Lines are parsed by numpy's C reader (`np.loadtxt`),
indices as integers and the value as a float, then checked.

Bad input ends in `TensorFileError` whose one-line message names the file and the line: a line
with another number of columns, an index that is not a whole number or is below 1, a value that
is not a finite number, a file with no nonzeros, an index beyond the sizes given. Repeated
coordinates are found where the features sort them (`dynmo.tensor.features.DuplicateError`);
`line_numbers` turns their positions into lines.
"""

from __future__ import annotations

import gzip
import io
import os
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dynmo.tensor.coo import MAX_SIZE, SparseTensor



class TensorFileError(ValueError):
    """A file that cannot be read as a tensor; the message is one line naming the file and line."""


def _open(path: Path):
    """(binary stream, the file under it) of a plain or gzip file."""
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    return raw, raw


def _whole(tok: str) -> int | None:
    try:
        x = int(tok)
    except ValueError:
        return None
    return x if abs(x) < 2**63 else None


def _check_line(path: str, line: int, tokens: list[str], ncols: int) -> None:
    """Raise the error of one line, if it has one."""
    where = f"{path}:{line}"
    if len(tokens) == 1:
        raise TensorFileError(f"{where}: a line with one number: a nonzero needs its indices and a value "
                              "(if the file starts with an order line and a sizes line, pass --header)")
    if ncols and len(tokens) != ncols:
        raise TensorFileError(f"{where}: {len(tokens)} numbers where the lines before have {ncols} "
                              f"({ncols - 1} indices and a value)")
    for col, tok in enumerate(tokens[:-1], 1):
        i = _whole(tok)
        if i is None:
            raise TensorFileError(f"{where}: index {tok!r} in column {col} is not a whole number")
        if i < 1:
            raise TensorFileError(f"{where}: index {i} in column {col} is below 1 (.tns indices are 1-based)")
    try:
        v = float(tokens[-1])
    except ValueError:
        raise TensorFileError(f"{where}: value {tokens[-1]!r} is not a number") from None
    if not np.isfinite(v):
        raise TensorFileError(f"{where}: value {tokens[-1]!r} is not a finite number")


def _read_header(path: str, text: str, forced: bool | None) -> tuple[int, tuple[int, ...] | None, int]:
    """(order or 0, sizes or None, characters of `text` the header takes) from the first lines."""
    pos, line, found = 0, 1, []
    while len(found) < 2 and pos < len(text):
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end
        tokens = text[pos:end].split("#", 1)[0].split()
        if tokens:
            found.append((line, tokens, end + 1))
            if len(found) == 1 and not forced and len(tokens) != 1:
                return 0, None, 0  # a nonzero: no header
        pos, line = end + 1, line + 1
    if not found:
        return 0, None, 0
    first_line, tokens, _ = found[0]
    if forced is False:
        return 0, None, 0
    order = _whole(tokens[0]) if len(tokens) == 1 else None
    if (order is None or order < 1) and not forced:
        _check_line(path, first_line, tokens, 0)  # a line with one number, not an order
    if order is None or order < 1:
        raise TensorFileError(f"{path}:{first_line}: --header: expected the order (one whole number), "
                              f"found {' '.join(tokens)!r}")
    if len(found) < 2:
        raise TensorFileError(f"{path}: the order line is not followed by a sizes line")
    line2, tokens2, used = found[1]
    sizes = [_whole(t) for t in tokens2]
    if len(sizes) != order or any(s is None or s < 1 for s in sizes):
        raise TensorFileError(f"{path}:{line2}: expected {order} sizes (whole numbers >= 1) after the order "
                              f"line, found {' '.join(tokens2)!r}")
    return order, tuple(sizes), used


def layout(p: Path, header: bool | None) -> tuple[int, int, tuple[int, ...] | None, bool]:
    """(numbers a line holds, 0 for none found; the lines before the first nonzero: the header
    and comments; the header's sizes or None; whether it is gzip) of a .tns file."""
    name = str(p)
    if not p.exists():
        raise TensorFileError(f"{name}: no such file")
    if p.is_dir():
        raise TensorFileError(f"{name}: is a folder; give a .tns file")
    stream, raw = _open(p)
    with raw, stream:
        try:
            first = stream.read(1 << 16).decode("latin-1")
        except (OSError, EOFError) as e:
            raise TensorFileError(f"{name}: cannot be read ({e})") from None
    order, head_sizes, used = _read_header(name, first, header)
    skip = first.count("\n", 0, used)  # the lines the header, and any comments before it, take
    ncols = order + 1 if order else next((len(ln.split("#", 1)[0].split()) for ln in first[used:].split("\n")
                                          if ln.split("#", 1)[0].split()), 0)
    return ncols, skip, head_sizes, stream is not raw


def read_tns(path, *, sizes=None, header: bool | None = None, values: bool = True) -> SparseTensor:
    """Read a `.tns` file (plain or gzip). `sizes` overrides the header's and the largest indices;
    `values=False` checks the values but keeps none (features need only the coordinates)."""
    p = Path(path)
    name = str(path)
    ncols, skip, head_sizes, gz = layout(p, header)
    if ncols == 1:        raise _first_bad_line(p, skip, 0)
    # Indices parse as integers and the value as a float in one pass (a structured dtype; faster
    # than floats throughout). A path takes numpy's fast reader (it opens .gz by name); a gzip
    # file under another name is read through a line iterator, ~1.5x slower.
    by_name = not gz or name.endswith(".gz")
    arr = None
    for width in (np.int32, np.int64):  # int32 first: half the memory; a larger index reads again
        row = np.dtype([("i", width, (max(1, ncols - 1),)), ("v", np.float64)])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "input contained no data": said below
                src = name if by_name else io.TextIOWrapper(gzip.open(p), encoding="latin-1")
                arr = np.loadtxt(src, dtype=row, comments="#", ndmin=1, skiprows=skip, encoding="latin-1")
            break
        except (ValueError, EOFError, OSError, OverflowError) as e:
            if width is np.int64:
                raise _first_bad_line(p, skip, ncols, e) from None
    if arr.size == 0:
        raise TensorFileError(f"{name}: no nonzeros (the file is empty, or holds only comments"
                              f"{' and its header' if head_sizes else ''})")
    idx = arr["i"]
    top = int(idx.max())
    if idx.min() < 1 or not np.isfinite(arr["v"]).all():
        raise _first_bad_line(p, skip, ncols)
    c = idx.T.astype(np.int32 if top <= 2**31 else np.int64)  # int32 where every index fits
    c -= 1
    v = arr["v"].copy() if values else None
    del arr, idx
    hi = c.max(axis=1)
    if sizes is not None:
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != c.shape[0]:
            raise TensorFileError(f"{name}: {len(sizes)} sizes given for a tensor with {c.shape[0]} modes")
        what = "--sizes"
    elif head_sizes is not None:
        sizes, what = head_sizes, "its sizes line"
    else:
        sizes, what = tuple(int(h) + 1 for h in hi), ""
    if any(s > MAX_SIZE for s in sizes):
        raise TensorFileError(f"{name}: a mode size over {MAX_SIZE} is not supported")
    for m, (s, h) in enumerate(zip(sizes, hi)):
        if h >= s:
            row = int(np.argmax(c[m] >= s))
            line = line_numbers(p, [row], header=header)[0]
            raise TensorFileError(f"{name}:{line}: index {int(c[m, row]) + 1} in column {m + 1} is beyond size {s} "
                                  f"({what} says mode {m + 1} has {s})")
    return SparseTensor(c, v, sizes, name)


def _first_bad_line(p: Path, skip: int, ncols: int, cause: Exception | None = None) -> TensorFileError:
    """The error of the file's first bad line: a second pass in Python, only when numpy's reader
    or the checks after it found something wrong."""
    stream, raw = _open(p)
    with raw, stream:
        try:
            for k, line in enumerate(io.TextIOWrapper(stream, encoding="latin-1"), 1):
                if k <= skip:
                    continue
                tokens = line.split("#", 1)[0].split()
                if tokens:
                    _check_line(str(p), k, tokens, ncols)
                    ncols = ncols or len(tokens)
        except (OSError, EOFError) as e:
            return TensorFileError(f"{p}: cannot be read ({e})")
        except TensorFileError as e:
            return e
    why = " ".join(str(cause).split()) if cause else "unknown"
    return TensorFileError(f"{p}: could not be read as a tensor ({why})")


def line_numbers(path, rows: list[int], header: bool | None = None) -> list[int]:
    """The 1-based line numbers of data rows `rows` (0-based, in file order; `header` as read_tns
    takes it): a second pass over the file, only when an error must name a line."""
    p = Path(path)
    stream, raw = _open(p)
    with raw, stream:
        order = _read_header(str(path), stream.read(1 << 16).decode("latin-1"), header)[0]
    want = {r: 0 for r in rows}
    row, skip = 0, 2 if order else 0
    stream, raw = _open(p)
    with raw, stream:
        for k, line in enumerate(io.TextIOWrapper(stream, encoding="latin-1", newline="\n"), 1):
            if not line.split("#", 1)[0].split():
                continue
            if skip:
                skip -= 1
                continue
            if row in want:
                want[row] = k
                if all(want.values()):
                    break
            row += 1
    return [want[r] for r in rows]


def write_tns(t: SparseTensor, path, header: bool = False) -> None:
    """Write `t` as a .tns file (gzip when the name ends in .gz), written whole under a temporary
    name and then renamed. Columns are right-aligned to a fixed width (any whitespace separates
    FROSTT columns), so every line is built at once by numpy: 1-based indices, then the value,
    exactly when every value is a whole number (counts, ones), else with 7 significant digits
    (`-1.234567e-05`). A tensor with no values is written with 1s. `header`: the order line and
    the sizes line first."""
    vals = t.values if t.values is not None else np.ones(t.nnz)
    whole = bool(np.all(np.isfinite(vals))) and bool(np.all(vals == np.round(vals))) and \
        float(np.abs(vals).max(initial=0)) < 1e15
    widths = [len(str(int(s))) for s in t.sizes]
    vw = (len(str(int(np.abs(vals).max(initial=1)))) + 1) if whole else 13
    opener = gzip.open if str(path).endswith(".gz") else open
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with opener(tmp, "wb") as fh:
            if header:
                fh.write(f"{t.order}\n{' '.join(map(str, t.sizes))}\n".encode())
            # numpy's loops release the GIL: two threads format the next blocks (4 at most in
            # flight, so memory stays a few blocks) while one is written
            step = 1 << 19
            with ThreadPoolExecutor(max_workers=2) as pool:
                pending: deque = deque()
                for lo in range(0, t.nnz, step):
                    pending.append(pool.submit(_lines, t.coords[:, lo:lo + step], vals[lo:lo + step], widths, vw,
                                               whole))
                    if len(pending) >= 4:
                        fh.write(pending.popleft().result())
                while pending:
                    fh.write(pending.popleft().result())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _digits(buf: np.ndarray, end: int, a: np.ndarray, width: int) -> None:
    """Write the integers a >= 0 right-aligned in rows [end - width, end) of buf (one row per
    character position, one column per line: each write is contiguous), spaces before."""
    q = a.astype(np.int32 if width <= 9 else np.int64)
    for k in range(width):
        d = q % 10
        buf[end - 1 - k] = 48 + d if k == 0 else np.where(q > 0, 48 + d, 32)
        q //= 10


def _lines(coords: np.ndarray, vals: np.ndarray, widths: list[int], vw: int, whole: bool) -> bytes:
    n = coords.shape[1]
    line = sum(widths) + len(widths) + vw + 1  # a space after each index, the value, the newline
    buf = np.full((line, n), 32, dtype=np.uint8)  # transposed: built position by position
    pos = 0
    for m, w in enumerate(widths):
        _digits(buf, pos + w, coords[m] + 1, w)
        pos += w + 1
    if whole:
        v = vals.astype(np.int64)
        _digits(buf, pos + vw, np.abs(v), vw - 1)
        ndig = np.maximum(1, np.floor(np.log10(np.maximum(np.abs(v), 1))).astype(np.int64) + 1)
        neg = np.flatnonzero(v < 0)
        buf[pos + vw - 1 - ndig[neg], neg] = ord("-")
    else:  # [sign]d.dddddde[+-]XX: 13 characters
        a = np.abs(vals)
        e = np.where(a > 0, np.floor(np.log10(np.where(a > 0, a, 1.0))), 0).astype(np.int64)
        mant = np.round(a / 10.0 ** e * 1e6).astype(np.int64)
        carry = mant >= 10_000_000  # 9.9999996 rounds up to 10.000000
        mant = np.where(carry, mant // 10, mant)
        e = e + carry
        ea = np.abs(e)
        if (ea >= 100).any():
            raise ValueError("a value beyond 1e99 or below 1e-99 cannot be written in 13 characters")
        buf[pos] = np.where(vals < 0, ord("-"), 32)
        buf[pos + 1] = 48 + mant // 1_000_000
        buf[pos + 2] = ord(".")
        m6 = (mant % 1_000_000).astype(np.int32)
        for k in range(6):  # all six decimals, zeros included
            buf[pos + 8 - k] = 48 + m6 % 10
            m6 //= 10
        buf[pos + 9] = ord("e")
        buf[pos + 10] = np.where(e < 0, ord("-"), ord("+"))
        buf[pos + 11] = 48 + ea // 10
        buf[pos + 12] = 48 + ea % 10
    buf[-1] = 10
    return buf.T.tobytes()
