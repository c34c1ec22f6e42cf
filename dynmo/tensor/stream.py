"""Generate a tensor larger than memory: `dynmo tensor generate ... --memory-gb G`.

The request is planned and its counts drawn as `generate.generate` draws them (nonzeros per
slice and per fiber, which slices and which fiber indices: arrays of the slices' and fibers'
size, not the nonzeros'), then the nonzeros are drawn and written fiber block by fiber block:
each block holds whole fibers and about `block_nnz` nonzeros (from the budget G), its last-mode
indices drawn per fiber without repetition and its values drawn, formatted as `.tns` lines and
appended. So the targets are met exactly as in memory (the counts are the same arrays), while
the memory holds one block. The blocks draw from the generator in another order than the
whole tensor does, so a seed gives another tensor than without --memory-gb (the same for any
G at or above what a block needs: the blocks are cut at fixed nonzero counts, BLOCK_NNZ).
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Callable

import numpy as np

from dynmo.tensor.generate import (GenerateError, Plan, Request, _values, counts_with_cv, distinct_per_group,
                                   plan)
from dynmo.tensor.tns import _lines

BLOCK_NNZ = 1 << 21  # nonzeros per block: ~2M, about 170 MB of arrays and text at 4 modes
BYTES_PER_NNZ = 90  # a block's peak bytes per nonzero (coordinates, values, their text, the draws)


def fixed_bytes(p: Plan, order: int) -> int:
    """Bytes held whatever the block: the per-slice and per-fiber arrays."""
    return 8 * (2 * p.slices + (order + 2) * p.fibers)


def generate_to(r: Request, path, memory_gb: float, header: bool = False,
                say: Callable[[str], None] | None = None) -> Plan:
    """Write the tensor of request `r` to `path` (.gz: gzip) block by block, within `memory_gb`
    (GenerateError if even the counts do not fit); written under a temporary name, renamed."""
    p = plan(r)
    sizes = tuple(int(s) for s in r.sizes)
    need = fixed_bytes(p, len(sizes)) + BLOCK_NNZ * BYTES_PER_NNZ
    if need > memory_gb * 2**30:
        raise GenerateError(f"--memory-gb {memory_gb}: the {p.fibers} fibers' counts and a block of nonzeros need "
                            f"{need / 2**30:.2f} GB; give more")
    say = say or (lambda msg: None)
    rng = np.random.default_rng(r.seed)
    fps = counts_with_cv(p.slices, p.fibers, sizes[-2], r.cv_fibers_per_slice, rng)
    npf = counts_with_cv(p.fibers, p.nnz, sizes[-1], r.cv_nnz_per_fiber, rng)
    slice_ids = np.sort(distinct_per_group(np.array([p.slices]), p.slices_all, rng))
    fiber_mode = distinct_per_group(fps, sizes[-2], rng)  # each fiber's index in mode M-2
    fiber_slice = np.repeat(slice_ids, fps)
    del fps, slice_ids
    ends = np.cumsum(npf)
    whole = r.values == "ones"
    widths = [len(str(s)) for s in sizes]
    vw = 2 if whole else 13
    opener = gzip.open if str(path).endswith(".gz") else open
    tmp = Path(f"{path}.tmp{os.getpid()}")
    try:
        with opener(tmp, "wb") as fh:
            if header:
                fh.write(f"{len(sizes)}\n{' '.join(map(str, sizes))}\n".encode())
            lo, done = 0, 0
            while lo < p.fibers:
                hi = int(np.searchsorted(ends, done + BLOCK_NNZ, side="right"))
                hi = max(hi, lo + 1)  # at least one fiber
                counts = npf[lo:hi]
                n = int(counts.sum())
                coords = np.empty((len(sizes), n), dtype=np.int64)
                head = np.unravel_index(fiber_slice[lo:hi], sizes[:-2])
                for m, c in enumerate(head):
                    coords[m] = np.repeat(c, counts)
                coords[-2] = np.repeat(fiber_mode[lo:hi], counts)
                coords[-1] = distinct_per_group(counts, sizes[-1], rng)
                fh.write(_lines(coords, _values(r.values, n, rng), widths, vw, whole))
                del coords
                done += n
                lo = hi
                say(f"generate: {done} of {p.nnz} nonzeros written")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return p
