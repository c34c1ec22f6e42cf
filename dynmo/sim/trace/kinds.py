"""What a trace's layers are: the traced pipeline's placement units.

With `parallel.unit = "block"` (the default) the units are the embedding (E), whole
transformer blocks (t) and the head (L); with `"sublayer"` each block is two units, its
attention half (a: norm, attention, residual add) then its MLP half (m: norm, MLP or MoE,
residual add). A trace holds one kind of unit, so each half has its pair next to it.
"""

from __future__ import annotations

from typing import Sequence

from dynmo.sim.trace.limits import TraceError

BLOCK, SUBLAYER = "block", "sublayer"
UNITS = (BLOCK, SUBLAYER)
PER_BLOCK = {BLOCK: 1, SUBLAYER: 2}  # units per transformer block
PARTS = {"a": "attn", "m": "mlp"}  # half-block letter -> the suffix of its name


def unit_of(kinds: Sequence[str], where: str = "trace header") -> str | None:
    """BLOCK when the trace's blocks are whole (t), SUBLAYER when they are halves (a, m),
    None when it has no blocks; TraceError when it mixes the two or a half lacks its pair,
    since no pipeline places such units."""
    halves = [i for i, k in enumerate(kinds) if k in PARTS]
    if not halves:
        return BLOCK if "t" in kinds else None
    if "t" in kinds:
        raise TraceError(f"{where}: kinds mix whole blocks (t) with half blocks (a, m); "
                         "a trace holds one kind of unit")
    n = len(kinds)
    for i in halves:
        if kinds[i] == "a" and (i + 1 == n or kinds[i + 1] != "m"):
            raise TraceError(f"{where}: kinds[{i}] is an attention half (a) not followed by its MLP half (m)")
        if kinds[i] == "m" and (i == 0 or kinds[i - 1] != "a"):
            raise TraceError(f"{where}: kinds[{i}] is an MLP half (m) without its attention half (a) before it")
    return SUBLAYER


def block_groups(kinds: Sequence[str], where: str) -> list[list[int]]:
    """Positions of the blocks' units, one list per part: [t...] for whole blocks, [a...], [m...]
    for halves. TraceError unless the trace is E, its blocks' units, L (what scaling and merging
    need: the embedding and the head are kept as they are)."""
    unit = unit_of(kinds, where)
    letters = ("t",) if unit == BLOCK else tuple(PARTS)
    groups = [[i for i, k in enumerate(kinds) if k == letter] for letter in letters]
    if unit is None or kinds[0] != "E" or kinds[-1] != "L" or sum(map(len, groups)) != len(kinds) - 2:
        raise TraceError(f"{where} needs a trace of E, t..., L layers (or E, a m..., L units)")
    return groups


def unit_names(blocks: int, unit: str = BLOCK) -> list[str]:
    """Layer names of a model of `blocks` blocks: embed, block0 (or block0_attn, block0_mlp), ..., head."""
    if unit == SUBLAYER:
        return ["embed"] + [f"block{j}_{p}" for j in range(blocks) for p in PARTS.values()] + ["head"]
    return ["embed"] + [f"block{j}" for j in range(blocks)] + ["head"]


def unit_kinds(blocks: int, unit: str = BLOCK) -> list[str]:
    """Kinds of a model of `blocks` blocks: E, t... (or a, m, a, m...), L."""
    return ["E"] + (list(PARTS) * blocks if unit == SUBLAYER else ["t"] * blocks) + ["L"]
