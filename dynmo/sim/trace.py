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

from dynmo.jsonio import InputError, is_int, is_number, loads, read_bytes
from dynmo.loop import BYTES_PER_PARAM
from dynmo.record import StepRecord

FORMAT = "dynmo-trace"
VERSION = 1

# Limits on what a trace (or a run folder's metrics.jsonl) and the simulator may ask for;
# docs/simulator.md, "Limits and exit codes", gives the memory of the worst allowed inputs.
MAX_TRACE_BYTES = 64 * 2**20  # file size
# strings, lists and objects in the file (counted from the text before parsing, as `"` / 2 plus
# `[` and `{`): each costs ~60-100 bytes once parsed, so these bound the parsed size
MAX_TRACE_ITEMS = 4_000_000
MAX_STEPS = 100_000
MAX_LAYERS = 100_000
MAX_TRACE_CELLS = 4_000_000  # steps x layers, also after scaling
MAX_STAGES = 4_096  # pipeline stages (pp x virtual stages)
MAX_MICROBATCHES = 100_000  # per step
MAX_DP = 1_000_000  # data-parallel replicas
MAX_NOISE = 5.0  # scale_trace's lognormal sigma (exp(5) spreads the costs 150x already)
MAX_COUNT = 2**53  # parameters, bytes, tokens: exact in a float64


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
    def from_dict(cls, d: dict, where: str = "trace header") -> "TraceHeader":
        if not isinstance(d, dict):
            raise TraceError(f"{where}: the first line must be a JSON object (the trace header)")
        if d.get("format") != FORMAT:
            raise TraceError(f"not a dynmo trace: the first line's format is {_show(d.get('format'))}, want {FORMAT!r}")
        version = d.get("version", 0)
        if not is_int(version):
            raise TraceError(f"{where}: version must be an integer, got {_show(version)}")
        if version > VERSION:
            raise TraceError(f"trace version {version} is newer than this dynmo reads ({VERSION}); upgrade dynmo")
        known = {f for f in cls.__dataclass_fields__}
        missing = {"layers", "kinds", "params", "microbatches", "pp", "dp", "schedule"} - set(d)
        if missing:
            raise TraceError(f"trace header lacks {sorted(missing)}")
        kw = {k: v for k, v in d.items() if k in known and k != "layer_bytes"}
        n = _length("layers", d["layers"], where)
        params = _ints("params", d["params"], n, where)
        lb = d.get("layer_bytes")
        kw["layer_bytes"] = [BYTES_PER_PARAM * x for x in params] if lb is None or lb == [] else lb
        h = cls(**kw)
        h.check(where)
        return h

    def check(self, where: str = "trace header") -> None:
        """TraceError naming the first field of a bad type, size or range."""
        n = _length("layers", self.layers, where)
        if not all(isinstance(x, str) for x in self.layers):
            raise TraceError(f"{where}: layers must be a list of layer names (strings)")
        if not isinstance(self.kinds, list) or not all(isinstance(x, str) for x in self.kinds):
            raise TraceError(f"{where}: kinds must be a list of strings (E, t, L)")
        if len(self.kinds) != n:
            raise TraceError(f"trace header: kinds has {len(self.kinds)} entries for {n} layers")
        _ints("params", self.params, n, where)
        _ints("layer_bytes", self.layer_bytes, n, where)
        _int_field("microbatches", self.microbatches, 1, MAX_MICROBATCHES, where)
        _int_field("pp", self.pp, 1, MAX_STAGES, where)
        _int_field("dp", self.dp, 1, MAX_DP, where)
        _int_field("virtual_stages", self.virtual_stages, 1, MAX_STAGES, where)
        if self.tokens_per_microbatch is not None:
            _int_field("tokens_per_microbatch", self.tokens_per_microbatch, 0, MAX_COUNT, where)
        for name in ("schedule", "case", "source"):
            if not isinstance(getattr(self, name), str):
                raise TraceError(f"{where}: {name} must be a string, got {_show(getattr(self, name))}")
        if not isinstance(self.config, dict):
            raise TraceError(f"{where}: config must be a JSON object, got {_show(self.config)}")
        model = self.config.get("model", {})
        if not isinstance(model, dict):
            raise TraceError(f"{where}: config.model must be a JSON object, got {_show(model)}")
        if model.get("seq_len") is not None:
            _int_field("config.model.seq_len", model["seq_len"], 0, MAX_COUNT, where)

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
    def from_record(cls, rec: StepRecord, where: str | None = None) -> "TraceStep":
        """From the run's record of the step (or a metrics.jsonl line read with `StepRecord.from_json`)."""
        where = where or f"metrics record of step {_show(rec.step)}"
        if not rec.layer_fwd_s or not rec.layer_bwd_s:
            raise TraceError(f"{where} lacks layer_fwd_s/layer_bwd_s: per-layer timing "
                             "is off (balance.profile = false?)")
        if not isinstance(rec.layer_fwd_s, list):
            raise TraceError(f"{where}: layer_fwd_s must be a list of numbers, got {_show(rec.layer_fwd_s)}")
        n = len(rec.layer_fwd_s)
        lists = {"fwd": rec.layer_fwd_s, "bwd": rec.layer_bwd_s, "wgrad": rec.layer_wgrad_s or None,
                 "state_bytes": rec.layer_state_bytes or None, "cost": rec.layer_cost_s or None}
        for name, v in lists.items():
            if v is not None:
                _times(name, v, n, where)
        if rec.microbatches and not is_int(rec.microbatches):
            raise TraceError(f"{where}: microbatches must be an integer, got {_show(rec.microbatches)}")
        if not is_int(rec.step):
            raise TraceError(f"{where}: step must be an integer, got {_show(rec.step)}")
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
        return _check_step(step, n, where)


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
    """TraceError naming the first field of a bad type, length or range."""
    if not is_int(s.step):
        raise TraceError(f"{where}: step must be an integer, got {_show(s.step)}")
    for name in ("fwd", "bwd", "wgrad", "state_bytes", "cost"):
        v = getattr(s, name)
        if v is None and name not in ("fwd", "bwd"):
            continue
        _times(name, v, n, where)
    if s.layout is not None:
        if not isinstance(s.layout, list) or not all(is_int(b) for b in s.layout) or len(s.layout) > n + 1:
            raise TraceError(f"{where}: layout must be null or a list of at most {n + 1} integer boundaries")
    for name in ("iteration_s", "step_s"):
        v = getattr(s, name)
        if v is not None and not (is_number(v) and _finite(v) and v >= 0):
            raise TraceError(f"{where}: {name} must be null or seconds (a finite number >= 0), got {_show(v)}")
    if not isinstance(s.events, list) or not all(isinstance(e, dict) for e in s.events):
        raise TraceError(f"{where}: events must be a list of JSON objects, got {_show(s.events)}")
    if not isinstance(s.stats, dict):
        raise TraceError(f"{where}: stats must be a JSON object of per-layer lists, got {_show(s.stats)}")
    for k, v in s.stats.items():
        if not isinstance(v, list) or len(v) != n:
            raise TraceError(f"{where}: stats[{k!r:.40}] must be a list with one entry per layer ({n})")
    if s.microbatches is not None:
        _int_field("microbatches", s.microbatches, 1, MAX_MICROBATCHES, where)
    return s


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def _length(name: str, v: Any, where: str) -> int:
    if not isinstance(v, list) or not v:
        raise TraceError(f"{where}: {name} must be a non-empty list, got {_show(v)}")
    if len(v) > MAX_LAYERS:
        raise TraceError(f"{where}: {len(v)} layers is over the limit MAX_LAYERS = {MAX_LAYERS}")
    return len(v)


