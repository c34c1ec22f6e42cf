"""Per-layer cost traces: what a real run measured, step by step, for the simulator to replay.

Pure (stdlib + numpy; no torch). Format (JSON Lines, documented in docs/simulator.md):

    line 1   header: {"format": "dynmo-trace", "version": 1, "layers": [...], "kinds": [...],
                      "params": [...], "layer_bytes": [...], "microbatches", "pp", "dp",
                      "virtual_stages", "schedule", "tokens_per_microbatch", "case",
                      "config", "source"}
    line 2+  one step: {"step", "fwd": [...], "bwd": [...], ("wgrad": [...]), "layout",
                        "iteration_s", "step_s", "events": [...], ("stats": {...})}

`fwd`/`bwd` are seconds per microbatch per layer (as `layer_fwd_s`/`layer_bwd_s` in
metrics.jsonl; `bwd` is the full backward, weight gradient included).

    w = TraceWriter("run.trace.jsonl", TraceHeader.from_config(cfg.to_dict(), params, pp, dp))
    w.write_step(record)      # the run's StepRecord (dynmo.record), every step
    w.close()
    t = load_trace("run.trace.jsonl")           # or trace_from_metrics("runs/skewed")
    big = scale_trace(t, blocks=48)             # paper-sized: 48 blocks, same dynamics
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from dynmo.loop import BYTES_PER_PARAM
from dynmo.record import StepRecord

FORMAT = "dynmo-trace"
VERSION = 1


class TraceError(ValueError):
    """A trace file or run folder that cannot be read; the message says what is wrong."""


# ---- the format -------------------------------------------------------------------------


@dataclass
class TraceHeader:
    layers: list[str]  # layer names: embed, block0, ..., head
    kinds: list[str]  # E, t, ..., L
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
    source: str = "train"  # train | metrics (converted) | scaled

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def as_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "TraceHeader":
        if d.get("format") != FORMAT:
            raise TraceError(f"not a dynmo trace: the first line's format is {d.get('format')!r}, want {FORMAT!r}")
        if int(d.get("version", 0)) > VERSION:
            raise TraceError(f"trace version {d['version']} is newer than this dynmo reads ({VERSION}); upgrade dynmo")
        known = {f for f in cls.__dataclass_fields__}
        missing = {"layers", "kinds", "params", "microbatches", "pp", "dp", "schedule"} - set(d)
        if missing:
            raise TraceError(f"trace header lacks {sorted(missing)}")
        h = cls(**{k: v for k, v in d.items() if k in known and k != "layer_bytes"},
                layer_bytes=d.get("layer_bytes") or [BYTES_PER_PARAM * int(p) for p in d["params"]])
        n = len(h.layers)
        for name in ("kinds", "params", "layer_bytes"):
            if len(getattr(h, name)) != n:
                raise TraceError(f"trace header: {name} has {len(getattr(h, name))} entries for {n} layers")
        return h

    @classmethod
    def from_config(cls, cfg: dict, params: Iterable[int], pp: int, dp: int, source: str = "train") -> "TraceHeader":
        """Header for a run of config `cfg` (a `Config.to_dict()` or a parsed config.toml)."""
        model, train, par = cfg.get("model", {}), cfg.get("train", {}), cfg.get("parallel", {})
        n_blocks = int(model.get("n_layers", 0))
        params = [int(p) for p in params]
        if len(params) != n_blocks + 2:
            raise TraceError(f"{len(params)} parameter counts for {n_blocks + 2} layers (E, {n_blocks} blocks, L)")
        m = int(train.get("microbatches", 1))
        gb = int(train.get("global_batch", 0))
        tokens = gb // max(1, dp * m) * int(model.get("seq_len", 0)) if gb else None
        return cls(
            layers=["embed"] + [f"block{i}" for i in range(n_blocks)] + ["head"],
            kinds=["E"] + ["t"] * n_blocks + ["L"],
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
    def from_record(cls, rec: StepRecord) -> "TraceStep":
        """From the run's record of the step (or a metrics.jsonl line read with `StepRecord.from_json`)."""
        if not rec.layer_fwd_s or not rec.layer_bwd_s:
            raise TraceError(f"metrics record of step {rec.step} lacks layer_fwd_s/layer_bwd_s: per-layer timing "
                             "is off (balance.profile = false?)")
        n = len(rec.layer_fwd_s)
        return cls(
            step=int(rec.step),
            fwd=[float(x) for x in rec.layer_fwd_s],
            bwd=[float(x) for x in rec.layer_bwd_s],
            wgrad=[float(x) for x in rec.layer_wgrad_s] if rec.layer_wgrad_s else None,
            layout=list(rec.layout) if rec.layout else None,
            iteration_s=rec.iteration_s,
            step_s=rec.step_s,
            events=list(rec.events),
            stats={k: v for k, v in rec.stats.items() if isinstance(v, list) and len(v) == n},
            microbatches=int(rec.microbatches) if rec.microbatches else None,
            state_bytes=[float(x) for x in rec.layer_state_bytes] if rec.layer_state_bytes else None,
            cost=[float(x) for x in rec.layer_cost_s] if rec.layer_cost_s else None,
        )


