"""A sparse tensor in coordinate form: `coords` (order x nnz, 0-based) and `values`, as pydata
sparse's COO lays it out, plus the sizes of its modes.

Made from a FROSTT file (`dynmo.tensor.tns.read_tns`), from arrays (`from_coo`), from a pydata
`sparse.COO` or a `scipy.sparse` matrix (`as_tensor`, duck-typed: neither library is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Keys are int64; sizes up to 2**62 keep every mixed-radix key of two indices in range.
MAX_SIZE = 2**62


class TensorError(ValueError):
    """A tensor that cannot be taken as given; the message is one line and says why."""


@dataclass(frozen=True)
class SparseTensor:
    coords: np.ndarray  # (order, nnz) integers, 0-based, below their mode's size (int32 where they fit)
    values: np.ndarray | None  # (nnz,) float64; None when read for features only
    sizes: tuple[int, ...]
    name: str = ""

    @property
    def order(self) -> int:
        return len(self.sizes)

    @property
    def nnz(self) -> int:
        return int(self.coords.shape[1])

    @property
    def density(self) -> float:
        d = float(self.nnz)
        for s in self.sizes:  # one division per mode, as FeaTensor divides
            d /= s
        return d


def from_coo(coords, values=None, sizes=None, name: str = "", check_duplicates: bool = True) -> SparseTensor:
    """A SparseTensor from 0-based `coords` (order x nnz) and `values` (nnz).

    `sizes` defaults to one more than the largest index of each mode. TensorError when an
    index is negative or not below its size, when the shapes disagree, or (unless
    `check_duplicates` is False) when a coordinate appears twice."""
    c = np.asarray(coords)
    if c.ndim != 2 or c.shape[0] < 1:
        raise TensorError(f"coords must be an (order, nnz) array, got shape {c.shape}")
    if c.shape[1] == 0:
        raise TensorError("the tensor has no nonzeros")
    if not np.issubdtype(c.dtype, np.integer):
        if not np.all(np.isfinite(c)) or np.any(c != np.floor(c)):
            raise TensorError("coords must be integers")
    c = c.astype(np.int32 if c.size and int(c.max()) < 2**31 else np.int64, copy=False)
    lo = c.min(axis=1)
    if np.any(lo < 0):
        raise TensorError(f"mode {int(np.argmax(lo < 0))} has a negative index ({int(lo.min())}); coords are 0-based")
    hi = c.max(axis=1)
    if sizes is None:
        sizes = tuple(int(h) + 1 for h in hi)
    else:
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != c.shape[0]:
            raise TensorError(f"{len(sizes)} sizes for a tensor of order {c.shape[0]}")
        for m, (s, h) in enumerate(zip(sizes, hi)):
            if h >= s:
                raise TensorError(f"mode {m} has index {int(h)} but size {s}; sizes must exceed every index")
    if any(s > MAX_SIZE for s in sizes):
        raise TensorError(f"a mode size over {MAX_SIZE} is not supported")
    v = None
    if values is not None:
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        if v.size != c.shape[1]:
            raise TensorError(f"{v.size} values for {c.shape[1]} coordinates")
    t = SparseTensor(c, v, sizes, name)
    if check_duplicates:
        dup = first_duplicate(t)
        if dup is not None:
            raise TensorError(f"coordinate {tuple(int(x) for x in c[:, dup[0]])} appears twice "
                              f"(entries {dup[0]} and {dup[1]})")
    return t


def as_tensor(obj, name: str = "") -> SparseTensor:
    """A SparseTensor from a SparseTensor, a pydata `sparse.COO`, a `scipy.sparse` matrix or array
    (any format), or a dense numpy array (its nonzeros)."""
    if isinstance(obj, SparseTensor):
        return obj
    if hasattr(obj, "coords") and hasattr(obj, "data") and hasattr(obj, "shape"):  # pydata sparse.COO
        return from_coo(obj.coords, obj.data, obj.shape, name)
    if hasattr(obj, "tocoo") and hasattr(obj, "shape"):  # scipy.sparse
        m = obj.tocoo()
        m.sum_duplicates()
        return from_coo(np.vstack([m.row, m.col]), m.data, m.shape, name)
    a = np.asarray(obj)
    if a.ndim >= 1 and a.dtype != object:
        nz = np.nonzero(a)
        return from_coo(np.vstack(nz), a[nz], a.shape, name, check_duplicates=False)
    raise TensorError(f"cannot make a sparse tensor of {type(obj).__name__}")


def mixed_key(columns: list[np.ndarray], radices: list[int]) -> np.ndarray:
    """One int64 per nonzero that orders like the tuple of `columns` (mixed radix). Where the
    product of the radices would leave int64, the key so far is replaced by its dense rank
    among its distinct values (a sort), so any number of modes and any sizes fit."""
    key = columns[0].astype(np.int64, copy=True)
    space = radices[0]
    for col, r in zip(columns[1:], radices[1:]):
        if space * r >= MAX_SIZE:
            key, space = dense_rank(key)
        key *= r
        key += col
        space *= r
    return key


def dense_rank(key: np.ndarray) -> tuple[np.ndarray, int]:
    """(rank of each key among the distinct keys, number of distinct keys)."""
    s = np.sort(key)
    distinct = s[np.concatenate(([True], s[1:] != s[:-1]))]
    return np.searchsorted(distinct, key).astype(np.int64), int(distinct.size)


def first_duplicate(t: SparseTensor) -> tuple[int, int] | None:
    """The entries (positions in coords) of the first repeated coordinate, or None."""
    key = mixed_key(list(t.coords), list(t.sizes))
    s = np.sort(key)
    if not np.any(s[1:] == s[:-1]):  # the common case costs one sort
        return None
    return locate_duplicate(key)


def locate_duplicate(key: np.ndarray) -> tuple[int, int]:
    """The two entries of the repeated key met first when reading in order (there must be one)."""
    order = np.argsort(key, kind="stable")
    same = np.flatnonzero(key[order[1:]] == key[order[:-1]])
    pairs = np.stack([order[same], order[same + 1]])  # stable: the earlier entry first
    k = int(np.argmin(pairs[1]))
    return int(pairs[0, k]), int(pairs[1, k])