def _int_field(name: str, v: Any, lo: int, hi: int, where: str) -> int:
    if not is_int(v):
        raise TraceError(f"{where}: {name} must be an integer, got {_show(v)}")
    if v < lo:
        raise TraceError(f"{where}: {name} must be >= {lo}, got {v}")
    if v > hi:
        raise TraceError(f"{where}: {name} = {v} is over the limit {hi}")
    return int(v)


def _ints(name: str, v: Any, n: int, where: str) -> list:
    """A list of n integers in [0, MAX_COUNT]."""
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} entries" if isinstance(v, list) else _show(v)
        raise TraceError(f"{where}: {name} must be a list of {n} integers (one per layer), got {got}")
    for i, x in enumerate(v):
        if not is_int(x) or not 0 <= x <= MAX_COUNT:
            raise TraceError(f"{where}: {name}[{i}] = {_show(x)}; give integers from 0 to 2^53")
    return v


def _times(name: str, v: Any, n: int, where: str) -> None:
    """A list of n finite numbers >= 0 (not booleans)."""
    if not isinstance(v, list):
        raise TraceError(f"{where}: {name} must be a list of {n} numbers (one per layer), got {_show(v)}")
    if len(v) != n:
        raise TraceError(f"{where}: {name} has {len(v)} values for {n} layers")
    if all(type(x) is float for x in v):
        a = np.asarray(v, dtype=float)
        if bool(np.isfinite(a).all()) and bool((a >= 0).all()):
            return
    for i, x in enumerate(v):
        if not is_number(x):
            raise TraceError(f"{where}: {name}[{i}] = {_show(x)} is not a number")
        if not (_finite(x) and x >= 0):
            raise TraceError(f"{where}: {name} times must be finite and >= 0; {name}[{i}] = {_show(x)}")


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
    """Read a trace file; a run folder (with metrics.jsonl) is converted on the fly.

    Every value is checked (TraceError naming the line and field), and the file must stay within
    MAX_TRACE_BYTES, MAX_TRACE_ITEMS, MAX_STEPS, MAX_LAYERS and MAX_TRACE_CELLS."""
    p = Path(path)
    if p.is_dir():
        return trace_from_metrics(p)
    header: TraceHeader | None = None
    steps: list[TraceStep] = []
    fields = set(TraceStep.__dataclass_fields__)
    for lineno, doc in _jsonl(p):
        where = f"{p} line {lineno}"
        if header is None:
            header = TraceHeader.from_dict(doc, where)
            continue
        if not isinstance(doc, dict):
            raise TraceError(f"{where}: a step must be a JSON object, got {_show(doc)}")
        missing = {"step", "fwd", "bwd"} - set(doc)
        if missing:
            raise TraceError(f"{where}: the step lacks {sorted(missing)}")
        kw = {k: v for k, v in doc.items() if k in fields and not (k in ("events", "stats") and v is None)}
        steps.append(_check_step(TraceStep(**kw), header.num_layers, where))
        check_size(len(steps), header.num_layers, where)
    if header is None:
        raise TraceError(f"{p} is empty")
    if not steps:
        raise TraceError(f"{p} has a header but no steps")
    return Trace(header, steps)


