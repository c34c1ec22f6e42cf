"""Index relabelings of a sparse tensor: each mode's indices renumbered so that nonzeros that
share indices sit near each other (better cache reuse in MTTKRP), or at random (a baseline).

    new, perms = reorder(t, "lexi")     # perms[m][new_index] = old_index (0-based)

- `random`: a random permutation of every mode (seeded).
- `degree`: every mode's indices by their nonzeros, most first.
- `bfs-mcs`: breadth-first search over the tensor's hypergraph (a vertex per index of every
  mode, a hyperedge per nonzero), from the vertex with the most nonzeros; each newly reached set
  is numbered by how many nonzeros of the frontier reach it (the cardinality of maximum
  cardinality search), then by degree. Every mode is numbered in the order its vertices are met.
- `lexi`: Lexi-Order: two sweeps over the modes; in a sweep, mode m's slices are sorted
  lexicographically by the sorted list of their nonzeros' positions in the other modes (as
  numbered so far). The lists are compared on their first 8 entries (ParTI compares whole rows).

The reordered tensor has the same features (a relabeling moves no nonzero between slices or
fibers), and CP of it, started from the relabeled initial factors, gives the relabeled factors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dynmo.tensor.coo import SparseTensor, dense_rank, mixed_key

METHODS = ("lexi", "bfs-mcs", "degree", "random")
LEXI_PREFIX = 8
LEXI_SWEEPS = 2


def reorder(t: SparseTensor, method: str, seed: int = 0) -> tuple[SparseTensor, list[np.ndarray]]:
    """(the relabeled tensor, per mode the old index of each new one)."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}: give one of {', '.join(METHODS)}")
    if method == "random":
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(s) for s in t.sizes]
    elif method == "degree":
        perms = [np.argsort(-np.bincount(c, minlength=s), kind="stable") for c, s in zip(t.coords, t.sizes)]
    elif method == "bfs-mcs":
        perms = _bfs_mcs(t)
    else:
        perms = _lexi(t)
    return relabel(t, perms), perms


def relabel(t: SparseTensor, perms: list[np.ndarray]) -> SparseTensor:
    """`t` with mode m's index old renamed new, where perms[m][new] = old."""
    coords = np.empty_like(t.coords)
    for m, p in enumerate(perms):
        inv = np.empty(p.size, dtype=np.int64)
        inv[p] = np.arange(p.size)
        coords[m] = inv[t.coords[m]]
    return SparseTensor(coords, t.values, t.sizes, t.name)


def _inverse(p: np.ndarray) -> np.ndarray:
    inv = np.empty(p.size, dtype=np.int64)
    inv[p] = np.arange(p.size)
    return inv


def _lexi(t: SparseTensor) -> list[np.ndarray]:
    labels = [np.arange(s) for s in t.sizes]  # labels[m][old] = new
    for _ in range(LEXI_SWEEPS):
        for m in range(t.order):
            others = [k for k in range(t.order) if k != m]
            key = mixed_key([labels[k][t.coords[k]] for k in others], [t.sizes[k] for k in others])
            key, _ = dense_rank(key)
            idx = t.coords[m]
            sort = np.lexsort((key, idx))
            s_idx, s_key = idx[sort], key[sort]
            first = np.searchsorted(s_idx, np.arange(t.sizes[m]))
            count = np.bincount(idx, minlength=t.sizes[m])
            cols = []
            for q in range(LEXI_PREFIX):
                has = count > q
                col = np.full(t.sizes[m], -1, dtype=np.int64)  # a shorter list sorts before its extensions
                col[has] = s_key[first[has] + q]
                cols.append(col)
            empty = (count == 0).astype(np.int64)  # empty slices last
            perm = np.lexsort((*reversed(cols), empty))
            labels[m] = _inverse(perm)
    return [np.argsort(lab) for lab in labels]


def _bfs_mcs(t: SparseTensor) -> list[np.ndarray]:
    order, nnz = t.order, t.nnz
    offs = np.concatenate(([0], np.cumsum(t.sizes))).astype(np.int64)
    verts = (t.coords.astype(np.int64) + offs[:-1, None])  # order x nnz vertex ids
    total = int(offs[-1])
    flat = verts.ravel()
    owner = np.tile(np.arange(nnz, dtype=np.int64), order)
    srt = np.argsort(flat, kind="stable")
    inc_nz = owner[srt]  # the nonzeros of each vertex, vertex by vertex
    ptr = np.zeros(total + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(np.bincount(flat, minlength=total))
    degree = np.diff(ptr)
    seen_v = degree == 0  # vertices with no nonzero are numbered last, in index order
    seen_nz = np.zeros(nnz, dtype=bool)
    visit = []
    by_degree = np.argsort(-degree, kind="stable")
    cursor = 0
    frontier = np.zeros(0, dtype=np.int64)
    while True:
        if frontier.size == 0:
            while cursor < total and seen_v[by_degree[cursor]]:
                cursor += 1
            if cursor == total:
                break
            frontier = by_degree[cursor:cursor + 1]
            seen_v[frontier] = True
            visit.append(frontier)
        lens = ptr[frontier + 1] - ptr[frontier]
        pos = np.repeat(ptr[frontier] - np.cumsum(np.concatenate(([0], lens[:-1]))), lens) + np.arange(lens.sum())
        nzs = inc_nz[pos]
        nzs = nzs[~seen_nz[nzs]]
        nzs = np.unique(nzs)
        seen_nz[nzs] = True
        reached = verts[:, nzs].ravel()
        reached = reached[~seen_v[reached]]
        if reached.size == 0:
            frontier = np.zeros(0, dtype=np.int64)
            continue
        new, hits = np.unique(reached, return_counts=True)
        new = new[np.lexsort((-degree[new], -hits))]
        seen_v[new] = True
        visit.append(new)
        frontier = new
    met = np.concatenate(visit) if visit else np.zeros(0, dtype=np.int64)
    rank = np.full(total, total, dtype=np.int64)
    rank[met] = np.arange(met.size)
    perms = []
    for m in range(order):
        r = rank[offs[m]:offs[m + 1]]
        perms.append(np.lexsort((np.arange(r.size), r)))
    return perms


def perm_paths(out) -> list[Path]:
    """Where the permutations of a reordered tensor written to `out` go, one file per mode."""
    out = Path(out)
    stem = out.name[:-3] if out.name.endswith(".gz") else out.name
    stem = stem[:-4] if stem.endswith(".tns") else stem
    return [out.with_name(f"{stem}.mode{m}.perm") for m in range(64)]


def write_perms(perms: list[np.ndarray], out) -> list[Path]:
    """One text file per mode beside `out`: line k holds the old (1-based) index of new index k."""
    paths = perm_paths(out)[:len(perms)]
    for p, path in zip(perms, paths):
        tmp = path.with_name(path.name + ".tmp")
        np.savetxt(tmp, p + 1, fmt="%d")
        tmp.replace(path)
    return paths


def read_perms(out, order: int) -> list[np.ndarray]:
    """The permutations `write_perms` wrote beside `out` (0-based: perms[m][new] = old)."""
    return [np.loadtxt(path, dtype=np.int64, ndmin=1) - 1 for path in perm_paths(out)[:order]]
