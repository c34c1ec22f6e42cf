"""Diffusion balancers: the paper's Algorithm 3 and a contiguity-preserving variant.

`diffusion` (paper, Algorithm 3). Starting from the current assignment, each round computes
the stage loads, their mean and variance; every overloaded stage (load > mean) offers its
lightest layer to the currently least-loaded stage. The transfer is accepted if the load
variance falls and the receiver's memory stays within its capacity. Rounds repeat until no
transfer is accepted or `max_iters` rounds ran. It moves single layers to arbitrary stages,
so it BREAKS CONTIGUITY: the result is an assignment (layer -> stage), not a layout, and a
pipeline would have to send activations back and forth between stages to run it. It is here
as the paper's baseline. Two details the paper leaves open: a stage never gives away its
last layer (every stage stays non-empty), and the least-loaded stage is re-read after every
accepted transfer. Cost per round O(p log n).

`diffusion-contiguous` (ours). The same variance-descent idea restricted to moves that keep
the layout contiguous: only the first or last layer of a stage may move, and only to the
neighbouring stage. Each round sweeps the p-1 boundaries and shifts a boundary by one layer
when that lowers the variance and the receiver's memory fits. A local search: it stops in
local minima and is not optimal in general.

Both read the loads of the problem's load model; with cut factors (`Problem.cut_factor`) a
stage's link time follows its cuts, as `Problem.loads_of_assignment` charges them.
"""

from __future__ import annotations

import heapq

import numpy as np

from .problem import EPS, Problem


def diffusion(problem: Problem, max_iters: int = 1000) -> list[int]:
    """Paper Algorithm 3. Returns the stage of every layer (possibly non-contiguous)."""
    p = problem.stages
    c, m, s, t, cap = problem.c, problem.m, problem.s, problem.t, problem.cap
    owner = np.repeat(np.arange(p), np.diff(problem.current_layout.boundaries))
    sums = np.bincount(owner, weights=c, minlength=p).astype(float)
    mem = np.bincount(owner, weights=m, minlength=p).astype(float)
    count = np.bincount(owner, minlength=p)
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(p)]
    for i, j in enumerate(owner.tolist()):
        heaps[j].append((float(c[i]), i))
    for h in heaps:
        heapq.heapify(h)
    mslack = EPS * max(float(m.sum()), 1.0)
    loads = sums / s + t if problem.r is None else np.asarray(problem.loads_of_assignment(owner))
    for _ in range(max_iters):
        var = float(loads.var())
        avg = float(loads.mean())
        overloaded = [j for j in range(p) if loads[j] > avg]
        accepted = 0
        for src in overloaded:
            if count[src] <= 1:
                continue
            dst = int(np.argmin(loads))
            if dst == src:
                continue
            ci, i = heaps[src][0]
            if mem[dst] + m[i] > cap[dst] + mslack:
                continue
            if problem.r is None:
                new = loads.copy()
                new[src] = (sums[src] - ci) / s[src] + t[src]
                new[dst] = (sums[dst] + ci) / s[dst] + t[dst]
            else:  # the layer may have been the first of src or become the first of dst: cuts move
                moved = owner.copy()
                moved[i] = dst
                new = np.asarray(problem.loads_of_assignment(moved))
            new_var = float(new.var())
            if new_var < var:
                heapq.heappop(heaps[src])
                heapq.heappush(heaps[dst], (ci, i))
                sums[src] -= ci
                sums[dst] += ci
                mem[src] -= m[i]
                mem[dst] += m[i]
                count[src] -= 1
                count[dst] += 1
                owner[i] = dst
                loads, var = new, new_var
                accepted += 1
        if not accepted:
            break
    return owner.tolist()


def diffusion_contiguous(problem: Problem, max_iters: int = 1000) -> list[int]:
    """Shift boundary layers between neighbouring stages while the variance falls."""
    p = problem.stages
    c, m, s, t, cap = problem.c, problem.m, problem.s, problem.t, problem.cap
    b = list(problem.current_layout.boundaries)
    P = np.concatenate(([0.0], np.cumsum(c))).tolist()
    Mm = np.concatenate(([0.0], np.cumsum(m))).tolist()
    mslack = EPS * max(Mm[-1], 1.0)
    sl, tl, capl = s.tolist(), t.tolist(), cap.tolist()
    if problem.r is not None:
        rl = problem.r.tolist()
        fl = problem.tf.tolist() + [0.0]  # stage j's activation send
        gl = [0.0] + problem.tb.tolist()  # stage j's gradient send

        def load(j: int, a: int, e: int) -> float:
            return (P[e] - P[a]) / sl[j] + (fl[j] * rl[e] + gl[j] * rl[a])
    else:
        def load(j: int, a: int, e: int) -> float:
            return (P[e] - P[a]) / sl[j] + tl[j]

    loads = [load(j, b[j], b[j + 1]) for j in range(p)]
    tot = sum(loads)
    sq = sum(x * x for x in loads)
    for _ in range(max_iters):
        moved = 0
        for j in range(p - 1):  # boundary between stage j and j+1 sits at b[j+1]
            k = b[j + 1]
            var = sq / p - (tot / p) ** 2
            best = None
            # j gives its last layer (k-1) to j+1, or j+1 gives its first layer (k) to j
            if k - 1 > b[j] and Mm[b[j + 2]] - Mm[k - 1] <= capl[j + 1] + mslack:
                best = (k - 1,)
            if k + 1 < b[j + 2] and Mm[k + 1] - Mm[b[j]] <= capl[j] + mslack:
                best = best + (k + 1,) if best else (k + 1,)
            if not best:
                continue
            choice, choice_var = None, var
            for nk in best:
                lj, lk = load(j, b[j], nk), load(j + 1, nk, b[j + 2])
                nt = tot - loads[j] - loads[j + 1] + lj + lk
                nsq = sq - loads[j] ** 2 - loads[j + 1] ** 2 + lj * lj + lk * lk
                nv = nsq / p - (nt / p) ** 2
                if nv < choice_var - 1e-15 * abs(choice_var):
                    choice, choice_var = (nk, lj, lk, nt, nsq), nv
            if choice is not None:
                nk, lj, lk, tot, sq = choice
                b[j + 1] = nk
                loads[j], loads[j + 1] = lj, lk
                moved += 1
        if not moved:
            break
    return b
