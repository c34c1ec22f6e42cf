"""Expert parallelism in the replay: where each MoE layer's experts sit on the E ranks of an EP group. Pure.

    from dynmo.sim.replay.experts import ExpertOptions
    from dynmo.sim.replay.expert_policies import replay_experts
    out = replay_experts(scale_trace(load_trace("docs/bench/traces/moe-static.jsonl"), 32),
                         stages=16, dp=8, ep=8, options=ExpertOptions(microbatches=64, extra_slots=1, copies=8))
    out.results["dynmo"].total_s, out.results["dynmo"].speedup, out.capture, out.split

What is modelled. With `parallel.ep = E` the experts of each MoE layer are spread over E
data-parallel replicas of its stage (an EP group; dp / E groups). Every microbatch, each
replica sends its tokens to their experts' ranks and gets the outputs back (all-to-all); each
rank computes only the real tokens of the experts it holds, no padding. A MoE layer therefore
takes, per microbatch,

    non-expert part  +  expert part x (busiest EP rank's rows / the traced computed rows)  +  all-to-all

and its EP group runs in lockstep; the groups run apart and the step ends with the slowest one
(the replay simulates each group's iteration with the event-driven engine and takes the max).

The split of a traced MoE layer's cost. A trace records, per step and MoE layer, the tokens
routed to each expert (`moe_tokens_per_expert`) and the rows its expert matmuls computed
(`moe_expert_rows`, summed over the step's `moe_forwards` microbatches: the routed rows with the
grouped dispatch, the default; N experts x the busiest expert's load with the padded one, which
the committed traces used). The one-device run's expert part is proportional to those rows. `fit_split` fits, over every MoE layer and step but the warm-up
step 0, cost per microbatch (forward + backward) = a + b x computed rows per microbatch by least
squares: a is the non-expert part (attention, norms, router), b the cost of one expert row. A
layer's measured cost at a step is then split in the proportion b x rows : a of that step's rows,
so its noise stays with both parts. Where the fit is unusable (a < 0, b <= 0, under 3 points or
rows that never vary) the split falls back to the model's nominal multiply-adds
(`dynmo.flops`: attention and router per token, one expert's MLP per routed row), which
`split = "flops"` also forces. `ExpertReplay.split` reports both (the fit's R^2, the expert
share of the median MoE layer under each), so a reader sees how far they agree.

Loads per replica. The traces come from one-replica runs. Replica r's loads at step t are drawn
from the trace's own routing at that step: Multinomial(n, p) with p the step's per-expert share
of the layer's tokens and n the assignments of one microbatch (`moe_useful_rows` /
`moe_forwards`), seeded by (seed, t, layer, r), so a replay is deterministic under its seed.
The same router routes every replica's data (p is shared), their own tokens differ (the draw);
one draw per replica and step serves all of its microbatches (the variation between the
microbatches of one replica is not modelled).

The all-to-all. Per microbatch, replica j of a group sends the tokens its own rank does not
hold the expert of (a copied expert's tokens go to its copies in proportion of their shares)
and receives the tokens of the other replicas for its experts; one all-to-all takes the largest
rank's max(sent, received) x d_model x bytes per element (2 with `train.dtype = bf16`, else 4)
/ `a2a_bandwidth` (default A2A_BANDWIDTH, 25 GB/s: a 200 Gb/s link per GPU) + `a2a_latency`.
Forward: dispatch and combine, two; backward: their two gradients. The traced costs are the
CPU runs' (d_model 128): at those the all-to-all is small beside the compute.

The policies (static, dynmo, oracle; the layer layout held fixed or decided with the
placements) are `dynmo.sim.replay.expert_policies`'s; this module is the model they run on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from dynmo.balance.experts import MOVE_BYTES_PER_PARAM, Placement, align, move_cost, place_experts
from dynmo.config import ModelConfig
from dynmo.controller.evidence import CONFIDENCE
from dynmo.controller.migration import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S
from dynmo.engine import SimInputError, StageTimes, simulate_plan, build_plan
from dynmo.flops import attention_macs, mlp_macs
from dynmo.layout import Layout
from dynmo.loop import BYTES_PER_PARAM
from dynmo.sim.replay.options import ReplayOptions, schedule_of
from dynmo.sim.trace import Trace
from dynmo.sim.trace.format import traced_model

POLICIES = ("static", "dynmo", "oracle")
A2A_BANDWIDTH = 25e9  # bytes/s per rank: a 200 Gb/s link per GPU
SPLITS = ("fit", "flops")
PLACE_NODES = 2000  # branch-and-bound nodes per placement in the replay (thousands of them): exact where that suffices
CAPTURE_MIN_GAIN = 0.005  # below this oracle gain over static, a captured share says nothing


@dataclass
class ExpertOptions:
    microbatches: int | None = None  # per replica per step; default the traced run's
    extra_slots: int = 0  # expert slots per rank beyond N / E, for copies
    copies: int = 0  # extra copies of hot experts the oracle may place per layer; 0: as many as the extra slots hold
    # (dynmo, as the runtime, fills every extra slot)
    split: str = "fit"  # how a MoE layer's traced cost splits into its non-expert and expert parts
    a2a_bandwidth: float = A2A_BANDWIDTH
    a2a_latency: float = 0.0
    # dynmo's decision (`dynmo.controller.experts.ExpertBalancer`), as `[balance]` sets it in a run
    every: int = 5  # balance.experts_every: steps between looks
    window: int = 3  # balance.window: the evidence spans 2 x max(5, window) steps
    min_gain: float = 0.01  # the margin a saving must clear (relative step time)
    horizon: int = 50  # steps over which a move's saving must repay its cost
    confidence: float = CONFIDENCE
    mig_fixed: float = MIGRATION_FIXED_S
    mig_bandwidth: float = MIGRATION_BANDWIDTH
    seed: int = 0

    def check(self) -> None:
        for name in ("extra_slots", "copies", "every", "window", "horizon", "seed"):
            v = getattr(self, name)
            least = 1 if name in ("every", "window", "horizon") else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise SimInputError(f"{name} must be an integer >= {least}, got {v!r}")
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int)
                                              or self.microbatches < 1):
            raise SimInputError(f"microbatches must be an integer >= 1, got {self.microbatches!r}")
        if self.split not in SPLITS:
            raise SimInputError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        for name in ("a2a_bandwidth", "mig_bandwidth"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v > 0):
                raise SimInputError(f"{name} must be a number > 0 (bytes/s), got {v!r}")
        for name in ("a2a_latency", "mig_fixed", "min_gain"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise SimInputError(f"{name} must be a number >= 0, got {v!r}")
        if self.copies and not self.extra_slots:
            raise SimInputError(f"copies = {self.copies} need extra_slots >= 1 (room on the ranks for the copies)")


@dataclass
class ExpertPolicyResult:
    policy: str
    iteration_s: list[float] = field(default_factory=list)  # simulated step (slowest group)
    layouts: list[list[int]] = field(default_factory=list)  # per step: the layer layout it ran
    orders: list[tuple] = field(default_factory=list)  # per step: each MoE layer's placement (a tuple of them)
    overhead_s: list[float] = field(default_factory=list)  # migration charged before the step
    busiest_ratio: list[float] = field(default_factory=list)  # per step: mean over MoE layers of busiest rank / mean rank
    migrations: int = 0  # expert re-placements
    layer_migrations: int = 0  # layer layout changes (with the layout decided too)
    moved_copies: int = 0
    moved_bytes: float = 0.0
    speedup: float | None = None  # static's total time over this one's
    capture: float | None = None  # dynmo: share of the oracle's gain over static

    @property
    def total_s(self) -> float:
        return float(sum(self.iteration_s) + sum(self.overhead_s))

    @property
    def migration_s(self) -> float:
        return float(sum(self.overhead_s))

    def as_dict(self) -> dict:
        return {"policy": self.policy, "total_s": self.total_s, "speedup": self.speedup, "capture": self.capture,
                "migrations": self.migrations, "moved_copies": self.moved_copies, "moved_bytes": self.moved_bytes,
                "migration_s": self.migration_s, "layer_migrations": self.layer_migrations,
                "mean_busiest_over_mean": float(np.mean(self.busiest_ratio)),
                "iteration_s": self.iteration_s, "overhead_s": self.overhead_s}


@dataclass
class ExpertReplay:
    results: dict[str, ExpertPolicyResult]
    layout: list[int]  # the layer layout static ran (every policy's, with the layout held fixed)
    layout_name: str
    split: dict  # the fit, the FLOP shares, which was used
    shape: dict

    @property
    def capture(self) -> float | None:
        return self.results["dynmo"].capture if "dynmo" in self.results else None

    def as_dict(self) -> dict:
        return {"shape": self.shape, "layout": self.layout, "layout_name": self.layout_name, "split": self.split,
                "policies": {k: v.as_dict() for k, v in self.results.items()}}


def moe_layers(trace: Trace) -> list[int]:
    """The layers whose steps all carry `moe_tokens_per_expert`; SimInputError if none or if a step lacks them."""
    steps = trace.steps
    if not steps:
        raise SimInputError("the trace has no steps")
    first = (steps[0].stats or {}).get("moe_tokens_per_expert")
    if not first or not any(v is not None for v in first):
        raise SimInputError("the trace carries no moe_tokens_per_expert (no MoE layer's routing was recorded); "
                            "replay a trace of a MoE run (model.block = \"moe\")")
    layers = [i for i, v in enumerate(first) if v is not None]
    n = len(first[layers[0]])
    for s in steps:
        st = s.stats or {}
        for key in ("moe_tokens_per_expert", "moe_expert_rows", "moe_useful_rows", "moe_forwards"):
            v = st.get(key)
            if v is None or len(v) != trace.num_layers or any(v[i] is None for i in layers):
                raise SimInputError(f"step {s.step} lacks {key} for the MoE layers {layers}")
        if any(len(st["moe_tokens_per_expert"][i]) != n for i in layers):
            raise SimInputError(f"step {s.step}: MoE layers route to different numbers of experts")
    return layers


def model_config(trace: Trace) -> ModelConfig:
    """The traced model's config (`traced_model`; the defaults where the header records none)."""
    return traced_model(trace.header) or ModelConfig()


