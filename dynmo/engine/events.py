"""Event-driven execution of a pipeline schedule from per-stage op times.

Pure (numpy only). The model, in one paragraph: every pipeline rank executes its compute
ops (`schedules.build_plan`) in order, one at a time. An op starts when its rank is free
and its input has arrived: F(s, k) needs the output of F(s-1, k); B or I(s, k) needs the
gradient from B or I(s+1, k) (on the last stage: its own F(s, k)); W(s, k) needs I(s, k).
A tensor crossing from one rank to another takes the link's transfer time (comm, plus any
injected `link_delay` on that link) after the producing op ends; each directed rank pair
carries one transfer at a time, in the sender's order (gloo uses one connection per pair).
Stages on the same rank hand over for free. Sends never block the sender. With data
parallelism (D identical replicas) each stage's gradient all-reduce starts after its last B
or W; by default it runs on a separate communication channel per rank (overlapping later
compute, one all-reduce at a time);
`allreduce_mode="blocking"` instead runs it inline where torch places REDUCE_GRAD. A sharded
optimizer's parameter all-gather (`StageTimes.allgather`) follows the optimizer step, which
waits for the whole model's gradient norm: every rank's starts when the last all-reduce and
the last compute op of any rank have ended, its stages' all-gathers back to back.

Identical replicas run identical timelines, so one replica is simulated and the
all-reduce cost is added: the cost does not depend on D beyond the all-reduce time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dynmo.engine.inputs import SimInputError, StageTimes, ring_allreduce_time
from dynmo.engine.schedules import Op, Plan, ScheduleError, build_plan, canonical_name, default_stages_per_rank

ALLREDUCE_MODES = ("overlap", "blocking")
P2P_MODES = ("eager", "rendezvous")


# ---- result -----------------------------------------------------------------------------


@dataclass
class SimResult:
    schedule: str
    num_stages: int
    pipeline_ranks: int
    stages_per_rank: int
    dp: int
    microbatches: int
    iteration_time: float  # end of the last compute op or all-reduce (or sharded optimizer's all-gather)
    compute_time: float  # end of the last compute op
    busy_s: list[float]  # per pipeline rank: time spent in compute ops
    idle_s: list[float]  # per pipeline rank: iteration_time - busy
    stage_busy_s: list[float]  # per stage: compute time of its ops
    allreduce_s: list[float]  # per stage: gradient all-reduce time (0 with dp=1)
    bubble_ratio: float
    bubble_inherent: float | None = None
    bubble_imbalance: float | None = None
    balanced_iteration_time: float | None = None
    trace: list[list[tuple[str, float, float]]] | None = field(default=None, repr=False)

    @property
    def workers(self) -> int:
        return self.pipeline_ranks * self.dp

    def as_dict(self) -> dict:
        d = {
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "pipeline_ranks": self.pipeline_ranks,
            "stages_per_rank": self.stages_per_rank,
            "dp": self.dp,
            "workers": self.workers,
            "microbatches": self.microbatches,
            "iteration_time": self.iteration_time,
            "compute_time": self.compute_time,
            "bubble_ratio": self.bubble_ratio,
            "bubble_inherent": self.bubble_inherent,
            "bubble_imbalance": self.bubble_imbalance,
            "balanced_iteration_time": self.balanced_iteration_time,
            "busy_s": self.busy_s,
            "idle_s": self.idle_s,
            "stage_busy_s": self.stage_busy_s,
            "allreduce_s": self.allreduce_s,
        }
        if self.trace is not None:
            d["trace"] = [[{"op": o, "start": a, "end": b} for o, a, b in ops] for ops in self.trace]
        return d


# ---- the engine -------------------------------------------------------------------------


def execute(
    plan: Plan,
    times: StageTimes,
    allreduce_mode: str = "overlap",
    keep_trace: bool = False,
    p2p: str = "eager",
) -> tuple[float, float, list[list[tuple[str, float, float]]] | None]:
    """Run `plan` with `times`; return (iteration_time, compute_time, trace or None).

    p2p="eager": a transfer starts when the producing op ends. p2p="rendezvous": it starts
    only once the receiving rank is also ready for it (has finished the op before the
    consumer), as a blocking handshake would; torch posts the receive of GPipe and 1F1B
    just before the consuming op, so on transports that need a posted receive the
    transfer cannot overlap the receiver's previous op.

    Event-driven over a fixed per-rank order: a rank advances until its next op waits for
    an input that has not been produced yet, and is woken when the producer finishes. Every
    op is handled once, so the cost is linear in the number of ops.
    """
    if p2p not in P2P_MODES:
        raise SimInputError(f"p2p must be one of {P2P_MODES}, got {p2p!r}")
    if allreduce_mode not in ALLREDUCE_MODES:
        raise SimInputError(f"allreduce_mode must be one of {ALLREDUCE_MODES}, got {allreduce_mode!r}")
    S, m = times.num_stages, times.microbatches
    if (S, m) != (plan.num_stages, plan.microbatches):
        raise SimInputError(
            f"times are for {S} stages x {m} microbatches but the schedule has "
            f"{plan.num_stages} stages x {plan.microbatches} microbatches"
        )
    p = plan.num_ranks
    owner = plan.stage_rank
    fwd = times.fwd.tolist()
    if plan.split_backward:
        wg = times.wgrad.tolist()
        bi = (times.bwd - times.wgrad).tolist()
    else:
        wg = None
        bi = times.bwd.tolist()
    cf, cb = times.comm_fwd.tolist(), times.comm_bwd.tolist()
    ar = times.allreduce.tolist()

    # Ready time of each op's input, indexed [kind][s*m + k]; None = not produced yet.
    # kind 0: input of F(s,k); 1: input of B/I(s,k); 2: input of W(s,k).
    n = S * m
    ready: list[list[float | None]] = [[None] * n, [None] * n, [None] * n]
    for k in range(m):
        ready[0][k] = 0.0  # stage 0 reads the batch
    waiting: list[list[int]] = [[-1] * n, [-1] * n, [-1] * n]
    rendezvous = p2p == "rendezvous"
    pending: list[list[tuple[int, float] | None]] = [[None] * n, [None] * n, [None] * n]
    link_free: dict[tuple[int, int], float] = {}

    rank_ops = [list(ops) for ops in plan.rank_ops]
    if allreduce_mode == "blocking" and any(a > 0 for a in ar):
        rank_ops = [_insert_reduce(ops, plan) for ops in rank_ops]
    grad_done = [0.0] * S  # end of each stage's last B or W
    ptr = [0] * p
    free = [0.0] * p
    trace: list[list[tuple[str, float, float]]] | None = [[] for _ in range(p)] if keep_trace else None
    kind_slot = {"F": 0, "B": 1, "I": 1, "W": 2, "R": -1}
    runnable = list(range(p))
    compute_end = 0.0

    def produce(slot: int, idx: int, t: float) -> None:
        ready[slot][idx] = t
        w = waiting[slot][idx]
        if w >= 0:
            waiting[slot][idx] = -1
            runnable.append(w)

    def transfer(src: int, dst: int, end: float, cost: float) -> float:
        start = max(end, link_free.get((src, dst), 0.0))
        link_free[(src, dst)] = start + cost
        return start + cost

    def send(slot: int, idx: int, src: int, dst: int, end: float, cost: float) -> None:
        if src == dst:
            produce(slot, idx, end)
        elif rendezvous:  # the receiver starts the transfer when it gets to the op
            pending[slot][idx] = (src, cost)
            produce(slot, idx, end)
        else:
            produce(slot, idx, transfer(src, dst, end, cost))

    while runnable:
        r = runnable.pop()
        ops = rank_ops[r]
        while ptr[r] < len(ops):
            kind, s, k = ops[ptr[r]]
            slot = kind_slot[kind]
            if slot < 0:  # blocking all-reduce of stage s
                start = free[r]
                end = start + ar[s]
            else:
                idx = s * m + k
                t_in = ready[slot][idx]
                if t_in is None:
                    waiting[slot][idx] = r
                    break
                if rendezvous and pending[slot][idx] is not None:
                    src, cost = pending[slot][idx]
                    t_in = transfer(src, r, t_in if t_in > free[r] else free[r], cost)
                start = t_in if t_in > free[r] else free[r]
                if kind == "F":
                    end = start + fwd[s][k]
                    if s + 1 < S:
                        send(0, idx + m, r, owner[s + 1], end, cf[s])
                    else:
                        produce(1, idx, end)  # loss: the last stage's backward may start
                elif kind == "W":
                    end = start + wg[s][k]
                    grad_done[s] = max(grad_done[s], end)
                else:  # B or I
                    end = start + bi[s][k]
                    if s > 0:
                        send(1, idx - m, r, owner[s - 1], end, cb[s - 1])
                    if kind == "I":
                        produce(2, idx, end)
                    else:
                        grad_done[s] = max(grad_done[s], end)
            free[r] = end
            if slot >= 0 and end > compute_end:
                compute_end = end
            if trace is not None:
                trace[r].append((f"{s}{kind}{'' if k < 0 else k}", start, end))
            ptr[r] += 1

    stuck = [r for r in range(p) if ptr[r] < len(rank_ops[r])]
    if stuck:
        detail = ", ".join(f"rank {r} at {rank_ops[r][ptr[r]]}" for r in stuck[:4])
        raise ScheduleError(f"{plan.name}: the schedule deadlocks ({detail})")

    iteration = max(free) if free else 0.0  # includes blocking all-reduces
    if allreduce_mode == "overlap":
        chan = [0.0] * p
        for s in sorted(range(S), key=lambda s: grad_done[s]):
            if ar[s] > 0:
                r = owner[s]
                chan[r] = max(chan[r], grad_done[s]) + ar[s]
                iteration = max(iteration, chan[r])
    if times.allgather is not None and np.any(times.allgather > 0):
        # the optimizer step waits for the whole model's gradient norm (an all-reduce over the
        # pipeline ranks once every gradient is reduced), then each rank all-gathers its stages'
        # parameters, one stage after the other
        per_rank = [0.0] * p
        for s, a in enumerate(times.allgather.tolist()):
            per_rank[owner[s]] += a
        iteration += max(per_rank)
    return iteration, compute_end, trace


def _insert_reduce(ops: list[Op], plan: Plan) -> list[Op]:
    """Place stage s's all-reduce right after its last B/W, as torch places REDUCE_GRAD."""
    grad = ("W",) if plan.split_backward else ("B",)
    count: dict[int, int] = {}
    out: list[Op] = []
    for op in ops:
        out.append(op)
        if op.kind in grad:
            count[op.stage] = count.get(op.stage, 0) + 1
            if count[op.stage] == plan.microbatches:
                out.append(Op("R", op.stage, -1))
    return out


