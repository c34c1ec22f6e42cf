"""The exact bottleneck search shared by both paths of `Solver` (general and identical stages):
a bisection between achievable bounds, which stops on the optimum itself (optimal.py's module
docstring, "Search")."""

from __future__ import annotations


def bisect_bottleneck(lo: float, best: list[int], probe, probes: int, bottleneck_of, btol: float) -> tuple[float, list[int], int]:
    """Bisection between achievable bounds: `best` is a feasible layout,
    `lo` a lower bound; `probe(B)` -> (feasible, its layout, next event, event achievable).
    Returns (B*, a layout achieving it, probes made)."""
    hi = bottleneck_of(best)

    def improves(bnd: list[int]) -> bool:
        """Keep `bnd` if it beats the best so far."""
        nonlocal hi, best
        L = bottleneck_of(bnd)
        if L < hi:
            hi, best = L, bnd
            return True
        return False

    while hi - lo > btol:
        mid = lo + (hi - lo) / 2
        ok, bnd, ev, achievable = probe(mid)
        probes += 1
        if ok:
            if not improves(bnd):  # hi is already within tolerance of mid: nothing better exists
                break
        else:
            lo = max(ev, mid)
            if lo <= hi and achievable:  # a lower bound that is an achievable value: try it directly
                ok, bnd, ev2, _ = probe(lo)
                probes += 1
                if ok:
                    improves(bnd)
                    break
                lo = max(ev2, lo)
    return hi, best, probes

