"""Bounded readers of the files a trace comes from: JSON Lines and small text files."""

from __future__ import annotations

from pathlib import Path

from dynmo.jsonio import InputError, loads, read_bytes
from dynmo.sim.trace import limits
from dynmo.sim.trace.limits import TraceError


def jsonl(p: Path):
    """(line number, parsed value) of each non-blank line, within MAX_TRACE_BYTES and MAX_TRACE_ITEMS."""
    try:
        f = open(p, "rb")
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot read trace {p}: {getattr(e, 'strerror', None) or e}") from None
    with f:
        budget, items, lineno = limits.MAX_TRACE_BYTES, 0, 0
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
                raise TraceError(f"{p} is larger than the limit MAX_TRACE_BYTES = {limits.MAX_TRACE_BYTES} bytes "
                                 f"({limits.MAX_TRACE_BYTES >> 20} MiB); replay a slice of the run")
            if not raw.strip():
                continue
            items += raw.count(b'"') // 2 + raw.count(b"[") + raw.count(b"{")
            if items > limits.MAX_TRACE_ITEMS:
                raise TraceError(f"{p} has more than MAX_TRACE_ITEMS = {limits.MAX_TRACE_ITEMS} strings, lists and "
                                 f"objects (by line {lineno}); replay a slice of the run")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{p} line {lineno} is not UTF-8 text; give a trace (JSON Lines)") from None
            try:
                yield lineno, loads(text, f"{p} line {lineno}")
            except InputError as e:
                raise TraceError(str(e)) from None


def small_text(path: Path) -> str:
    """A config or summary file, at most `dynmo.jsonio.MAX_INPUT_BYTES`."""
    try:
        data = read_bytes(str(path))
    except InputError as e:
        raise TraceError(str(e)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not UTF-8 text") from None