@dataclass
class Trace:
    header: TraceHeader
    steps: list[TraceStep]

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    def _per_mb(self, name: str) -> np.ndarray:
        a = np.asarray([getattr(s, name) for s in self.steps], dtype=float).reshape(len(self.steps), self.num_layers)
        # a step run with m_k microbatches (re-tuned) has microbatches of m / m_k times the size
        scale = [(s.microbatches or self.header.microbatches) / self.header.microbatches for s in self.steps]
        return a * np.asarray(scale)[:, None]

    def fwd(self) -> np.ndarray:
        """Seconds per microbatch of the header's size (`microbatches` per step), shape (steps, layers).

        Steps the run took with another microbatch count are rescaled to the header's
        microbatch size, assuming time proportional to the microbatch size."""
        return self._per_mb("fwd")

    def bwd(self) -> np.ndarray:
        return self._per_mb("bwd")

    def wgrad(self) -> np.ndarray | None:
        """Like fwd(), or None unless every step measured the weight-gradient part."""
        return self._per_mb("wgrad") if all(s.wgrad is not None for s in self.steps) else None

    def controller_costs(self) -> np.ndarray:
        """What the runtime's controller observed per step: `cost` (the median microbatch's
        forward + backward) where recorded, else the mean (`fwd + bwd`)."""
        if all(s.cost is not None for s in self.steps):
            return self._per_mb("cost")
        return self.costs()

    def costs(self) -> np.ndarray:
        """c_i(k): forward + backward seconds per microbatch of layer i at step k."""
        return self.fwd() + self.bwd()

    def dynamism_steps(self) -> list[int]:
        return [k for k, s in enumerate(self.steps) if s.dynamism]

    def write(self, path: str | Path) -> None:
        with TraceWriter(path, self.header) as w:
            for s in self.steps:
                w.write_trace_step(s)


def _check_step(s: TraceStep, n: int, where: str) -> TraceStep:
    for name in ("fwd", "bwd", "wgrad", "state_bytes", "cost"):
        v = getattr(s, name)
        if v is None:
            continue
        if len(v) != n:
            raise TraceError(f"{where}: {name} has {len(v)} values for {n} layers")
        if not all(math.isfinite(x) and x >= 0 for x in v):
            raise TraceError(f"{where}: {name} times must be finite and >= 0")
    return s


# ---- writing ----------------------------------------------------------------------------


class TraceWriter:
    """Append one line per step to a trace file; the runtime calls it on the logging rank."""

    def __init__(self, path: str | Path, header: TraceHeader | dict):
        self.header = header if isinstance(header, TraceHeader) else TraceHeader.from_dict(header)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w")
        self._f.write(json.dumps(self.header.as_dict()) + "\n")
        self._f.flush()

    def write_step(self, record: StepRecord) -> None:
        """One step as the run recorded it."""
        self.write_trace_step(TraceStep.from_record(record))

    def write_trace_step(self, step: TraceStep) -> None:
        _check_step(step, self.header.num_layers, f"step {step.step}")
        self._f.write(json.dumps(step.as_dict()) + "\n")
        self._f.flush()  # a crashed run still leaves a readable trace

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- reading ----------------------------------------------------------------------------