# ---- public entry points ----------------------------------------------------------------


def simulate(
    fwd,
    bwd,
    schedule: str = "1F1B",
    microbatches: int | None = None,
    *,
    wgrad=None,
    comm=0.0,
    link_delay=None,
    stages_per_rank: int | None = None,
    dp: int = 1,
    allreduce=None,
    grad_bytes=None,
    bandwidth: float | None = None,
    latency: float = 0.0,
    allreduce_mode: str = "overlap",
    p2p: str = "eager",
    split_bubble: bool = True,
    keep_trace: bool = False,
) -> SimResult:
    """Simulate one training iteration of `schedule` and report time and bubbles.

    fwd, bwd (and wgrad): per stage (a number, or a list per microbatch), seconds. The
    pipeline has len(fwd) stages on len(fwd) / stages_per_rank ranks. comm: transfer time
    per link (see `StageTimes.build`); link_delay: extra seconds per transfer on each link
    between stage j and j+1 (a number or stages-1 of them). Gradient all-reduce
    across `dp` replicas: explicit per-stage seconds `allreduce`, or `grad_bytes` per stage
    with `bandwidth` (bytes/s) and `latency` for a ring all-reduce.
    """
    name = canonical_name(schedule)
    dp = int(dp)
    if dp < 1:
        raise SimInputError(f"dp (data-parallel replicas) must be >= 1, got {dp}")
    if allreduce is not None and grad_bytes is not None:
        raise SimInputError("give either allreduce (seconds) or grad_bytes + bandwidth, not both")
    ar = 0.0
    if allreduce is not None:
        ar = allreduce if dp > 1 else 0.0
    elif grad_bytes is not None:
        if bandwidth is None:
            raise SimInputError("grad_bytes needs bandwidth (bytes/s) for the ring all-reduce model")
        ar = ring_allreduce_time(grad_bytes, dp, bandwidth, latency)
    times = StageTimes.build(fwd, bwd, microbatches, wgrad=wgrad, comm=comm, allreduce=ar, link_delay=link_delay)

    v = default_stages_per_rank(name) if stages_per_rank is None else int(stages_per_rank)
    if times.num_stages % v != 0:
        raise SimInputError(
            f"{name} with {v} stages per rank needs a multiple of {v} stages; got {times.num_stages}"
        )
    plan = build_plan(name, times.num_stages // v, times.microbatches, stages_per_rank=v)
    return simulate_plan(plan, times, dp=dp, allreduce_mode=allreduce_mode, p2p=p2p,
                         split_bubble=split_bubble, keep_trace=keep_trace)


def simulate_plan(
    plan: Plan,
    times: StageTimes,
    *,
    dp: int = 1,
    allreduce_mode: str = "overlap",
    p2p: str = "eager",
    split_bubble: bool = True,
    keep_trace: bool = False,
) -> SimResult:
    """`simulate` for an already built plan and normalized times (for repeated runs)."""
    T, compute_T, trace = execute(plan, times, allreduce_mode, keep_trace, p2p)
    p = plan.num_ranks
    per_stage = times.fwd.sum(axis=1) + times.bwd.sum(axis=1)  # I + W = bwd when split
    busy = [0.0] * p
    for s, r in enumerate(plan.stage_rank):
        busy[r] += float(per_stage[s])
    idle = [max(0.0, T - b) for b in busy]  # max: float rounding only
    res = SimResult(
        schedule=plan.name,
        num_stages=plan.num_stages,
        pipeline_ranks=p,
        stages_per_rank=plan.num_stages // p,
        dp=dp,
        microbatches=plan.microbatches,
        iteration_time=T,
        compute_time=compute_T,
        busy_s=busy,
        idle_s=idle,
        stage_busy_s=[float(x) for x in per_stage],
        allreduce_s=[float(x) for x in times.allreduce],
        bubble_ratio=bubble_ratio(busy, T),
        trace=trace,
    )
    if split_bubble:
        Tb, _, _ = execute(plan, times.balanced(), allreduce_mode, False, p2p)
        res.balanced_iteration_time = Tb
        res.bubble_inherent = bubble_ratio(busy, Tb)  # same total work, balanced split
        res.bubble_imbalance = res.bubble_ratio - res.bubble_inherent
    return res


def bubble_ratio(busy: Sequence[float], iteration_time: float) -> float:
    """Idle time / (workers x iteration time); replicas share the same ratio."""
    if iteration_time <= 0 or not busy:
        return 0.0
    idle = sum(max(0.0, iteration_time - b) for b in busy)
    return float(idle / (len(busy) * iteration_time))


def predict_iteration_time(
    fwd: Sequence,
    bwd: Sequence,
    schedule: str,
    microbatches: int,
    *,
    wgrad: Sequence | None = None,
    comm=0.0,
    link_delay=None,
    stages_per_rank: int | None = None,
    p2p: str = "eager",
) -> float:
    """Predicted seconds per training step from measured per-stage times.

    For validating the simulator against real runs: pass the per-stage forward and
    backward time of one microbatch (lists indexed by stage; per-microbatch lists also
    work), the torch schedule name and the microbatch count; compare with the measured
    step time. Data parallel all-reduce is not included (dp=1). `p2p` picks the transfer
    model (see `execute`); with comm=0 both give the same answer.
    """
    return simulate(fwd, bwd, schedule, microbatches, wgrad=wgrad, comm=comm, link_delay=link_delay,
                    stages_per_rank=stages_per_rank, p2p=p2p, split_bubble=False).iteration_time


def lower_bound(times: StageTimes, plan: Plan) -> float:
    """A bound no schedule can beat: the busiest rank, and each microbatch's dependency chain."""
    S = times.num_stages
    rank_busy = np.zeros(plan.num_ranks)
    np.add.at(rank_busy, np.asarray(plan.stage_rank), times.fwd.sum(axis=1) + times.bwd.sum(axis=1))
    cross = np.array([plan.stage_rank[s] != plan.stage_rank[s + 1] for s in range(S - 1)], dtype=float)
    comm = float((times.comm_fwd * cross).sum() + (times.comm_bwd * cross).sum())
    # F on every stage, then the input-gradient pass back (W is off the chain when split).
    back = times.bwd - times.wgrad if plan.split_backward else times.bwd
    chain = times.fwd.sum(axis=0) + back.sum(axis=0) + comm
    return float(max(rank_busy.max(), chain.max()))