def expert_params(m: ModelConfig) -> float:
    """Weights of one expert's matrices (biases left out): one MLP's multiply-adds per token."""
    return (mlp_macs(m) - m.d_model * m.moe.num_experts) / m.moe.top_k


def _rows_per_mb(st: dict, i: int) -> tuple[float, float]:
    """(computed expert rows, useful rows) per microbatch of layer i at a step."""
    fw = max(float(st["moe_forwards"][i]), 1.0)
    return float(st["moe_expert_rows"][i]) / fw, float(st["moe_useful_rows"][i]) / fw


def fit_split(trace: Trace, layers: list[int]) -> dict:
    """Least squares of a MoE layer's cost per microbatch on its computed rows per microbatch (module doc)."""
    costs = trace.fwd() + trace.bwd()
    x, y = [], []
    for k, s in enumerate(trace.steps):
        if k == 0 and len(trace.steps) > 1:
            continue  # the warm-up step
        for i in layers:
            x.append(_rows_per_mb(s.stats, i)[0])
            y.append(costs[k][i])
    x, y = np.asarray(x), np.asarray(y)
    out = {"points": int(x.size), "a": None, "b": None, "r2": None, "usable": False}
    if x.size >= 3 and np.ptp(x) > 0:
        a_mat = np.vstack([np.ones_like(x), x]).T
        (a, b), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
        pred = a_mat @ np.array([a, b])
        ss = float(((y - y.mean()) ** 2).sum())
        out.update(a=float(a), b=float(b), r2=1 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else None,
                   usable=bool(a >= 0 and b > 0))
    return out


