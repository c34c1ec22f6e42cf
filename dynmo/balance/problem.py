"""A balancing problem: per-layer costs and memory, per-stage capacity, speed and transfer cost.

Load model (used by every balancer, the result and the docs):

    stage load L_j = (sum of c_i over the layers of stage j) / s_j + t_j
    t_j = f_j + b_(j-1)

where s_j is the speed of the worker running stage j (1 when workers are equal), f_j
(`transfer`) is the time stage j spends sending one microbatch's activations to stage j+1
(0 for the last stage) and b_j (`transfer_back`) the time stage j+1 spends sending its
gradient back to stage j (b_(-1) = 0). Each direction is charged to the stage that sends,
because in 1F1B-style schedules a send sits on the sender's critical path: a slow link in
both directions weighs on both of its ends. Without `transfer_back`, `transfer` is the whole
round trip charged to the sender.

Where the cut sits. By default neither time depends on where the boundary is (whole blocks all
emit activations of the same shape), so t_j shifts stage j's load by a constant. A boundary
between a block's two halves ships more (the block's carry beside the hidden state and the
mask): `cut_factor[i]` is the bytes crossing the cut after layer i over the bytes `transfer`
prices, and a link carries f_j x r(b_(j+1)) forward and b_j x r(b_(j+1)) back, b_(j+1) being
the first layer of stage j+1 (r(b) = cut_factor[b - 1]):

    t_j = f_j x r(b_(j+1)) + b_(j-1) x r(b_j)

which depends on the layout, so the exact solver for it is another (cuts.py). Factors that are
all 1, or links that cost nothing, leave the problem as it is without them, bit for bit.

Memory: stage j may hold layers whose memory m_i sums to at most capacity M_j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from dynmo.jsonio import is_int, is_number
from dynmo.layout import Layout, LayoutError

# Two loads (or memory sums) that differ by less than EPS x (total cost or total memory) are
# treated as equal. Prefix sums in float64 carry rounding error of about n ulps of the total;
# 1e-9 is far above that and far below anything that matters for a schedule.
EPS = 1e-9


class BalanceError(ValueError):
    """Bad input or an infeasible balancing problem. The message says what to change."""


@dataclass(frozen=True)
class Problem:
    costs: Sequence[float]
    stages: int
    memory: Sequence[float] | None = None
    capacity: float | Sequence[float] | None = None
    speeds: Sequence[float] | None = None
    transfer: float | Sequence[float] | None = None
    transfer_back: float | Sequence[float] | None = None
    current: Sequence[int] | None = None
    cut_factor: Sequence[float] | None = None  # per cut after layer i (n - 1): its bytes over transfer's
    # normalized numpy views, filled by __post_init__
    c: np.ndarray = field(init=False, repr=False, compare=False)
    m: np.ndarray = field(init=False, repr=False, compare=False)
    cap: np.ndarray = field(init=False, repr=False, compare=False)
    s: np.ndarray = field(init=False, repr=False, compare=False)
    t: np.ndarray = field(init=False, repr=False, compare=False)
    tf: np.ndarray = field(init=False, repr=False, compare=False)  # per link: forward transfer
    tb: np.ndarray = field(init=False, repr=False, compare=False)  # per link: backward transfer
    # per boundary position b = 0..n: the factor of a cut there (r[0] = r[n] = 1, never read);
    # None when every cut costs the same (no factors, all 1, or links that cost nothing)
    r: np.ndarray | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.stages
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise BalanceError(f"stages must be an integer, got {p!r:.40}")
        p = int(p)
        object.__setattr__(self, "stages", p)
        if p < 1:
            raise BalanceError(f"need at least 1 stage, got stages={p}")
        c = _vector("costs", self.costs, None, allow_zero=True)
        n = len(c)
        if n == 0:
            raise BalanceError("costs is empty: give one cost per layer")
        if n < p:
            raise BalanceError(
                f"cannot split {n} layers into {p} non-empty stages; use at most {n} stages"
            )
        m = np.zeros(n) if self.memory is None else _vector("memory", self.memory, n, allow_zero=True)
        if self.capacity is None:
            cap = np.full(p, math.inf)
        else:
            cap = _scalar_or_vector("capacity", self.capacity, p, allow_inf=True)
            if self.memory is None:
                raise BalanceError("capacity is given but memory is not: give per-layer memory too")
        s = np.ones(p) if self.speeds is None else _vector("speeds", self.speeds, p, allow_zero=False)
        tf, tb = np.zeros(p - 1), np.zeros(p - 1)
        if self.transfer is not None and p > 1:
            tf = _scalar_or_vector("transfer", self.transfer, p - 1, allow_zero=True)
        if self.transfer_back is not None and p > 1:
            tb = _scalar_or_vector("transfer_back", self.transfer_back, p - 1, allow_zero=True)
        t = np.zeros(p)
        t[: p - 1] += tf
        t[1:] += tb
        if self.current is not None:
            bounds = _int_list("current", self.current)
            try:
                cur = Layout(bounds)
            except (LayoutError, TypeError, ValueError) as e:
                raise BalanceError(f"current layout {list(bounds)!r:.200} is invalid: {e}") from None
            if cur.num_layers != n or cur.num_stages != p:
                raise BalanceError(
                    f"current layout {list(cur.boundaries)} has {cur.num_stages} stages over "
                    f"{cur.num_layers} layers; the problem has {p} stages over {n} layers"
                )
            object.__setattr__(self, "current", list(cur.boundaries))
        r = None
        if self.cut_factor is not None:
            f = _vector("cut_factor", self.cut_factor, n - 1, allow_zero=True)
            if p > 1 and (tf.any() or tb.any()) and not bool(np.all(f == 1.0)):
                r = np.concatenate(([1.0], f, [1.0]))
                r.setflags(write=False)
        _check_overflow(c, m, s, t if r is None else t * float(r.max()))
        for name, v in (("c", c), ("m", m), ("cap", cap), ("s", s), ("t", t), ("tf", tf), ("tb", tb)):
            v.setflags(write=False)
            object.__setattr__(self, name, v)
        object.__setattr__(self, "r", r)

    # ---- derived -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.c)

    @property
    def current_layout(self) -> Layout:
        """The current layout, or the uniform one (Megatron's default) when none is given."""
        if self.current is None:
            return Layout.uniform(self.num_layers, self.stages)
        return Layout(tuple(self.current))

    def loads_of_assignment(self, owner: Sequence[int]) -> list[float]:
        """Stage loads for any layer -> stage assignment (contiguous or not). With cut factors
        link j's cut is the first layer of stage j+1 (a layout's boundary b_(j+1); the paper's
        non-contiguous diffusion has no single cut, and is charged there too)."""
        own = np.asarray(owner)
        sums = np.bincount(own, weights=self.c, minlength=self.stages)
        if self.r is None:
            return (sums / self.s + self.t).tolist()
        first = np.full(self.stages, self.num_layers)
        np.minimum.at(first, own, np.arange(len(own)))
        return (sums / self.s + self.link_times(first[1:])).tolist()

    def link_times(self, cuts: Sequence[int]) -> np.ndarray:
        """t_j per stage when link j's cut is at boundary position cuts[j] (the first layer of
        stage j+1): each link's forward time charged to stage j, its backward time to stage
        j+1, both x the cut's factor (module docstring)."""
        p = self.stages
        if self.r is None or p < 2:
            return self.t
        k = self.r[np.asarray(cuts, dtype=np.int64)]
        t = np.zeros(p)
        t[: p - 1] += self.tf * k
        t[1:] += self.tb * k
        return t

    def memory_of_assignment(self, owner: Sequence[int]) -> list[float]:
        return np.bincount(np.asarray(owner), weights=self.m, minlength=self.stages).tolist()

    def with_stages(self, workers: Sequence[int], current_owner: Sequence[int] | None = None) -> "Problem":
        """The same layers on a subset of the workers (kept in pipeline order).

        Stage j of the sub-problem runs on worker workers[j]; it inherits that worker's
        capacity, speed and the transfer costs of its outgoing link, except that the last stage
        sends nothing forward.
        """
        w = list(workers)
        cap = None if self.capacity is None else [float(self.cap[i]) for i in w]
        t = [float(self.tf[i]) for i in w[:-1]]
        tb = [float(self.tb[i]) for i in w[:-1]]
        return Problem(
            costs=self.c.tolist(),
            stages=len(w),
            memory=None if self.memory is None else self.m.tolist(),
            capacity=cap,
            speeds=[float(self.s[i]) for i in w],
            transfer=t if t else None,
            transfer_back=tb if tb and any(tb) else None,
            cut_factor=None if self.r is None else self.r[1:-1].tolist(),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Problem":
        if not isinstance(d, dict):
            raise BalanceError("problem JSON must be an object with keys costs, stages, ...")
        known = {"costs", "stages", "memory", "capacity", "speeds", "transfer", "transfer_back", "current",
                 "cut_factor"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise BalanceError(f"unknown problem keys {unknown}; known keys are {sorted(known)}")
        for key in ("costs", "stages"):
            if key not in d:
                raise BalanceError(f"problem JSON is missing {key!r}")
        return cls(**{k: d[k] for k in known if k in d and d[k] is not None})


def cut_factors(boundary_bytes: Sequence[float] | None) -> list[float] | None:
    """`Problem.cut_factor` from the bytes of one microbatch crossing each cut (after layer i):
    each over the smallest, the hidden state and mask of a cut between blocks, which is what a
    link's measured time prices. None without bytes."""
    if not boundary_bytes:
        return None
    b = _vector("boundary_bytes", boundary_bytes, None, allow_zero=False)
    return (b / float(b.min())).tolist()


def _vector(name: str, values: Any, n: int | None, *, allow_zero: bool) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype.kind in "fiu":
        if values.ndim != 1:
            raise BalanceError(f"{name} must be a flat list of numbers")
        a = values.astype(np.float64)
    else:
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
            raise BalanceError(f"{name} must be a list of numbers, got {values!r:.80}")
        vals = list(values)
        for i, x in enumerate(vals):
            if type(x) is not float and type(x) is not int and not is_number(x):
                if isinstance(x, (list, tuple)):
                    raise BalanceError(f"{name} must be a flat list of numbers; {name}[{i}] is a list")
                raise BalanceError(f"{name}[{i}] = {x!r:.40} is not a number; give one number per entry")
        try:
            a = np.asarray(vals, dtype=np.float64)
        except OverflowError:
            raise BalanceError(f"{name} has an integer too large for a 64-bit float; rescale the values") from None
    if n is not None and len(a) != n:
        raise BalanceError(f"{name} has {len(a)} entries, expected {n}")
    bad = ~np.isfinite(a) | (a < 0) | ((a == 0) & (not allow_zero))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        need = "finite and >= 0" if allow_zero else "finite and > 0"
        raise BalanceError(f"{name}[{i}] = {float(a[i])!r}; every entry must be {need}")
    return a


def _scalar_or_vector(name: str, value: Any, n: int, *, allow_zero: bool = False,
                      allow_inf: bool = False) -> np.ndarray:
    if is_number(value):
        try:
            v = float(value)
        except OverflowError:
            v = math.inf
        ok = (v >= 0 if allow_zero else v > 0) and (math.isfinite(v) or (allow_inf and v == math.inf))
        if not ok:
            raise BalanceError(f"{name} = {value!r:.40}; it must be a finite number {'>= 0' if allow_zero else '> 0'}")
        return np.full(n, v)
    return _vector(name, value, n, allow_zero=allow_zero)


def _int_list(name: str, values: Any) -> tuple[int, ...]:
    """Integers only: 2.5 (and 2.0, and true) are refused, never truncated."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return tuple(int(x) for x in values.ravel())
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise BalanceError(f"{name} must be a list of integers (layer boundaries), got {values!r:.80}")
    out = []
    for i, x in enumerate(values):
        if not is_int(x):
            raise BalanceError(f"{name}[{i}] = {x!r:.40} is not an integer; boundaries are layer indices "
                               f"like [0, 12, 24]")
        out.append(int(x))
    return tuple(out)


def _check_overflow(c: np.ndarray, m: np.ndarray, s: np.ndarray, t: np.ndarray) -> None:
    """Every load, every sum of loads and of memory must stay a finite float64."""
    with np.errstate(all="ignore"):
        worst = float(c.sum()) / float(s.min()) + float(t.sum()) if len(s) else float(c.sum())
        mem = float(m.sum())
    if not math.isfinite(worst):
        raise BalanceError("the costs overflow: their total (divided by the slowest speed, plus the transfer "
                           "costs) is not a finite 64-bit float; rescale them (e.g. to milliseconds)")
    if not math.isfinite(mem):
        raise BalanceError("the memory sizes overflow: their total is not a finite 64-bit float; "
                           "rescale them (e.g. to MB)")
