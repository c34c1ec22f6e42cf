"""The trace format: the header (the run's shape) and one step (what the run measured).

Each is a dataclass with `as_dict` / `from_...` and a check that names the first bad field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

from dynmo.config import HashAttnConfig, ModelConfig, MoDConfig, MoEConfig
from dynmo.jsonio import is_int, is_number
from dynmo.loop import BYTES_PER_PARAM
from dynmo.record import StepRecord
from dynmo.sim.trace import limits
from dynmo.sim.trace.kinds import PER_BLOCK, SUBLAYER, UNITS, unit_kinds, unit_names, unit_of
from dynmo.sim.trace.limits import TraceError
from dynmo.sim.trace.values import finite, int_field, ints, length, show, times

FORMAT = "dynmo-trace"
VERSION = 1


@dataclass
class TraceHeader:
    layers: list[str]  # unit names: embed, block0, ..., head (block0_attn, block0_mlp, ... with sublayer units)
    kinds: list[str]  # E, t, ..., L (E, a, m, ..., L with sublayer units)
    params: list[int]  # parameters per layer
    layer_bytes: list[int]  # bytes that move with a migrating layer (BYTES_PER_PARAM x params)
    microbatches: int  # per replica per step
    pp: int  # pipeline ranks of the traced run
    dp: int  # data-parallel replicas of the traced run
    schedule: str  # torch schedule name as configured (1f1b, gpipe, interleaved1f1b, ...)
    virtual_stages: int = 1  # stages per rank
    tokens_per_microbatch: int | None = None  # sequences per microbatch x seq_len
    case: str = "dense"  # dynamic-model case(s): dense, moe, mod, hashattn, skew, prune, ...
    config: dict = field(default_factory=dict)  # summary of the run's config
    source: str = "train"  # train | metrics (converted) | scaled | merged (sublayer units summed into blocks)
    # per cut after layer i (layers - 1): the bytes of one microbatch crossing it (the hidden state
    # and mask; a cut between a block's halves adds the block's carry); None: not recorded, every
    # cut the same
    boundary_bytes: list[int] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def as_dict(self) -> dict:
        d = {"format": FORMAT, "version": VERSION, **asdict(self)}
        if self.boundary_bytes is None:
            del d["boundary_bytes"]  # a header without it reads as before
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "trace header") -> "TraceHeader":
        if not isinstance(d, dict):
            raise TraceError(f"{where}: the first line must be a JSON object (the trace header)")
        if d.get("format") != FORMAT:
            raise TraceError(f"not a dynmo trace: the first line's format is {show(d.get('format'))}, want {FORMAT!r}")
        version = d.get("version", 0)
        if not is_int(version):
            raise TraceError(f"{where}: version must be an integer, got {show(version)}")
        if version > VERSION:
            raise TraceError(f"trace version {version} is newer than this dynmo reads ({VERSION}); upgrade dynmo")
        known = {f for f in cls.__dataclass_fields__}
        missing = {"layers", "kinds", "params", "microbatches", "pp", "dp", "schedule"} - set(d)
        if missing:
            raise TraceError(f"trace header lacks {sorted(missing)}")
        kw = {k: v for k, v in d.items() if k in known and k != "layer_bytes"}
        n = length("layers", d["layers"], where)
        params = ints("params", d["params"], n, where)
        lb = d.get("layer_bytes")
        kw["layer_bytes"] = [BYTES_PER_PARAM * x for x in params] if lb is None or lb == [] else lb
        h = cls(**kw)
        h.check(where)
        return h

    def check(self, where: str = "trace header") -> None:
        """TraceError naming the first field of a bad type, size or range."""
        n = length("layers", self.layers, where)
        if not all(isinstance(x, str) for x in self.layers):
            raise TraceError(f"{where}: layers must be a list of layer names (strings)")
        if not isinstance(self.kinds, list) or not all(isinstance(x, str) for x in self.kinds):
            raise TraceError(f"{where}: kinds must be a list of strings (E, t, L or E, a, m, L)")
        if len(self.kinds) != n:
            raise TraceError(f"trace header: kinds has {len(self.kinds)} entries for {n} layers")
        unit_of(self.kinds, where)
        ints("params", self.params, n, where)
        ints("layer_bytes", self.layer_bytes, n, where)
        int_field("microbatches", self.microbatches, 1, limits.MAX_MICROBATCHES, where)
        int_field("pp", self.pp, 1, limits.MAX_STAGES, where)
        int_field("dp", self.dp, 1, limits.MAX_DP, where)
        int_field("virtual_stages", self.virtual_stages, 1, limits.MAX_STAGES, where)
        if self.tokens_per_microbatch is not None:
            int_field("tokens_per_microbatch", self.tokens_per_microbatch, 0, limits.MAX_COUNT, where)
        for name in ("schedule", "case", "source"):
            if not isinstance(getattr(self, name), str):
                raise TraceError(f"{where}: {name} must be a string, got {show(getattr(self, name))}")
        if not isinstance(self.config, dict):
            raise TraceError(f"{where}: config must be a JSON object, got {show(self.config)}")
        model = self.config.get("model", {})
        if not isinstance(model, dict):
            raise TraceError(f"{where}: config.model must be a JSON object, got {show(model)}")
        if model.get("seq_len") is not None:
            int_field("config.model.seq_len", model["seq_len"], 0, limits.MAX_COUNT, where)
        if self.boundary_bytes is not None:
            check_boundary_bytes(self.boundary_bytes, n, where)

    @classmethod
    def from_config(cls, cfg: dict, params: Iterable[int], pp: int, dp: int, source: str = "train",
                    boundary_bytes: Iterable[int] | None = None) -> "TraceHeader":
        """Header for a run of config `cfg` (a `Config.to_dict()` or a parsed config.toml), whose
        pipeline places `parallel.unit` units: `params` has one count per unit, `boundary_bytes`
        (optional, from the runtime, which knows the blocks' carries) one per cut between them."""
        model, train, par = cfg.get("model", {}), cfg.get("train", {}), cfg.get("parallel", {})
        n_blocks = int(model.get("n_layers", 0))
        unit = par.get("unit", "block")
        if unit not in UNITS:
            raise TraceError(f"parallel.unit must be one of {', '.join(UNITS)}, got {show(unit)}")
        params = [int(p) for p in params]
        n = PER_BLOCK[unit] * n_blocks + 2
        if len(params) != n:
            if unit == SUBLAYER:
                raise TraceError(f"{len(params)} parameter counts for {n} units (E, {n_blocks} blocks as "
                                 "attention and MLP halves, L)")
            raise TraceError(f"{len(params)} parameter counts for {n_blocks + 2} layers (E, {n_blocks} blocks, L)")
        cuts = None
        if boundary_bytes is not None:
            cuts = check_boundary_bytes(list(boundary_bytes), n, "boundary_bytes")
        m = int(train.get("microbatches", 1))
        gb = int(train.get("global_batch", 0))
        tokens = gb // max(1, dp * m) * int(model.get("seq_len", 0)) if gb else None
        return cls(
            layers=unit_names(n_blocks, unit),
            kinds=unit_kinds(n_blocks, unit),
            params=params,
            layer_bytes=[BYTES_PER_PARAM * p for p in params],
            microbatches=m,
            pp=int(pp),
            dp=int(dp),
            schedule=str(par.get("schedule", "1f1b")),
            virtual_stages=int(par.get("virtual_stages", 1)),
            tokens_per_microbatch=tokens or None,
            case=case_name(cfg),
            config=config_summary(cfg),
            source=source,
            boundary_bytes=None if cuts is None else [int(b) for b in cuts],
        )


@dataclass
class TraceStep:
    step: int
    fwd: list[float]  # seconds per microbatch per layer
    bwd: list[float]  # full backward (input + weight gradient)
    layout: list[int] | None = None  # boundaries the run used at this step
    iteration_s: float | None = None  # measured wall time of the schedule (forward + backward)
    step_s: float | None = None  # measured wall time of the whole step
    events: list[dict] = field(default_factory=list)  # migrations, dynamism, ...
    wgrad: list[float] | None = None  # weight-gradient part of bwd, when measured
    stats: dict[str, list] = field(default_factory=dict)  # per-layer case stats (moe_tokens_per_expert, ...)
    microbatches: int | None = None  # when the run changed it (re-tuning after a re-pack); else the header's
    state_bytes: list[float] | None = None  # measured per-layer params + grads + optimizer state, when recorded
    cost: list[float] | None = None  # the controller's per-layer cost (layer_cost_s: median microbatch), when recorded

    @property
    def dynamism(self) -> bool:
        return any(e.get("type") == "dynamism" for e in self.events)

    def as_dict(self) -> dict:
        d: dict[str, Any] = {"step": self.step, "fwd": self.fwd, "bwd": self.bwd}
        if self.wgrad is not None:
            d["wgrad"] = self.wgrad
        d |= {"layout": self.layout, "iteration_s": self.iteration_s, "step_s": self.step_s, "events": self.events}
        if self.stats:
            d["stats"] = self.stats
        if self.microbatches is not None:
            d["microbatches"] = self.microbatches
        if self.state_bytes is not None:
            d["state_bytes"] = self.state_bytes
        if self.cost is not None:
            d["cost"] = self.cost
        return d

    @classmethod
    def from_record(cls, rec: StepRecord, where: str | None = None) -> "TraceStep":
        """From the run's record of the step (or a metrics.jsonl line read with `StepRecord.from_json`)."""
        where = where or f"metrics record of step {show(rec.step)}"
        if not rec.layer_fwd_s or not rec.layer_bwd_s:
            raise TraceError(f"{where} lacks layer_fwd_s/layer_bwd_s: per-layer timing "
                             "is off (balance.profile = false?)")
        if not isinstance(rec.layer_fwd_s, list):
            raise TraceError(f"{where}: layer_fwd_s must be a list of numbers, got {show(rec.layer_fwd_s)}")
        n = len(rec.layer_fwd_s)
        lists = {"fwd": rec.layer_fwd_s, "bwd": rec.layer_bwd_s, "wgrad": rec.layer_wgrad_s or None,
                 "state_bytes": rec.layer_state_bytes or None, "cost": rec.layer_cost_s or None}
        for name, v in lists.items():
            if v is not None:
                times(name, v, n, where)
        if rec.microbatches and not is_int(rec.microbatches):
            raise TraceError(f"{where}: microbatches must be an integer, got {show(rec.microbatches)}")
        if not is_int(rec.step):
            raise TraceError(f"{where}: step must be an integer, got {show(rec.step)}")
        stats = rec.stats if isinstance(rec.stats, dict) else {}
        step = cls(
            step=int(rec.step),
            fwd=[float(x) for x in rec.layer_fwd_s],
            bwd=[float(x) for x in rec.layer_bwd_s],
            wgrad=[float(x) for x in rec.layer_wgrad_s] if rec.layer_wgrad_s else None,
            layout=(list(rec.layout) if isinstance(rec.layout, list) else rec.layout) if rec.layout else None,
            iteration_s=rec.iteration_s,
            step_s=rec.step_s,
            events=list(rec.events) if isinstance(rec.events, list) else rec.events,
            stats={k: v for k, v in stats.items() if isinstance(v, list) and len(v) == n},
            microbatches=int(rec.microbatches) if rec.microbatches else None,
            state_bytes=[float(x) for x in rec.layer_state_bytes] if rec.layer_state_bytes else None,
            cost=[float(x) for x in rec.layer_cost_s] if rec.layer_cost_s else None,
        )
        return check_step(step, n, where)


def check_boundary_bytes(v: Any, n: int, where: str) -> list[int]:
    """`boundary_bytes`: one integer >= 1 per cut between the n layers."""
    if not isinstance(v, list) or len(v) != n - 1:
        got = f"{len(v)} entries" if isinstance(v, list) else show(v)
        raise TraceError(f"{where}: boundary_bytes must be a list of {n - 1} integers (one per cut between "
                         f"the {n} layers), got {got}")
    for i, x in enumerate(v):
        if not is_int(x) or not 1 <= x <= limits.MAX_COUNT:
            raise TraceError(f"{where}: boundary_bytes[{i}] = {show(x)}; give integers from 1 to 2^53")
    return v


def check_step(s: TraceStep, n: int, where: str) -> TraceStep:
    """TraceError naming the first field of a bad type, length or range."""
    if not is_int(s.step):
        raise TraceError(f"{where}: step must be an integer, got {show(s.step)}")
    for name in ("fwd", "bwd", "wgrad", "state_bytes", "cost"):
        v = getattr(s, name)
        if v is None and name not in ("fwd", "bwd"):
            continue
        times(name, v, n, where)
    if s.layout is not None:
        if not isinstance(s.layout, list) or not all(is_int(b) for b in s.layout) or len(s.layout) > n + 1:
            raise TraceError(f"{where}: layout must be null or a list of at most {n + 1} integer boundaries")
    for name in ("iteration_s", "step_s"):
        v = getattr(s, name)
        if v is not None and not (is_number(v) and finite(v) and v >= 0):
            raise TraceError(f"{where}: {name} must be null or seconds (a finite number >= 0), got {show(v)}")
    if not isinstance(s.events, list) or not all(isinstance(e, dict) for e in s.events):
        raise TraceError(f"{where}: events must be a list of JSON objects, got {show(s.events)}")
    if not isinstance(s.stats, dict):
        raise TraceError(f"{where}: stats must be a JSON object of per-layer lists, got {show(s.stats)}")
    for k, v in s.stats.items():
        if not isinstance(v, list) or len(v) != n:
            raise TraceError(f"{where}: stats[{k!r:.40}] must be a list with one entry per layer ({n})")
    if s.microbatches is not None:
        int_field("microbatches", s.microbatches, 1, limits.MAX_MICROBATCHES, where)
    return s


def case_name(cfg: dict) -> str:
    """The dynamic-model case(s) a config enables, joined by '+' ('dense' when none)."""
    parts = []
    block = cfg.get("model", {}).get("block", "dense")
    if block != "dense":
        parts.append(block)
    for sec in ("prune", "freeze", "early_exit"):
        if cfg.get(sec, {}).get("enabled"):
            parts.append(sec.replace("_", "-"))
    if int(cfg.get("skew", {}).get("factor", 1)) > 1:
        parts.append("skew")
    return "+".join(parts) or "dense"


def traced_model(header: "TraceHeader") -> ModelConfig | None:
    """The traced model's config, read back from the header's summary (`config_summary`): the
    model's fields and its block options the summary kept, keys this dynmo does not know left
    out; None when the header records no model."""
    d = header.config.get("model") if isinstance(header.config, dict) else None
    if not isinstance(d, dict):
        return None
    subs = {"moe": MoEConfig, "mod": MoDConfig, "hashattn": HashAttnConfig}
    known = {f.name for f in fields(ModelConfig)}
    kw = {k: v for k, v in d.items() if k in known and k not in subs}
    for k, cls in subs.items():
        if isinstance(d.get(k), dict):
            kw[k] = cls(**{f.name: d[k][f.name] for f in fields(cls) if f.name in d[k]})
    return ModelConfig(**kw)


def config_summary(cfg: dict) -> dict:
    """The parts of a config that shape the costs: model (and the active block's options),
    train batch shape, parallel, balance, and the sections of enabled cases."""
    model = {k: v for k, v in cfg.get("model", {}).items() if not isinstance(v, dict)}
    block = model.get("block", "dense")
    if isinstance(cfg.get("model", {}).get(block), dict):
        model[block] = cfg["model"][block]
    train = {k: cfg.get("train", {}).get(k) for k in ("steps", "global_batch", "microbatches", "seed")}
    out = {"model": model, "train": train, "parallel": dict(cfg.get("parallel", {})),
           "balance": dict(cfg.get("balance", {}))}
    for sec in ("prune", "freeze", "early_exit"):
        if cfg.get(sec, {}).get("enabled"):
            out[sec] = dict(cfg[sec])
    if int(cfg.get("skew", {}).get("factor", 1)) > 1:
        out["skew"] = dict(cfg["skew"])
    return out
