"""A sublayer trace read as whole blocks: the same measured run, placed by blocks.

A run with `parallel.unit = "sublayer"` times each block's attention half and MLP half as
two units; summing them gives the costs of the same run's blocks, so one measured run can be
replayed with block units and with sublayer units and the two compared on equal costs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from dynmo.jsonio import is_number
from dynmo.sim.trace.costs import Trace
from dynmo.sim.trace.kinds import block_groups, unit_kinds


def merge_units(trace: Trace) -> Trace:
    """The whole-block trace of a trace of sublayer units (E, a m per block, L).

    Block i's forward, backward, weight-gradient, controller cost and state bytes per step are
    its attention half's plus its MLP half's, its parameters and migration bytes the halves'
    sums; E and L are kept. A traced layout is kept where every boundary falls between blocks,
    else dropped (a block cannot be split); so are the bytes crossing each cut (`boundary_bytes`):
    the cuts between a block's halves are dropped, the others kept. Case statistics merge by `merged_stat`. The names
    are block{i}, the kinds t, `source` is "merged" and `config.merged` records the units it
    came from. A trace of whole blocks is returned as it is; TraceError for any other kinds."""
    h = trace.header
    groups = block_groups(h.kinds, "merge_units")
    if len(groups) == 1:
        return trace
    attn, mlp = groups
    n = h.num_layers
    start = {0: 0, n - 1: len(attn) + 1, n: len(attn) + 2} | {u: i + 1 for i, u in enumerate(attn)}

    def merged(v: Sequence | None) -> list | None:
        return None if v is None else [v[0]] + [v[i] + v[j] for i, j in zip(attn, mlp)] + [v[-1]]

    def stats(d: dict[str, list]) -> dict[str, list]:
        return {k: [v[0]] + [merged_stat(v[i], v[j], h.params[i], h.params[j]) for i, j in zip(attn, mlp)] + [v[-1]]
                for k, v in d.items()}

    steps = [replace(s, fwd=merged(s.fwd), bwd=merged(s.bwd), wgrad=merged(s.wgrad), cost=merged(s.cost),
                     state_bytes=merged(s.state_bytes), stats=stats(s.stats),
                     layout=merged_layout(s.layout, start)) for s in trace.steps]
    config = dict(h.config)
    config["merged"] = {"from_units": n, "blocks": len(attn)}
    cuts = None if h.boundary_bytes is None else [h.boundary_bytes[0]] + [h.boundary_bytes[j] for j in mlp]
    header = replace(h, layers=[h.layers[0]] + [f"block{i}" for i in range(len(attn))] + [h.layers[-1]],
                     kinds=unit_kinds(len(attn)), params=merged(h.params), layer_bytes=merged(h.layer_bytes),
                     config=config, source="merged", boundary_bytes=cuts)
    return Trace(header, steps)


def merged_layout(layout: list[int] | None, start: dict[int, int]) -> list[int] | None:
    """A traced layout's boundaries in block positions (`start`: unit position -> block
    position, for the units a block-level stage can start at), or None when one falls
    between a block's halves."""
    if layout is None or any(u not in start for u in layout):
        return None
    return [start[u] for u in layout]


def merged_stat(attn: Any, mlp: Any, attn_params: int, mlp_params: int) -> Any:
    """A block's entry of a per-unit case statistic: the one half's value where only one half
    has it (routing counts live on the MLP half, hash attention's on the attention half), the
    parameter-weighted mean where the halves have different numbers (densities, fractions),
    else the pair [attn, mlp]."""
    if attn is None:
        return mlp
    if mlp is None or attn == mlp:
        return attn
    if is_number(attn) and is_number(mlp) and attn_params + mlp_params > 0:
        return (attn * attn_params + mlp * mlp_params) / (attn_params + mlp_params)
    return [attn, mlp]
