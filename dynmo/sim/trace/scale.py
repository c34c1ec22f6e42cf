"""Scaling a trace to a paper-sized model: more blocks, the same dynamics over time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dynmo.jsonio import is_int, is_number
from dynmo.sim.trace import limits
from dynmo.sim.trace.costs import Trace
from dynmo.sim.trace.kinds import BLOCK, SUBLAYER, block_groups, unit_kinds, unit_names
from dynmo.sim.trace.limits import TraceError, check_size
from dynmo.sim.trace.values import finite, show


def block_map(src_blocks: int, blocks: int) -> np.ndarray:
    """Source block of each of `blocks` new blocks: the one at the same relative depth."""
    return (np.arange(blocks) * src_blocks) // blocks


def scale_trace(trace: Trace, blocks: int, *, cost_scale: float = 1.0, params_scale: float = 1.0,
                noise: float = 0.0, seed: int = 0) -> Trace:
    """The trace of a model with `blocks` transformer blocks and the same dynamics over time.

    Method: new block j takes the per-step cost series of source block floor(j * b / blocks)
    (b = traced blocks), i.e. the block at the same relative depth, so a skewed, pruned,
    frozen or expert-routed region keeps its relative position and its changes keep their
    steps. Each step's block costs are then rescaled so that the mean block cost equals the
    traced mean (x cost_scale): the block total per step is exactly (blocks / b) x traced
    total x cost_scale. E and L keep their measured costs (x cost_scale). `noise` > 0
    multiplies every new block's cost at every step by an independent lognormal factor
    (sigma = noise, mean 1, seeded) before the rescaling, so copies of one source block do
    not move in lockstep (real MoE blocks route independently). Parameters and migration
    bytes follow the same block map (x params_scale). Layouts of the traced run are dropped
    (they were for another depth); events are kept, so dynamism steps stay where they were.
    The bytes crossing each cut (`boundary_bytes`, when traced) follow the map too: the cut
    after a new unit ships what the cut after its source unit did (after E, E's), so a cut
    between a new block's halves carries what one between the traced halves did.

    A trace of sublayer units (E, a m per block, L) scales the same way with the attention
    halves and the MLP halves as two separate series of b: each keeps its own mean per step,
    so the attention/MLP split of the traced run is kept. New block j's two halves both come
    from source block floor(j * b / blocks) and share its noise factor (the same draws as
    whole blocks get), so the result is E, a m per new block, L with names block{j}_attn,
    block{j}_mlp.
    """
    h = trace.header
    if not is_int(blocks) or blocks < 1:
        raise TraceError(f"blocks must be an integer >= 1, got {show(blocks)}")
    groups = block_groups(h.kinds, "scale_trace")
    unit = BLOCK if len(groups) == 1 else SUBLAYER
    units = len(groups) * blocks + 2
    if units > limits.MAX_LAYERS:
        what = f"{blocks} blocks + 2 layers" if unit == BLOCK else f"{blocks} blocks ({units} units)"
        raise TraceError(f"{what} is over the limit MAX_LAYERS = {limits.MAX_LAYERS}")
    check_size(len(trace.steps), units, f"the trace scaled to {blocks} blocks")
    for name, v, hi in (("cost_scale", cost_scale, None), ("params_scale", params_scale, None),
                        ("noise", noise, limits.MAX_NOISE)):
        if not is_number(v) or not finite(v) or v < 0 or (name != "noise" and v == 0) or (hi and v > hi):
            rng = f"from 0 to {hi}" if hi else "> 0"
            raise TraceError(f"{name} must be a finite number {rng}, got {show(v)}")
    if max(max(h.params), max(h.layer_bytes)) * params_scale > limits.MAX_COUNT:
        raise TraceError(f"params_scale = {params_scale:g} makes a layer's parameters or bytes exceed 2^53; "
                         "use a smaller params_scale")
    b = len(groups[0])
    srcs = [np.asarray(g)[block_map(b, blocks)] for g in groups]
    src = np.stack(srcs, axis=1).ravel()  # source unit of each new unit, in model order
    rng = np.random.default_rng(seed)
    steps = []
    for s in trace.steps:
        f, bw = np.asarray(s.fwd, dtype=float), np.asarray(s.bwd, dtype=float)
        w = None if s.wgrad is None else np.asarray(s.wgrad, dtype=float)
        cst = None if s.cost is None else np.asarray(s.cost, dtype=float)
        factor = np.ones(blocks)
        if noise > 0:
            factor = rng.lognormal(-0.5 * noise * noise, noise, size=blocks)
        new = []
        for a in (f, bw, w, cst):
            if a is None:
                new.append(None)
                continue
            nb = np.stack([rescaled(a, g, sg, factor, blocks, b) for g, sg in zip(groups, srcs)], axis=1).ravel()
            new.append(np.concatenate(([a[0]], nb, [a[-1]])) * cost_scale)
        if new[2] is not None:
            new[2] = np.minimum(new[2], new[1])
        sb = None
        if s.state_bytes is not None:
            sb = [s.state_bytes[0]] + [s.state_bytes[i] * params_scale for i in src] + [s.state_bytes[-1]]
        stats = {}
        for k, v in s.stats.items():
            stats[k] = [v[0]] + [v[i] for i in src] + [v[-1]]
        steps.append(replace(s, fwd=new[0].tolist(), bwd=new[1].tolist(),
                             wgrad=None if new[2] is None else new[2].tolist(), layout=None, stats=stats,
                             state_bytes=sb, cost=None if new[3] is None else new[3].tolist()))
    params = [h.params[0]] + [int(round(h.params[i] * params_scale)) for i in src] + [h.params[-1]]
    lbytes = [h.layer_bytes[0]] + [int(round(h.layer_bytes[i] * params_scale)) for i in src] + [h.layer_bytes[-1]]
    config = dict(h.config)
    config["scaled"] = {"from_blocks": b, "blocks": blocks, "cost_scale": cost_scale,
                        "params_scale": params_scale, "noise": noise, "seed": seed}
    cuts = None if h.boundary_bytes is None else [h.boundary_bytes[0]] + [h.boundary_bytes[i] for i in src]
    header = replace(h, layers=unit_names(blocks, unit), kinds=unit_kinds(blocks, unit), params=params,
                     layer_bytes=lbytes, config=config, source="scaled", boundary_bytes=cuts)
    return Trace(header, steps)


def rescaled(a: np.ndarray, group: list[int], src: np.ndarray, factor: np.ndarray, blocks: int, b: int) -> np.ndarray:
    """One step's new costs of one series of units (whole blocks, or the attention or the MLP
    halves): the source units' costs x `factor`, rescaled so that their sum is the traced
    series' sum x blocks / b; an all-zero series stays zero."""
    nb = a[src] * factor
    want = a[group].sum() * blocks / b
    have = nb.sum()
    return nb * (want / have) if have > 0 else nb