def load_trace(path: str | Path) -> Trace:
    """Read a trace file; a run folder (with metrics.jsonl) is converted on the fly."""
    p = Path(path)
    if p.is_dir():
        return trace_from_metrics(p)
    try:
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror}") from None
    if not lines:
        raise TraceError(f"{p} is empty")
    try:
        docs = [json.loads(ln) for ln in lines]
    except json.JSONDecodeError as e:
        raise TraceError(f"{p}: not JSON Lines ({e})") from None
    header = TraceHeader.from_dict(docs[0])
    n = header.num_layers
    fields = set(TraceStep.__dataclass_fields__)
    steps = [_check_step(TraceStep(**{k: v for k, v in d.items() if k in fields}), n, f"{p} line {i + 2}")
             for i, d in enumerate(docs[1:])]
    if not steps:
        raise TraceError(f"{p} has a header but no steps")
    return Trace(header, steps)


def trace_from_metrics(run_dir: str | Path, params: Iterable[int] | None = None) -> Trace:
    """Convert a finished (or running) run's `metrics.jsonl` + `config.toml` into a trace.

    Parameter counts come from `params` if given, else from the first step's `layer_params`
    (what the model had when the run started)."""
    d = Path(run_dir)
    mpath, cpath = d / "metrics.jsonl", d / "config.toml"
    if not mpath.is_file() or not cpath.is_file():
        raise TraceError(f"{d} is not a run folder: need metrics.jsonl and config.toml (written by dynmo train --out)")
    cfg = tomllib.loads(cpath.read_text())
    recs = [StepRecord.from_json(json.loads(ln)) for ln in mpath.read_text().splitlines() if ln.strip()]
    if not recs:
        raise TraceError(f"{mpath} has no steps yet")
    summary = {}
    if (d / "summary.json").is_file():
        summary = json.loads((d / "summary.json").read_text())
    pp, dp = _run_shape(cfg, recs[0], summary)
    counts = list(params) if params is not None else recs[0].layer_params
    if not counts:
        raise TraceError(f"{mpath} records no layer_params (a run of an older dynmo); pass params= explicitly")
    header = TraceHeader.from_config(cfg, counts, pp, dp, source="metrics")
    return Trace(header, [_check_step(TraceStep.from_record(r), header.num_layers, f"{mpath} step {r.step}")
                          for r in recs])


def _run_shape(cfg: dict, rec: StepRecord, summary: dict) -> tuple[int, int]:
    """pp and dp the run started with (a re-pack shrinks pp later; summary.json has the final one)."""
    par = cfg.get("parallel", {})
    dp = int(par.get("dp") or summary.get("dp") or 1)
    pp = int(par.get("pp") or 0) or len(rec.worker_compute_s or [])
    if not pp:
        v = int(par.get("virtual_stages") or 1)
        pp = (len(rec.layout) - 1) // v
    return pp, dp


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


# ---- scaling to paper-sized models --------------------------------------------------------


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
    """
    h = trace.header
    if blocks < 1:
        raise TraceError(f"blocks must be >= 1, got {blocks}")
    kinds = h.kinds
    block_idx = [i for i, k in enumerate(kinds) if k == "t"]
    if not block_idx or kinds[0] != "E" or kinds[-1] != "L" or len(block_idx) != len(kinds) - 2:
        raise TraceError("scale_trace needs a trace of E, t..., L layers")
    b = len(block_idx)
    src = np.asarray(block_idx)[block_map(b, blocks)]
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
            nb = a[src] * factor
            want = a[block_idx].sum() * blocks / b
            have = nb.sum()
            nb = nb * (want / have) if have > 0 else nb
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
    header = replace(h, layers=["embed"] + [f"block{j}" for j in range(blocks)] + ["head"],
                     kinds=["E"] + ["t"] * blocks + ["L"], params=params, layer_bytes=lbytes,
                     config=config, source="scaled")
    return Trace(header, steps)
