"""Per-rank compute op order of the pipeline schedules in `torch.distributed.pipelining`.

Pure Python (no torch). Each generator returns, for every pipeline rank, the ordered list of
compute ops that rank executes in one training step. Sends and receives are not listed:
the engine derives them from data dependencies (an F needs the previous stage's F of the
same microbatch, a B or I needs the next stage's B or I).

The orders are ports of torch 2.13's schedules (`ScheduleGPipe._step_microbatches`,
`Schedule1F1B._step_microbatches`, `_get_1f1b_rank_ops` for the interleaved and zero-bubble
schedules, `ScheduleZBVZeroBubble._calculate_single_rank_operations`, `ScheduleLoopedBFS`).
`tests/test_sim_schedules.py` runs torch's own schedule code with fake stages and fails if
the two drift apart.

Op kinds: F forward, B full backward (input and weight gradients together),
I backward for the input gradient only, W weight gradient (zero-bubble schedules).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, NamedTuple

from dynmo.schedules import SCHEDULES as ALL_SCHEDULES
from dynmo.schedules import ScheduleError, get_schedule, stage_to_rank


class Op(NamedTuple):
    kind: str  # "F", "B", "I" or "W"
    stage: int
    mb: int

    def __str__(self) -> str:  # torch prints actions as "{stage}{kind}{mb}", e.g. 3F1
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass(frozen=True)
class Plan:
    """A schedule instantiated for a shape: who runs what, in which order."""

    name: str
    num_ranks: int
    num_stages: int
    microbatches: int
    stage_rank: tuple[int, ...]  # rank of every stage
    rank_ops: tuple[tuple[Op, ...], ...]  # per rank, in execution order
    split_backward: bool  # True: backward is I + W ops, else one B op


# the simulator's schedules, by torch name
SCHEDULES = tuple(s.torch_name for s in ALL_SCHEDULES)


def canonical_name(name: str) -> str:
    """The torch name of a schedule (`1f1b` -> `1F1B`), the name plans carry."""
    return get_schedule(name).torch_name


def default_stages_per_rank(name: str) -> int:
    return get_schedule(name).default_stages_per_rank


def build_plan(name: str, num_ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Plan:
    """The op order of schedule `name` on `num_ranks` pipeline ranks.

    `stages_per_rank` (v) only matters for the multi-stage schedules (default 2; ZBV needs
    exactly 2); the pipeline then has `num_ranks * v` stages.
    """
    sched = get_schedule(name)
    name = sched.torch_name
    p, m = int(num_ranks), int(microbatches)
    if p < 1:
        raise ScheduleError(f"need at least 1 pipeline rank, got {p}")
    if m < 1:
        raise ScheduleError(f"need at least 1 microbatch, got {m}")
    v = sched.default_stages_per_rank if stages_per_rank is None else int(stages_per_rank)
    if not sched.multi_stage and v != 1:
        raise ScheduleError(f"{name} runs one stage per rank; got stages_per_rank={v}")
    if v < 1:
        raise ScheduleError(f"stages_per_rank must be >= 1, got {v}")
    if sched.fixed_stages_per_rank not in (None, v):
        raise ScheduleError(f"{name} needs exactly {sched.fixed_stages_per_rank} stages per rank (a V placement)")
    num_stages = p * v
    stage_rank = tuple(stage_to_rank(num_stages, p, sched.placement))

    gen = _GENERATORS[name]
    rank_ops = tuple(tuple(gen(r, p, v, m)) for r in range(p))
    plan = Plan(name, p, num_stages, m, stage_rank, rank_ops, sched.split_backward)
    _check_complete(plan)
    return plan


# ---- single-stage schedules -----------------------------------------------------------


def _gpipe(r: int, p: int, v: int, m: int) -> list[Op]:
    return [Op("F", r, i) for i in range(m)] + [Op("B", r, i) for i in range(m)]


def _one_f_one_b(r: int, p: int, v: int, m: int) -> list[Op]:
    # torch: "Last stage has 1 warmup, second-to-last 2 warmups, ..." -- the first stage
    # runs p forwards (not the textbook p-1) before its first backward.
    warmup = min(m, p - r)
    ops = [Op("F", r, i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        ops.append(Op("B", r, b))
        b += 1
        if f == m:
            break
        ops.append(Op("F", r, f))
        f += 1
    ops.extend(Op("B", r, i) for i in range(b, m))
    return ops


# ---- multi-stage schedules ------------------------------------------------------------


def _looped_bfs(r: int, p: int, v: int, m: int) -> list[Op]:
    stages = range(r, p * v, p)
    ops = [Op("F", s, i) for s in stages for i in range(m)]
    ops += [Op("B", s, i) for s in reversed(stages) for i in reversed(range(m))]
    return ops


def _rounds(name: str, p: int, m: int) -> int:
    rounds = max(1, m // p)
    if m % rounds != 0:
        raise ScheduleError(
            f"{name} needs the number of microbatches to be a multiple of the number of "
            f"rounds max(1, m // ranks) = {rounds}; got m={m} with {p} ranks "
            f"(try m={rounds * (m // rounds)} or {rounds * (m // rounds + 1)})"
        )
    return m // rounds


def _warmup_ops(r: int, v: int, per_round: int, p: int, m: int, factor: int) -> int:
    warmup_last = (v - 1) * per_round
    return min(warmup_last + factor * (p - 1 - r), m * v)


def _interleaved(r: int, p: int, v: int, m: int, zero_bubble: bool) -> list[Op]:
    name = "InterleavedZeroBubble" if zero_bubble else "Interleaved1F1B"
    per_round = _rounds(name, p, m)
    warmup = _warmup_ops(r, v, per_round, p, m, 1 if zero_bubble else 2)
    total_mb_ops = v * m
    fwd_bwd = total_mb_ops - warmup
    cooldown = total_mb_ops - fwd_bwd

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + r

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + r

    return _one_f_one_b_ranked(warmup, fwd_bwd, cooldown, fwd_stage, bwd_stage,
                               num_1f1b=r if zero_bubble else 0, zero_bubble=zero_bubble)


def _one_f_one_b_ranked(
    warmup: int,
    fwd_bwd: int,
    cooldown: int,
    fwd_stage: Callable[[int], int],
    bwd_stage: Callable[[int], int],
    num_1f1b: int,
    zero_bubble: bool,
) -> list[Op]:
    """Port of torch's `_get_1f1b_rank_ops` (compute ops only; the None padding is dropped)."""
    nf: dict[int, int] = defaultdict(int)
    nb: dict[int, int] = defaultdict(int)
    nw: dict[int, int] = defaultdict(int)
    ops: list[Op] = []
    bwd_steps: list[int] = []
    w_done = 0
    bkind = "I" if zero_bubble else "B"

    def take(counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    def weight() -> None:
        nonlocal w_done
        s = bwd_stage(bwd_steps[w_done])
        ops.append(Op("W", s, take(nw, s)))
        w_done += 1

    for step in range(warmup + fwd_bwd + cooldown):
        if step < warmup:
            s = fwd_stage(step)
            ops.append(Op("F", s, take(nf, s)))
            continue
        if step < warmup + fwd_bwd:
            s = fwd_stage(step)
            ops.append(Op("F", s, take(nf, s)))
        s = bwd_stage(step)
        ops.append(Op(bkind, s, take(nb, s)))
        bwd_steps.append(step)
        if zero_bubble and step - warmup >= num_1f1b:
            weight()
    while zero_bubble and w_done < len(bwd_steps):
        weight()
    return ops


def _zbv(r: int, p: int, v: int, m: int) -> list[Op]:
    """Port of `ScheduleZBVZeroBubble._calculate_single_rank_operations`."""
    n = max(2 * p - 1, m)  # torch plans at least 2p-1 microbatches, then drops the extra
    c0, c1 = r, 2 * p - 1 - r
    f0 = f1 = b0 = b1 = 0
    ops: list[Op] = []
    for _ in range(2 * (p - r) - 1):
        ops.append(Op("F", c0, f0)); f0 += 1
    for _ in range(r):
        ops.append(Op("F", c1, f1)); f1 += 1
        ops.append(Op("F", c0, f0)); f0 += 1
    for _ in range(p - r):
        ops.append(Op("F", c1, f1)); f1 += 1
        ops += [Op("I", c1, b1), Op("W", c1, b1)]; b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(Op("F", c0, f0)); f0 += 1
        ops += [Op("I", c0, b0), Op("W", c0, b0)]; b0 += 1
        ops.append(Op("F", c1, f1)); f1 += 1
        ops += [Op("I", c1, b1), Op("W", c1, b1)]; b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        ops.append(Op("I", c0, b0)); b0 += 1
        ops.append(Op("I", c1, b1)); b1 += 1
    for _ in range(p - r):
        ops.append(Op("I", c0, b0)); b0 += 1
        ops.append(Op("W", c0, w0)); w0 += 1
    while w1 < b1:
        ops.append(Op("W", c1, w1)); w1 += 1
    while w0 < b0:
        ops.append(Op("W", c0, w0)); w0 += 1
    return [op for op in ops if op.mb < m]


_GENERATORS: dict[str, Callable[[int, int, int, int], list[Op]]] = {
    "GPipe": _gpipe,
    "1F1B": _one_f_one_b,
    "LoopedBFS": _looped_bfs,
    "Interleaved1F1B": lambda r, p, v, m: _interleaved(r, p, v, m, zero_bubble=False),
    "InterleavedZeroBubble": lambda r, p, v, m: _interleaved(r, p, v, m, zero_bubble=True),
    "ZBVZeroBubble": _zbv,
}


def _check_complete(plan: Plan) -> None:
    """Every (stage, microbatch) runs F and its backward exactly once, on the stage's rank."""
    kinds = ("F", "I", "W") if plan.split_backward else ("F", "B")
    seen: set[Op] = set()
    for r, ops in enumerate(plan.rank_ops):
        for op in ops:
            if plan.stage_rank[op.stage] != r or op.kind not in kinds or op in seen:
                raise ScheduleError(f"{plan.name}: bad op {op} on rank {r}")
            seen.add(op)
    want = plan.num_stages * plan.microbatches * len(kinds)
    if len(seen) != want:
        raise ScheduleError(
            f"{plan.name} with {plan.num_ranks} ranks and {plan.microbatches} microbatches "
            f"produced {len(seen)} of {want} ops"
        )
