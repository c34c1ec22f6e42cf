"""What a `dynmo tensor` command will need, against what the machine has, before any work.

One estimator for `generate`, `features`, `convert` and `dataset`; the machine is read
through `dynmo.machine` (available memory, free disk; both can be injected for tests). A
request that cannot fit is refused with one line naming the need, what the machine has and
the option that helps; nothing is written. A gzip input's size is not known before it is
read: it is not checked.

Memory (bytes of arrays at the peak, beside the interpreter):

- `generate` in memory: per nonzero its coordinates (`order` int32 or int64), its value
  (float64) and its last-mode index as drawn (int64, with the draw's equal-sized scratch);
  per fiber and per slice the counts and indices (`stream.fixed_bytes`); writing adds a few
  blocks of text only. With `--memory-gb G`: the counts and one block
  (`stream.fixed_bytes` + `BLOCK_NNZ x BYTES_PER_NNZ`), at most G.
- `features` in memory: the coordinates read (`order` int32 per nonzero) and the per-mode
  sort the counts need (an int64 key and its order per nonzero); the nonzeros are counted
  from the file's size and its first lines. With `--memory-gb G`: G (DuckDB's limit).
- `convert`: G.

Disk: a `.tns` line is fixed-width (`tns._lines`: each index right-aligned to its size's
digits, a space after each, the value, the newline), so a generated tensor's text is exactly
nnz x line bytes (gzip: not known before it is written; not checked). DuckDB's table of a
`--memory-gb` run (`features`, `convert`) may spill up to its whole size under `--tmp`: 8
bytes per column per nonzero (with the values for `convert`), and `convert` writes about
as much again as Parquet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dynmo import machine
from dynmo.jsonio import InputError
from dynmo.tensor.generate import GenerateError, Plan, Request, plan
from dynmo.tensor.stream import BLOCK_NNZ, BYTES_PER_NNZ, fixed_bytes

GiB = 2**30
SAMPLE = 1 << 16  # bytes of a .tns file read to count its bytes per line


class BudgetError(InputError):
    """A request that cannot fit: one line, with the figures and the way out."""


@dataclass
class Need:
    memory: int  # bytes of arrays at the peak
    disk: int  # bytes written (output and temporary files)
    where: Path  # the folder the disk figure is checked on
    memory_fix: str  # the option that lowers the memory
    disk_fix: str  # the option that lowers the disk


def _size(x: float) -> str:
    for unit, scale in (("TB", 2**40), ("GB", GiB), ("MB", 2**20)):
        if x >= scale or unit == "MB":
            v = x / scale
            return f"{v:.3g} {unit}" if v >= 1e4 else f"{v:.1f} {unit}" if unit != "GB" else f"{v:.2f} GB"
    raise AssertionError


def line_bytes(sizes: tuple[int, ...], whole: bool) -> int:
    """Bytes of one `.tns` line as `tns.write_tns` and `stream.generate_to` write it."""
    return sum(len(str(int(s))) for s in sizes) + len(sizes) + (2 if whole else 13) + 1


def generate_need(p: Plan, sizes: tuple[int, ...], values: str, memory_gb: float | None, out: str) -> Need:
    order = len(sizes)
    if memory_gb is None:
        idx = 4 if max(sizes) < 2**31 else 8
        mem = p.nnz * (order * idx + 8 + 2 * 8) + fixed_bytes(p, order)
        fix = "--memory-gb G to write it block by block"
    else:
        mem = min(fixed_bytes(p, order) + BLOCK_NNZ * BYTES_PER_NNZ, int(memory_gb * GiB))
        fix = "smaller --sizes or --density"
    text = 0 if out.endswith(".gz") else p.nnz * line_bytes(sizes, values == "ones")
    return Need(mem, text, Path(out).resolve().parent, fix, "smaller --sizes or --density, or .gz output")


def _sample(path: Path) -> tuple[int, int]:
    """(nonzeros, order) of a .tns file from its size and its first lines; (0, 0) if unknown."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(SAMPLE)
    except OSError:
        return 0, 0
    if head[:2] == b"\x1f\x8b":
        return 0, 0  # gzip: its text's size is not known before it is read
    rows = [r.split() for r in head.split(b"\n")[:-1] if r.strip() and not r.lstrip().startswith(b"#")]
    if not rows:
        return 0, 0
    order = max(len(r) for r in rows) - 1
    return int(size / (len(head) / max(1, head.count(b"\n")))), order


def read_need(path: str, memory_gb: float | None, tmp: str | None, out: str | None = None) -> Need:
    """`features` (out None) or `convert` (out the Parquet file, with the values) of the .tns file `path`."""
    p = Path(path)
    nnz, order = _sample(p) if p.suffix != ".parquet" else (0, 0)
    cols = order + (1 if out else 0)
    if memory_gb is None:
        return Need(nnz * (4 * order + 16), 0, Path.cwd(), "--memory-gb G to count it out of core", "")
    where = Path(tmp) if tmp else (Path(out).resolve().parent if out else Path.cwd())
    disk = nnz * 8 * cols * (2 if out else 1)
    return Need(int(memory_gb * GiB), disk, where, "a smaller --memory-gb",
                "--tmp DIR on a larger disk" + (", or OUT there" if out else ""))


def check(need: Need, what: str) -> None:
    """BudgetError (one line) when `need` exceeds the available memory or the free disk."""
    avail = machine.memory_available()
    if avail is not None and need.memory > avail:
        raise BudgetError(f"{what} needs about {_size(need.memory)} of memory but {_size(avail)} is available; "
                          f"use {need.memory_fix}")
    if need.disk:
        free = machine.disk_free(need.where)
        if free is not None and need.disk > free:
            raise BudgetError(f"{what} writes about {_size(need.disk)} but {need.where} has {_size(free)} free; "
                              f"use {need.disk_fix}")


def check_generate(r: Request, memory_gb: float | None, out: str) -> None:
    """`dynmo tensor generate`: the request planned and checked (GenerateError's text as BudgetError).
    A --memory-gb that is not positive is left to the command's own message."""
    if memory_gb is not None and not memory_gb > 0:
        return
    try:
        p = plan(r)
    except GenerateError as e:
        raise BudgetError(str(e)) from None
    check(generate_need(p, tuple(int(x) for x in r.sizes), r.values, memory_gb, out), "this tensor")


def check_read(path: str, memory_gb: float | None, tmp: str | None, out: str | None = None) -> None:
    """`dynmo tensor features` (out None) or `convert` of `path`."""
    check(read_need(path, memory_gb, tmp, out), f"{'converting' if out else 'reading'} {path}")


def check_dataset(todo: list[dict], out: str) -> None:
    """`dynmo tensor dataset`: its largest generated tensor in memory, all of them on disk."""
    needs = [generate_need(plan(j["request"]), j["request"].sizes, j["request"].values, None, str(Path(out) / "t.tns"))
             for j in todo if "request" in j]
    if needs:
        check(Need(max(n.memory for n in needs), sum(n.disk for n in needs), Path(out).resolve(),
                   "a grid of smaller tensors", "a smaller grid or another --out"), "this dataset")
