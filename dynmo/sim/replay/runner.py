"""Simulating one traced step on a layout: stage times from the trace, one iteration of the schedule."""

from __future__ import annotations

import numpy as np

from dynmo.balance import cut_factors
from dynmo.engine import Plan, SimInputError, StageTimes, build_plan, ring_allgather_time, ring_allreduce_time, simulate_plan
from dynmo.layout import Layout
from dynmo.loop import BYTES_PER_PARAM, bytes_per_param
from dynmo.sim.replay.options import GRAD_BYTES_PER_PARAM, PARAM_BYTES_PER_PARAM, ReplayOptions, schedule_of
from dynmo.sim.replay.result import PolicyResult
from dynmo.sim.trace import Trace


class Runner:
    """Builds plans once per shape and simulates one step for a layout."""

    def __init__(self, trace: Trace, dp: int, opts: ReplayOptions, stages: int):
        h = trace.header
        self.opts, self.dp = opts, dp
        self.schedule, self.v = schedule_of(trace, opts)
        if opts.shard == "full" and "ZeroBubble" in self.schedule:
            # as the runtime: the separate weight-gradient pass would run after FSDP reduced the gradients
            raise SimInputError(f"shard = \"full\" does not work with the zero-bubble schedules ({self.schedule}), "
                                "as in the runtime; replay another schedule (e.g. 1F1B or Interleaved1F1B)")
        self.delay = None  # injected delay per link (stage j <-> j+1), on the replay's stages
        if opts.link_delay is not None:
            self.delay = np.asarray(opts.link_delay, dtype=float)
            if self.delay.shape != (max(stages - 1, 0),):
                raise SimInputError(f"link_delay needs one value per link between the {stages} stages: "
                                    f"{stages - 1} values, got {self.delay.size}")
        # per cut after layer i: its bytes over the smallest cut's (a cut between a block's halves
        # ships the block's carry too), from the trace; None: every cut costs its link the same
        self.cut_factor = cut_factors(h.boundary_bytes)
        self._r = None
        if self.cut_factor is not None and any(f != 1.0 for f in self.cut_factor):
            self._r = np.concatenate(([1.0], self.cut_factor, [1.0]))
        self.m = int(opts.microbatches or h.microbatches)
        self.fwd, self.bwd, self.wgrad = trace.fwd(), trace.bwd(), trace.wgrad()
        self.costs = self.fwd + self.bwd
        self.observed = trace.controller_costs()  # what the runtime's controller sees
        # sequences per replica per step, for re-tuning: M microbatches of the traced size
        seq = int(h.config.get("model", {}).get("seq_len") or 0)
        per_mb = h.tokens_per_microbatch // seq if h.tokens_per_microbatch and seq else 1
        self.local_batch = per_mb * self.m
        self.params = np.asarray(h.params, dtype=float)
        self.steps_state_bytes = [s.state_bytes for s in trace.steps]
        self.plans: dict[tuple[int, int], Plan] = {}
        # What a migrating layer ships, per worker, with the replay's sharding over its dp replicas.
        # The header's layer_bytes is the unsharded prior (BYTES_PER_PARAM a parameter); a step's
        # measured state_bytes were held under the traced run's sharding at its dp: both are scaled by
        # the bytes a parameter takes here over what it took there (1 = as traced, bit for bit).
        bpp = bytes_per_param(opts.shard, dp)
        self.prior_bytes = list(h.layer_bytes) if bpp == BYTES_PER_PARAM else \
            [int(bpp * b / BYTES_PER_PARAM) for b in h.layer_bytes]
        self.measured_scale = bpp / bytes_per_param(traced_shard(trace), h.dp)

    def layer_bytes(self, k: int) -> list:
        """What each layer ships if it migrates before step k: the step's measured state bytes
        when the trace has them, else the prior, both for the replay's sharding."""
        measured = self.steps_state_bytes[k]
        if measured is None:
            return self.prior_bytes
        return list(measured) if self.measured_scale == 1 else [x * self.measured_scale for x in measured]

    def fsdp_collective_s(self, starts) -> np.ndarray | float:
        """Per stage (first layers `starts`), the seconds of one FSDP collective over its units with
        `shard = "full"`: every unit (trace layer) is its own FSDP root, so its own all-gather of its
        fp32 weights, (D-1)/D x 4 B a parameter / bandwidth + latency, summed over the stage's units.
        A ring reduce-scatter of the gradients moves the same bytes and costs the same. 0 without
        --allreduce-bandwidth or with one replica."""
        if self.opts.shard != "full" or not self.opts.allreduce_bandwidth or self.dp <= 1:
            return 0.0
        per_unit = ring_allgather_time(self.params * PARAM_BYTES_PER_PARAM, self.dp, self.opts.allreduce_bandwidth,
                                       self.opts.allreduce_latency)
        return np.add.reduceat(per_unit, np.asarray(starts))

    def link_times(self, stages: int) -> list[float] | None:
        """Per link j (stage j <-> j+1) of the first `stages` positions: the seconds per
        microbatch and direction, as the runtime's probe measures them -- comm + delay_j,
        charged by the load model to stage j for the activation and to stage j+1 for its
        gradient; 0 where both stages share a rank (the engine hands over for free there).
        None with `balance.links = "free"` or when every link is free. They price a cut between
        blocks; a cut that ships more costs `cut_factor` times as much (`Problem.cut_factor`)."""
        if self.opts.balance.links == "free" or stages < 2:
            return None
        t = np.full(stages - 1, float(self.opts.comm))
        if self.delay is not None:
            t = t + self.delay[: stages - 1]
        rank = self.plan(stages).stage_rank
        t = np.where([rank[j] != rank[j + 1] for j in range(stages - 1)], t, 0.0)
        return t.tolist() if np.any(t > 0) else None

    def plan(self, stages: int, m: int | None = None) -> Plan:
        m = m or self.m
        if (stages, m) not in self.plans:
            if stages % self.v:
                raise SimInputError(f"{self.schedule} with {self.v} stages per rank needs a multiple of {self.v} stages, got {stages}")
            self.plans[(stages, m)] = build_plan(self.schedule, stages // self.v, m, stages_per_rank=self.v)
        return self.plans[(stages, m)]

    def simulate(self, k: int, layout: Layout, m: int | None = None):
        """(the engine's result, the stage loads, the plan) of step k on `layout` with m
        microbatches (default M; the local batch is kept, so a microbatch is M / m times the
        traced size and costs that much more)."""
        m = m or self.m
        scale = self.m / m
        b = np.asarray(layout.boundaries[:-1])
        f = np.add.reduceat(self.fwd[k], b) * scale
        bw = np.add.reduceat(self.bwd[k], b) * scale
        w = None if self.wgrad is None else np.add.reduceat(self.wgrad[k], b) * scale
        ar, ag, fsdp = 0.0, None, 0.0
        if self.opts.allreduce_bandwidth and self.dp > 1:
            if self.opts.shard == "full":  # FSDP reduce-scatters the gradients instead: no all-reduce
                fsdp = self.fsdp_collective_s(b)
            else:
                grad_bytes = np.add.reduceat(self.params, b) * GRAD_BYTES_PER_PARAM
                ar = ring_allreduce_time(grad_bytes, self.dp, self.opts.allreduce_bandwidth,
                                         self.opts.allreduce_latency)
            if self.opts.shard == "optimizer":  # every replica gets the others' updated rows
                ag = ring_allgather_time(np.add.reduceat(self.params, b) * PARAM_BYTES_PER_PARAM, self.dp,
                                         self.opts.allreduce_bandwidth, self.opts.allreduce_latency)
        loads = ((f + bw) / scale).tolist()  # per traced-size microbatch, comparable across policies
        o = self.opts.op_overhead
        # with shard = "full", per microbatch: the units' weights all-gathered before the forward, and
        # again before the backward, whose gradients are then reduce-scattered, each inside its op (no
        # overlap with compute); the weights do not grow with a re-tuned microbatch's size
        f, bw = f + o + fsdp, bw + o + 2 * fsdp
        if self.delay is not None and layout.num_stages > 1:
            # an injected delay is a wait in the sender (as the runtime injects it), once per
            # transfer: it does not grow with a re-tuned microbatch's size
            d = self.delay[: layout.num_stages - 1]
            f[:-1] += d
            bw[1:] += d
        comm = self.opts.comm * scale
        if self._r is not None and layout.num_stages > 1 and comm:
            comm = comm * self._r[b[1:]]  # each link's transfer x the bytes of the cut on it (b[1:]: the cuts)
        times = StageTimes.build(f, bw, m, wgrad=w, comm=comm, allreduce=ar, allgather=ag)
        plan = self.plan(layout.num_stages, m)
        sim = simulate_plan(plan, times, dp=self.dp, p2p=self.opts.p2p, split_bubble=False)
        return sim, loads, plan

    def iteration_s(self, k: int, layout: Layout, m: int | None = None) -> float:
        """Simulated seconds of step k on `layout` (nothing recorded)."""
        return self.simulate(k, layout, m)[0].iteration_time

    def step(self, k: int, layout: Layout, res: PolicyResult, m: int | None = None) -> None:
        """Simulate step k on `layout` with m microbatches and record it in `res`."""
        sim, loads, plan = self.simulate(k, layout, m)
        res.iteration_s.append(sim.iteration_time)
        res.bubble_ratio.append(sim.bubble_ratio)
        res.stage_loads.append(loads)
        res.bottleneck_s.append(max(loads))
        res.layouts.append(list(layout.boundaries))
        res.workers.append(plan.num_ranks * self.dp)
        res.microbatches.append(m or self.m)


def traced_shard(trace: Trace) -> str:
    """The traced run's `parallel.shard` ("none" for runs before it existed)."""
    par = trace.header.config.get("parallel")
    shard = par.get("shard", "none") if isinstance(par, dict) else "none"
    return shard if isinstance(shard, str) else "none"
