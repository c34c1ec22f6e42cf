"""What a layout will take, known before it is built (from nnz, order and sizes only), to refuse
a format that would not fit `--memory-gb` before any work."""

from __future__ import annotations


def bytes_at_most(fmt: str, nnz: int, sizes: tuple[int, ...], itemsize: int = 8) -> int:
    """An upper bound of the layout's bytes (every level of a CSF tree counted as full)."""
    order = len(sizes)
    idx = 4 if max(sizes) < 2**31 else 8
    if fmt == "coo":
        return nnz * (order * idx + itemsize + order * 8) + 8 * (sum(sizes) + order)
    if fmt == "csf":
        per_tree = nnz * (order * idx + (order - 1) * 8 + itemsize) + 8 * order
        return order * per_tree
    if fmt == "hicoo":  # at most one block per nonzero
        return nnz * (order + itemsize + 8 + order * idx + order * 16) + 8 * (sum(sizes) + order)
    raise ValueError(f"format {fmt!r}")