def flops_ratio(m: ModelConfig, tokens_per_mb: float) -> tuple[float, float]:
    """(non-expert multiply-adds per microbatch, multiply-adds of one expert row)."""
    return tokens_per_mb * (attention_macs(m) + m.d_model * m.moe.num_experts), expert_params(m)


class _Model:
    """The per-step inputs of the replay: traced costs split, replica loads drawn, plans built."""

    def __init__(self, trace: Trace, stages: int, dp: int, ep: int, opts: ExpertOptions):
        self.trace, self.opts, self.ep, self.dp = trace, opts, ep, dp
        self.layers = moe_layers(trace)
        st0 = trace.steps[0].stats
        self.n = len(st0["moe_tokens_per_expert"][self.layers[0]])
        if ep < 1 or isinstance(ep, bool):
            raise SimInputError(f"ep must be an integer >= 1, got {ep!r}")
        if self.n % ep:
            raise SimInputError(f"ep = {ep} does not divide the {self.n} experts of a MoE layer; "
                                f"choose a divisor of {self.n}")
        if dp % ep:
            raise SimInputError(f"ep = {ep} does not divide dp = {dp}: an EP group is ep data-parallel replicas")
        if opts.extra_slots > self.n - self.n // ep:
            raise SimInputError(f"extra_slots = {opts.extra_slots}: a rank holds {self.n // ep} of the {self.n} experts at "
                                f"ep = {ep}, so it has room for copies of at most {self.n - self.n // ep} others")
        if opts.copies > ep * opts.extra_slots:
            raise SimInputError(f"copies = {opts.copies} do not fit: the {ep} ranks have {ep * opts.extra_slots} extra "
                                f"slots (extra_slots = {opts.extra_slots} each); give copies <= {ep * opts.extra_slots}")
        self.groups = dp // ep
        self.copies = opts.copies or ep * opts.extra_slots  # the oracle's budget of copies
        ropts = ReplayOptions(microbatches=opts.microbatches)
        self.schedule, self.v = schedule_of(trace, ropts)
        if stages % self.v:
            raise SimInputError(f"{self.schedule} with {self.v} stages per rank needs a multiple of {self.v} stages")
        if stages > trace.num_layers:
            raise SimInputError(f"cannot split {trace.num_layers} layers into {stages} stages; scale the trace")
        self.m = int(opts.microbatches or trace.header.microbatches)
        self.plan = build_plan(self.schedule, stages // self.v, self.m, stages_per_rank=self.v)
        self.fwd, self.bwd = trace.fwd(), trace.bwd()
        cfg = model_config(trace)
        self.d_model = cfg.d_model
        dtype = (trace.header.config.get("train") or {}).get("dtype", "fp32")
        self.elem_bytes = 2 if dtype == "bf16" else 4
        self.expert_params = expert_params(cfg)
        self.expert_bytes = MOVE_BYTES_PER_PARAM * self.expert_params  # a re-placement, between steps
        # the split
        fit = fit_split(trace, self.layers)
        tokens_mb = float(st0["moe_useful_rows"][self.layers[0]]) / max(float(st0["moe_forwards"][self.layers[0]]), 1) \
            / max(cfg.moe.top_k, 1)
        fa, fb = flops_ratio(cfg, tokens_mb)
        use = "fit" if opts.split == "fit" and fit["usable"] else "flops"
        a, b = (fit["a"], fit["b"]) if use == "fit" else (fa, fb)
        med_rows = float(np.median([_rows_per_mb(s.stats, i)[0] for s in trace.steps for i in self.layers]))
        self.split = {"used": use, "fit": fit, "flops": {"non_expert_macs": fa, "row_macs": fb},
                      "median_padded_rows": med_rows,
                      "expert_share_fit": (fit["b"] * med_rows / (fit["a"] + fit["b"] * med_rows))
                      if fit["usable"] else None,
                      "expert_share_flops": fb * med_rows / (fa + fb * med_rows)}
        steps = len(trace.steps)
        L = len(self.layers)
        self.share = np.zeros((steps, L))  # expert share of each MoE layer's traced cost
        self.padded = np.zeros((steps, L))  # traced computed expert rows per microbatch (padded or routed)
        self.loads = np.zeros((steps, L, dp, self.n))  # per replica, one microbatch's assignments per expert
        for k, s in enumerate(trace.steps):
            st = s.stats
            for j, i in enumerate(self.layers):
                rows, useful = _rows_per_mb(st, i)
                self.padded[k, j] = rows
                self.share[k, j] = b * rows / (a + b * rows) if a + b * rows > 0 else 0.0
                tok = np.asarray(st["moe_tokens_per_expert"][i], dtype=float)
                p = tok / tok.sum() if tok.sum() > 0 else np.full(self.n, 1.0 / self.n)
                n_mb = int(round(useful))
                for r in range(dp):
                    rng = np.random.default_rng([opts.seed, k, i, r])
                    self.loads[k, j, r] = rng.multinomial(n_mb, p)
        self.agg = self.loads.sum(axis=2)  # summed over the replicas: what placement decisions see
        self._memo: dict = {}

    def layer_times(self, k: int, placements: list[Placement], g: int) -> tuple[np.ndarray, np.ndarray, float]:
        """Per-layer forward and backward seconds per microbatch of step k in group g, and the mean
        over MoE layers of busiest rank / mean rank."""
        f = self.fwd[k].copy()
        bw = self.bwd[k].copy()
        reps = self.loads[k, :, g * self.ep:(g + 1) * self.ep]  # [layer, replica in group, expert]
        ratios = []
        for j, i in enumerate(self.layers):
            p = placements[j]
            group_loads = reps[j].sum(axis=0)
            rl = p.rank_loads(group_loads)
            busiest = float(rl.max())
            ratios.append(busiest / rl.mean() if rl.mean() > 0 else 1.0)
            scale = busiest / self.padded[k, j] if self.padded[k, j] > 0 else 0.0
            sh = self.share[k, j]
            a2a = self.a2a_s(reps[j], p)
            f[i] = f[i] * (1 - sh) + f[i] * sh * scale + 2 * a2a
            bw[i] = bw[i] * (1 - sh) + bw[i] * sh * scale + 2 * a2a
        return f, bw, float(np.mean(ratios))

    def layer_bytes(self) -> list[float]:
        """What a migrating layer ships per rank under expert parallelism: the trace header's
        bytes (the whole layer, `BYTES_PER_PARAM` a parameter), less the experts each rank of an
        EP group does not hold (N - (N / E + extra_slots) experts, `BYTES_PER_PARAM` a parameter as
        the header counts them) for a MoE layer: each rank of the stage sends its own share, all
        at once."""
        out = [float(b) for b in self.trace.header.layer_bytes]
        held = self.n // self.ep + self.opts.extra_slots
        for i in self.layers:
            out[i] = max(0.0, out[i] - (self.n - held) * BYTES_PER_PARAM * self.expert_params)
        return out

    def mean_layer_times(self, k: int, placements: list[Placement]) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer forward and backward seconds per microbatch of step k, the mean over the
        groups: what the layer controller is fed as the step's measured costs."""
        f = np.zeros(len(self.fwd[k]))
        bw = np.zeros(len(self.bwd[k]))
        for g in range(self.groups):
            gf, gb, _ = self.layer_times(k, placements, g)
            f += gf / self.groups
            bw += gb / self.groups
        return f, bw

    def a2a_s(self, reps: np.ndarray, p: Placement) -> float:
        """One all-to-all of a microbatch in a group: the largest rank's max(sent, received) rows."""
        if self.ep == 1:
            return 0.0
        E = self.ep
        # on[e, r]: the share of expert e's tokens that rank r computes
        on = np.zeros((self.n, E))
        for e, (rs, sh) in enumerate(zip(p.ranks, p.shares)):
            for r, s in zip(rs, sh):
                on[e, r] = s
        # traffic[j, r]: rows replica j sends to rank r
        traffic = reps @ on
        sent = traffic.sum(axis=1) - np.diag(traffic)
        recv = traffic.sum(axis=0) - np.diag(traffic)
        rows = float(max(sent.max(), recv.max()))
        return rows * self.d_model * self.elem_bytes / self.opts.a2a_bandwidth + self.opts.a2a_latency

    def step_s(self, k: int, placements: list[Placement], layout: Layout) -> tuple[float, float]:
        """(the slowest group's simulated iteration, mean busiest/mean over MoE layers and groups) of step k."""
        key = (k, tuple(placements), layout.boundaries)
        if key not in self._memo:
            self._memo[key] = self._step_s(k, placements, layout)
        return self._memo[key]

    def _step_s(self, k: int, placements: list[Placement], layout: Layout) -> tuple[float, float]:
        b = np.asarray(layout.boundaries[:-1])
        worst, ratios = 0.0, []
        for g in range(self.groups):
            f, bw, ratio = self.layer_times(k, placements, g)
            times = StageTimes.build(np.add.reduceat(f, b), np.add.reduceat(bw, b), self.m)
            worst = max(worst, simulate_plan(self.plan, times, dp=1, split_bubble=False).iteration_time)
            ratios.append(ratio)
        return worst, float(np.mean(ratios))

    def place(self, loads: np.ndarray, current: Placement) -> Placement:
        res = place_experts(loads, self.ep, extra_slots=self.opts.extra_slots, copies=self.copies,
                            max_nodes=PLACE_NODES)
        return align(current, res.placement, self.expert_bytes)

    def move(self, old: list[Placement], new: list[Placement], layout: Layout) -> tuple[float, int, float]:
        """(seconds, copies moved, bytes) of changing placements: every stage's ranks receive in parallel."""
        owner = np.repeat(np.arange(layout.num_stages), np.diff(layout.boundaries))
        per_stage: dict[int, np.ndarray] = {}
        count, total = 0, 0.0
        for j, i in enumerate(self.layers):
            mv = move_cost(old[j], new[j], self.expert_bytes)
            if mv.count:
                s = int(owner[i])
                per_stage[s] = per_stage.get(s, np.zeros(self.ep)) + np.asarray(mv.bytes_per_rank)
                count += mv.count
                total += mv.bytes
        if not count:
            return 0.0, 0, 0.0
        worst = max(float(v.max()) for v in per_stage.values())
        return self.opts.mig_fixed + worst / self.opts.mig_bandwidth, count, total * self.groups
