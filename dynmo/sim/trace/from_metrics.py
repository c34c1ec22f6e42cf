"""A run folder's `metrics.jsonl` + `config.toml` (+ `summary.json`) turned into a trace."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Iterable

from dynmo.jsonio import InputError, is_int, loads
from dynmo.record import StepRecord
from dynmo.sim.trace.costs import Trace
from dynmo.sim.trace.files import jsonl, small_text
from dynmo.sim.trace.format import TraceHeader, TraceStep
from dynmo.sim.trace.limits import TraceError, check_size
from dynmo.sim.trace.values import ints, show


def trace_from_metrics(run_dir: str | Path, params: Iterable[int] | None = None) -> Trace:
    """Convert a finished (or running) run's `metrics.jsonl` + `config.toml` into a trace.

    Parameter counts come from `params` if given, else from the first step's `layer_params`
    (what the model had when the run started); the bytes crossing each cut (`boundary_bytes`)
    from the first migration event that records what the controller priced, else none. The
    same checks and limits as `load_trace`."""
    d = Path(run_dir)
    mpath, cpath = d / "metrics.jsonl", d / "config.toml"
    if not mpath.is_file() or not cpath.is_file():
        raise TraceError(f"{d} is not a run folder: need metrics.jsonl and config.toml (written by dynmo train --out)")
    try:
        cfg = tomllib.loads(small_text(cpath))
    except tomllib.TOMLDecodeError as e:
        raise TraceError(f"{cpath} is not valid TOML: {e}") from None
    first: StepRecord | None = None
    steps: list[TraceStep] = []
    for lineno, doc in jsonl(mpath):
        where = f"{mpath} line {lineno}"
        if not isinstance(doc, dict):
            raise TraceError(f"{where}: a metrics line must be a JSON object, got {show(doc)}")
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
            summary = loads(small_text(d / "summary.json"), str(d / "summary.json"))
        except InputError as e:
            raise TraceError(str(e)) from None
        if not isinstance(summary, dict):
            raise TraceError(f"{d / 'summary.json'} must be a JSON object")
    counts = list(params) if params is not None else first.layer_params
    if not counts:
        raise TraceError(f"{mpath} records no layer_params (a run of an older dynmo); pass params= explicitly")
    ints("layer_params", counts, len(counts), f"{mpath} line 1")
    try:
        pp, dp = run_shape(cfg, first, summary)
        header = TraceHeader.from_config(cfg, counts, pp, dp, source="metrics")
    except TraceError:
        raise
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        raise TraceError(f"{cpath}: a value has the wrong type or range for a dynmo config ({e})") from None
    header.boundary_bytes = recorded_boundary_bytes(steps, header.num_layers)
    header.check(str(cpath))
    n = header.num_layers
    for st in steps:
        if len(st.fwd) != n:
            raise TraceError(f"{mpath} step {st.step}: fwd has {len(st.fwd)} values for {n} layers")
    return Trace(header, steps)


def recorded_boundary_bytes(steps: list[TraceStep], n: int) -> list[int] | None:
    """The per-cut bytes the run's controller priced, as its first migration event that has them
    records them (one integer >= 1 per cut between the n layers); None when no event does."""
    for st in steps:
        for e in st.events:
            v = e.get("boundary_bytes") if isinstance(e, dict) else None
            if isinstance(v, list) and len(v) == n - 1 and all(is_int(x) and x >= 1 for x in v):
                return [int(x) for x in v]
    return None


def run_shape(cfg: dict, rec: StepRecord, summary: dict) -> tuple[int, int]:
    """pp and dp the run started with (a re-pack shrinks pp later; summary.json has the final one)."""
    par = cfg.get("parallel", {})
    dp = int(par.get("dp") or summary.get("dp") or 1)
    pp = int(par.get("pp") or 0) or len(rec.worker_compute_s or [])
    if not pp:
        v = int(par.get("virtual_stages") or 1)
        pp = (len(rec.layout) - 1) // v
    return pp, dp