def check_size(steps: int, layers: int, where: str = "trace") -> None:
    """TraceError when a trace of this shape is over MAX_STEPS, MAX_LAYERS or MAX_TRACE_CELLS."""
    if steps > MAX_STEPS:
        raise TraceError(f"{where}: more than MAX_STEPS = {MAX_STEPS} steps; replay a slice of the run")
    if layers > MAX_LAYERS:
        raise TraceError(f"{where}: {layers} layers is over the limit MAX_LAYERS = {MAX_LAYERS}")
    if steps * layers > MAX_TRACE_CELLS:
        raise TraceError(f"{where}: {steps} steps x {layers} layers is over the limit MAX_TRACE_CELLS = "
                         f"{MAX_TRACE_CELLS}; replay fewer steps or fewer layers")


def _jsonl(p: Path):
    """(line number, parsed value) of each non-blank line, within MAX_TRACE_BYTES and MAX_TRACE_ITEMS."""
    try:
        f = open(p, "rb")
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot read trace {p}: {getattr(e, 'strerror', None) or e}") from None
    with f:
        budget, items, lineno = MAX_TRACE_BYTES, 0, 0
        while True:
            try:
                raw = f.readline(budget + 1)
            except OSError as e:
                raise TraceError(f"cannot read trace {p}: {e.strerror or e}") from None
            if not raw:
                return
            lineno += 1
            budget -= len(raw)
            if budget < 0:
                raise TraceError(f"{p} is larger than the limit MAX_TRACE_BYTES = {MAX_TRACE_BYTES} bytes "
                                 f"({MAX_TRACE_BYTES >> 20} MiB); replay a slice of the run")
            if not raw.strip():
                continue
            items += raw.count(b'"') // 2 + raw.count(b"[") + raw.count(b"{")
            if items > MAX_TRACE_ITEMS:
                raise TraceError(f"{p} has more than MAX_TRACE_ITEMS = {MAX_TRACE_ITEMS} strings, lists and "
                                 f"objects (by line {lineno}); replay a slice of the run")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{p} line {lineno} is not UTF-8 text; give a trace (JSON Lines)") from None
            try:
                yield lineno, loads(text, f"{p} line {lineno}")
            except InputError as e:
                raise TraceError(str(e)) from None


