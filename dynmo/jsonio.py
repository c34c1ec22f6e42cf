"""JSON in and out for the pure CLIs (`dynmo balance`, `dynmo simulate`), and their input checks.

Input: a file path or `-` for stdin, at most `MAX_INPUT_BYTES` and `MAX_INPUT_ITEMS`, strict
JSON (no NaN or Infinity, no number that overflows a float). Output: `dumps` and `write_json`,
which refuse non-finite numbers instead of writing `Infinity`/`NaN` (not JSON). Bad input raises
`InputError` with a one-line message that says what is wrong and what to do; the CLIs print
it as `dynmo VERB: error: MESSAGE` and exit 2 (`fail`).
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from typing import Any

# A parsed JSON document can take up to ~40x its size in Python objects (`[[[]]],` repeated)
# but only ~8x when it is mostly numbers. 32 MiB holds 10^5 layers or 10^6 stage times many
# times over; at most MAX_INPUT_ITEMS strings, lists and objects (counted on the text before
# parsing, as `"` / 2 plus `[` and `{`) keep the parsed worst case near 0.3 GB.
MAX_INPUT_BYTES = 32 * 2**20
MAX_INPUT_ITEMS = 1_000_000

EXIT_BAD_INPUT = 2


class InputError(ValueError):
    """Bad input to a pure CLI; the message (one line) says what is wrong and how to fix it."""


class NonFiniteError(InputError):
    """A result is not a finite number (the inputs overflow float64)."""


def _reject_constant(name: str) -> Any:
    raise InputError(f"{name} is not a JSON number; give a finite number")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise InputError(f"the number {text[:40]} overflows a 64-bit float; rescale the values")
    return x


def loads(text: str, where: str) -> Any:
    """Strict JSON from `text`; `where` names the source in the error message."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{where} is not valid JSON: {e}") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    except ValueError:  # an integer literal with more digits than Python converts (4300)
        raise InputError(f"{where}: an integer has too many digits; write large numbers as floats (1e30)") from None


def read_bytes(path: str, max_bytes: int | None = None) -> bytes:
    """The bytes of `path` (or stdin for "-"), refusing more than `max_bytes` (MAX_INPUT_BYTES)."""
    max_bytes = MAX_INPUT_BYTES if max_bytes is None else max_bytes
    try:
        if path == "-":
            data = sys.stdin.buffer.read(max_bytes + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(max_bytes + 1)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise InputError(f"{path} is larger than the limit MAX_INPUT_BYTES = {max_bytes} bytes "
                         f"({max_bytes / 2**20:g} MiB); give a smaller file")
    return data


def read_text(path: str, max_bytes: int | None = None) -> str:
    """The text of `path` (or stdin for "-"), refusing more than `max_bytes` (MAX_INPUT_BYTES) bytes
    or MAX_INPUT_ITEMS strings, lists and objects."""
    data = read_bytes(path, max_bytes)
    items = data.count(b'"') // 2 + data.count(b"[") + data.count(b"{")
    if items > MAX_INPUT_ITEMS:
        raise InputError(f"{path} has more than MAX_INPUT_ITEMS = {MAX_INPUT_ITEMS} strings, lists and objects; "
                         "give numbers as flat lists")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (byte {e.start}); give a JSON file") from None


def read_json(path: str, max_bytes: int | None = None) -> Any:
    """Parsed JSON from `path` (or stdin for "-"); InputError (a ValueError) with a one-line reason."""
    return loads(read_text(path, max_bytes), path)


def dumps(obj: Any, **kw: Any) -> str:
    """json.dumps that refuses NaN and infinities (NonFiniteError) instead of writing invalid JSON."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        raise NonFiniteError("a result is not a finite number") from None


def write_json(obj: Any, indent: int | None = None, stream: Any = None) -> None:
    """Write `obj` as strict JSON and a newline to `stream` (stdout) in pieces of ~64 KB, so a
    large document is never held as one string (json.dumps with an indent holds every piece
    in a list first). NonFiniteError at the first NaN or infinity: check the document before
    writing when a partial output must not happen."""
    stream = sys.stdout if stream is None else stream
    buf: list[str] = []
    size = 0
    try:
        for chunk in json.JSONEncoder(allow_nan=False, indent=indent).iterencode(obj):
            buf.append(chunk)
            size += len(chunk)
            if size >= 1 << 16:
                stream.write("".join(buf))
                buf, size = [], 0
    except ValueError:
        raise NonFiniteError("a result is not a finite number") from None
    stream.write("".join(buf) + "\n")


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def fail(prog: str, msg: Any) -> int:
    """Print `prog: error: msg` as one line on stderr; return the bad-input exit code (2)."""
    print(f"{prog}: error: {_one_line(msg)}", file=sys.stderr)
    return EXIT_BAD_INPUT


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises InputError (one line) instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise InputError(f"{message} (see {self.prog} --help)")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or an exit code: 0 after --help, 2 after a usage error (printed)."""
    try:
        return parser.parse_args(argv)
    except InputError as e:
        return fail(parser.prog, e)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0


# ---- checks of parsed values (JSON or command line) ---------------------------------------


def is_int(v: Any) -> bool:
    """A true integer (numpy's too): not a bool, not a float (2.0 and 2.5 are not integers here)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An integer or a float (numpy's too), not a bool; finiteness is not checked."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def integer(name: str, v: Any, lo: int | None = None, hi: int | None = None, *, limit: str = "") -> int:
    """`v` as an int in [lo, hi]; InputError naming `name` otherwise.

    `limit` names the constant behind `hi` (e.g. "MAX_STAGES") for the message."""
    if not is_int(v):
        kind = "a boolean" if isinstance(v, bool) else _show(v)
        raise InputError(f"{name} must be an integer, got {kind}")
    v = int(v)
    if lo is not None and v < lo:
        raise InputError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        what = f"the limit {limit} = {hi}" if limit else f"the limit {hi}"
        raise InputError(f"{name} = {v} is over {what}; use a smaller value")
    return v


def number(name: str, v: Any, lo: float | None = 0.0, hi: float | None = None, *, positive: bool = False,
           allow_inf: bool = False) -> float:
    """`v` as a finite float >= lo (> 0 with positive) and <= hi; InputError otherwise."""
    if not is_number(v):
        kind = "a boolean" if isinstance(v, bool) else _show(v)
        raise InputError(f"{name} must be a number, got {kind}")
    try:
        x = float(v)
    except OverflowError:
        raise InputError(f"{name} = {_show(v)} overflows a 64-bit float; rescale it") from None
    if math.isnan(x) or (math.isinf(x) and not (allow_inf and x > 0)):
        raise InputError(f"{name} must be a finite number, got {x}")
    if positive and not x > 0:
        raise InputError(f"{name} must be > 0, got {x}")
    if lo is not None and x < lo:
        raise InputError(f"{name} must be >= {lo:g}, got {x:g}")
    if hi is not None and x > hi:
        raise InputError(f"{name} must be <= {hi:g}, got {x:g}")
    return x


def choice(name: str, v: Any, options: tuple[str, ...] | list[str]) -> str:
    if not isinstance(v, str) or v not in options:
        raise InputError(f"{name} must be one of {', '.join(options)}; got {_show(v)}")
    return v
