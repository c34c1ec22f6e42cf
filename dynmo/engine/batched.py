"""The engine's iteration time for many sets of stage times at once (`Wavefronts`).

`dynmo.engine.events.execute` runs one set of times through a plan event by event. Which op
waits for which is fixed by the plan alone: an op follows the previous op of its rank, its
input comes from one producing op (plus the link's transfer time when the producer is on
another rank), and a link carries one transfer at a time in its sender's order. So the
iteration is a longest-path computation over a fixed graph, and it can be evaluated for K
candidate layouts (or K observed steps) together: the ops are grouped into wavefronts (ops
whose predecessors all lie in earlier ones) and each wavefront is a handful of numpy
operations on (K, ops) arrays.

Same model as `execute` with `p2p="eager"` and no gradient all-reduce, and the same numbers
(tests compare them on random plans and times). Times are one value per stage (every
microbatch alike), which is what the controller's step-time objective feeds it. Pure (numpy).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from dynmo.engine.schedules import Plan, ScheduleError

# per-op input columns of the (K, 5 x stages + 1) time table built in `iteration_times`
_FWD, _BACK, _WGRAD, _CF, _CB = range(5)


class Wavefronts:
    """A plan compiled to wavefronts (see the module docstring); `iteration_times` evaluates it."""

    def __init__(self, plan: Plan):
        self.plan = plan
        S, m = plan.num_stages, plan.microbatches
        owner = plan.stage_rank
        ops = [(r, i, op) for r, rops in enumerate(plan.rank_ops) for i, op in enumerate(rops)]
        n = len(ops)
        index = {(op.kind, op.stage, op.mb): j for j, (_, _, op) in enumerate(ops)}
        back = "I" if plan.split_backward else "B"
        none = n  # the sentinel column: time 0
        rank_prev = np.full(n, none)  # the previous op of the same rank
        prod = np.full(n, none)  # the op whose output is this op's input
        dur = np.zeros(n, dtype=np.int64)  # column of the op's duration in the time table
        cost = np.full(n, 5 * S)  # column of its input's transfer time (5 S: zero)
        sends: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # link -> (producer pos, consumer)
        for j, (r, i, op) in enumerate(ops):
            s, k = op.stage, op.mb
            if i:
                rank_prev[j] = j - 1
            if op.kind == "F":
                dur[j] = _FWD * S + s
                src = index[("F", s - 1, k)] if s else None
                link_cost = _CF * S + s - 1 if s else None
            elif op.kind == "W":
                dur[j] = _WGRAD * S + s
                src, link_cost = index[("I", s, k)], None
            else:
                dur[j] = _BACK * S + s
                src = index[("F", s, k)] if s == S - 1 else index[(back, s + 1, k)]
                link_cost = _CB * S + s if s < S - 1 else None
            if src is None:
                continue
            prod[j] = src
            src_rank = ops[src][0]
            if src_rank != r:
                cost[j] = link_cost
                sends[(src_rank, r)].append((ops[src][1], j))
        link_prev = np.full(n, none)  # the consumer of the transfer before this one on its link
        for transfers in sends.values():
            transfers.sort()
            for (_, a), (_, b) in zip(transfers, transfers[1:]):
                link_prev[b] = a
        # wavefronts over 2n nodes, the arrival of each op's input (j) and the op's end (n + j):
        # an arrival waits for its producer's end and the link's previous arrival; an end for
        # its arrival and its rank's previous end. Level = longest chain of predecessors.
        preds: list[list[int]] = [[n + int(prod[j])] if prod[j] != none else [] for j in range(n)]
        for j in range(n):
            if link_prev[j] != none:
                preds[j].append(int(link_prev[j]))
        preds += [[j] + ([n + int(rank_prev[j])] if rank_prev[j] != none else []) for j in range(n)]
        succ: list[list[int]] = [[] for _ in range(2 * n)]
        waiting = [len(p) for p in preds]
        for j, p in enumerate(preds):
            for x in p:
                succ[x].append(j)
        level = [0] * (2 * n)
        front = [j for j in range(2 * n) if not waiting[j]]
        seen = 0
        while front:
            nxt = []
            for j in front:
                seen += 1
                for x in succ[j]:
                    level[x] = max(level[x], level[j] + 1)
                    waiting[x] -= 1
                    if not waiting[x]:
                        nxt.append(x)
            front = nxt
        if seen < 2 * n:
            raise ScheduleError(f"{plan.name}: the schedule deadlocks")
        lv = np.asarray(level, dtype=np.int64)
        self.fronts = []
        for L in range(int(lv.max(initial=-1)) + 1):
            a = np.flatnonzero(lv[:n] == L)  # arrivals
            e = np.flatnonzero(lv[n:] == L)  # ends
            self.fronts.append((a, prod[a], link_prev[a], cost[a], e, rank_prev[e], dur[e]))
        self.ops = n

    def iteration_times(self, fwd, bwd, wgrad=None, comm_fwd=None, comm_bwd=None) -> np.ndarray:
        """Iteration seconds for each of K sets of times: `fwd`, `bwd`, `wgrad` of shape
        (K, stages) (one value per stage and microbatch; `wgrad` is the weight-gradient part of
        `bwd`, default half), `comm_fwd`, `comm_bwd` of shape (K, stages - 1) (default 0)."""
        fwd = np.atleast_2d(np.asarray(fwd, dtype=float))
        bwd = np.atleast_2d(np.asarray(bwd, dtype=float))
        K, S = fwd.shape
        if S != self.plan.num_stages or bwd.shape != (K, S):
            raise ValueError(f"times need shape (K, {self.plan.num_stages}); got {fwd.shape} and {bwd.shape}")
        w = 0.5 * bwd if wgrad is None else np.minimum(np.atleast_2d(np.asarray(wgrad, dtype=float)), bwd)
        back = bwd - w if self.plan.split_backward else bwd
        zero = np.zeros((K, max(S - 1, 0)))
        cf = zero if comm_fwd is None else np.atleast_2d(np.asarray(comm_fwd, dtype=float)).reshape(K, S - 1)
        cb = zero if comm_bwd is None else np.atleast_2d(np.asarray(comm_bwd, dtype=float)).reshape(K, S - 1)
        # columns: fwd | backward (B or I) | wgrad | comm_fwd (padded to S) | comm_bwd (padded) | 0
        pad = np.zeros((K, 1))
        table = np.concatenate([fwd, back, w, cf, pad, cb, pad, pad], axis=1).T.copy()  # (columns, K)
        end = np.zeros((self.ops + 1, K))  # end time of each op (last row: 0, the sentinel)
        arrival = np.zeros((self.ops + 1, K))  # when each op's input is there
        for a, prod, lprev, cost, e, rprev, dur in self.fronts:
            if len(a):
                arrival[a] = np.maximum(end[prod], arrival[lprev]) + table[cost]
            if len(e):
                end[e] = np.maximum(end[rprev], arrival[e]) + table[dur]
        return end[: self.ops].max(axis=0) if self.ops else np.zeros(K)