def trace_from_metrics(run_dir: str | Path, params: Iterable[int] | None = None) -> Trace:
    """Convert a finished (or running) run's `metrics.jsonl` + `config.toml` into a trace.

    Parameter counts come from `params` if given, else from the first step's `layer_params`
    (what the model had when the run started). The same checks and limits as `load_trace`."""
    d = Path(run_dir)
    mpath, cpath = d / "metrics.jsonl", d / "config.toml"
    if not mpath.is_file() or not cpath.is_file():
        raise TraceError(f"{d} is not a run folder: need metrics.jsonl and config.toml (written by dynmo train --out)")
    try:
        cfg = tomllib.loads(_small_text(cpath))
    except tomllib.TOMLDecodeError as e:
        raise TraceError(f"{cpath} is not valid TOML: {e}") from None
    first: StepRecord | None = None
    steps: list[TraceStep] = []
    for lineno, doc in _jsonl(mpath):
        where = f"{mpath} line {lineno}"
        if not isinstance(doc, dict):
            raise TraceError(f"{where}: a metrics line must be a JSON object, got {_show(doc)}")
        try:
            rec = StepRecord.from_json(doc)
        except TypeError as e:
            raise TraceError(f"{where}: not a metrics record ({e})") from None
        first = first or rec
        steps.append(TraceStep.from_record(rec, where))
        check_size(len(steps), len(steps[0].fwd), where)
    if first is None:
        raise TraceError(f"{mpath} has no steps yet")
    summary = {}
    if (d / "summary.json").is_file():
        try:
            summary = loads(_small_text(d / "summary.json"), str(d / "summary.json"))
        except InputError as e:
            raise TraceError(str(e)) from None
        if not isinstance(summary, dict):
            raise TraceError(f"{d / 'summary.json'} must be a JSON object")
    counts = list(params) if params is not None else first.layer_params
    if not counts:
        raise TraceError(f"{mpath} records no layer_params (a run of an older dynmo); pass params= explicitly")
    _ints("layer_params", counts, len(counts), f"{mpath} line 1")
    try:
        pp, dp = _run_shape(cfg, first, summary)
        header = TraceHeader.from_config(cfg, counts, pp, dp, source="metrics")
    except TraceError:
        raise
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        raise TraceError(f"{cpath}: a value has the wrong type or range for a dynmo config ({e})") from None
    header.check(str(cpath))
    n = header.num_layers
    for st in steps:
        if len(st.fwd) != n:
            raise TraceError(f"{mpath} step {st.step}: fwd has {len(st.fwd)} values for {n} layers")
    return Trace(header, steps)


def _small_text(path: Path) -> str:
    """A config or summary file, at most `dynmo.jsonio.MAX_INPUT_BYTES`."""
    try:
        data = read_bytes(str(path))
    except InputError as e:
        raise TraceError(str(e)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not UTF-8 text") from None


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
    if not is_int(blocks) or blocks < 1:
        raise TraceError(f"blocks must be an integer >= 1, got {_show(blocks)}")
    if blocks + 2 > MAX_LAYERS:
        raise TraceError(f"{blocks} blocks + 2 layers is over the limit MAX_LAYERS = {MAX_LAYERS}")
    check_size(len(trace.steps), blocks + 2, f"the trace scaled to {blocks} blocks")
    for name, v, hi in (("cost_scale", cost_scale, None), ("params_scale", params_scale, None),
                        ("noise", noise, MAX_NOISE)):
        if not is_number(v) or not _finite(v) or v < 0 or (name != "noise" and v == 0) or (hi and v > hi):
            rng = f"from 0 to {hi}" if hi else "> 0"
            raise TraceError(f"{name} must be a finite number {rng}, got {_show(v)}")
    if max(max(h.params), max(h.layer_bytes)) * params_scale > MAX_COUNT:
        raise TraceError(f"params_scale = {params_scale:g} makes a layer's parameters or bytes exceed 2^53; "
                         "use a smaller params_scale")
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
