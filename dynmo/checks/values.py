"""The numbers of a configuration: every float finite, the numeric fields of `RANGES` in range.

Part of `dynmo.checks` (validation before any process starts); import-light, no torch.
"""

from __future__ import annotations

import dataclasses
import math

from dynmo.config import Config, ConfigError

BACKENDS = ("auto", "gloo", "nccl")

# Numeric fields checked on every config, whatever is enabled: (field, bounds, what it is).
# Bounds: ge (>=), gt (>), le (<=), lt (<). Fields of the dynamic-model cases (prune, freeze,
# early_exit, noise) are checked by the cases' own check_options when enabled; the MoE and MoD
# options when their block is chosen; every float field, whatever its section, must be finite.
RANGES: tuple[tuple[str, dict, str], ...] = (
    ("model.dropout", {"ge": 0, "lt": 1}, "a probability"),
    ("data.val_fraction", {"ge": 0, "lt": 1}, "the fraction of the tokens held out for validation"),
    ("train.lr", {"ge": 0}, "the peak learning rate"),
    ("train.warmup_steps", {"ge": 0}, "steps of linear warm-up; 0 = none"),
    ("train.weight_decay", {"ge": 0}, "AdamW's decoupled weight decay"),
    ("train.beta1", {"ge": 0, "lt": 1}, "AdamW's decay of the gradient average"),
    ("train.beta2", {"ge": 0, "lt": 1}, "AdamW's decay of the squared-gradient average"),
    ("train.grad_clip", {"ge": 0}, "the largest global gradient norm; 0 = no clipping"),
    ("train.seed", {"ge": 0, "le": 2**32 - 1}, "a 32-bit seed"),
    ("train.eval_every", {"ge": 0}, "steps between validation losses; 0 = never"),
    ("train.eval_batches", {"ge": 1}, "batches per validation loss"),
    ("parallel.pp", {"ge": 0}, "pipeline ranks; 0 = world size / parallel.dp"),
    ("parallel.timeout_s", {"gt": 0}, "seconds an operation waits for a peer before the job fails"),
    ("balance.min_gain", {"ge": 0, "lt": 1}, "the fraction of the step time a rebalance must save"),
    ("balance.horizon", {"ge": 1}, "steps over which a rebalance must repay its migration"),
    ("balance.confidence", {"gt": 0.5, "lt": 1}, "how sure auto's evidence must be that a saving is not noise"),
    ("balance.confirm", {"ge": 0}, "fresh steps that must confirm a proposed move"),
    ("skew.factor", {"ge": 1}, "times the skewed blocks run their MLP; 1 = no skew"),
    ("skew.start_step", {"ge": 0}, "the first skewed step"),
    ("checkpoint.every", {"ge": 0}, "steps between checkpoints; 0 = only the final one"),
    ("checkpoint.keep", {"ge": 0}, "newest complete checkpoints kept; 0 = all"),
    ("log.every", {"ge": 1}, "steps between logged lines"),
)


def fmt(x) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    return f"{x:g}" if isinstance(x, float) else str(x)


def require(where: str, value, *, ge=None, gt=None, le=None, lt=None, why: str = "") -> None:
    """Raise ConfigError unless `value` lies within the bounds (NaN never does)."""
    ok = ((ge is None or value >= ge) and (gt is None or value > gt)
          and (le is None or value <= le) and (lt is None or value < lt))
    if ok:
        return
    if (ge is not None or gt is not None) and (le is not None or lt is not None):
        lo = f"[{fmt(ge)}" if ge is not None else f"({fmt(gt)}"
        hi = f"{fmt(le)}]" if le is not None else f"{fmt(lt)})"
        rule = f"in {lo}, {hi}"
    else:
        rule = next(f"{op} {fmt(b)}" for op, b in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if b is not None)
    raise ConfigError(f"{where}={fmt(value)} must be {rule}" + (f" ({why})" if why else ""))


def check_values(cfg: Config) -> None:
    """Every float of the config is finite, and the numeric fields of `RANGES` are in range."""

    def finite(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            v, where = getattr(obj, f.name), prefix + f.name
            if dataclasses.is_dataclass(v):
                finite(v, where + ".")
                continue
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, float) and not math.isfinite(x):
                    shown = fmt(x) if v is x else f"{v}: {fmt(x)}"
                    raise ConfigError(f"{where}={shown} is not a finite number")

    finite(cfg, "")
    for where, bounds, why in RANGES:
        obj = cfg
        for part in where.split("."):
            obj = getattr(obj, part)
        require(where, obj, **bounds, why=why)
    t = cfg.train
    require("train.min_lr", t.min_lr, ge=0, le=t.lr, why="the learning rate the cosine decay ends at, at most train.lr")
    if cfg.parallel.backend not in BACKENDS:
        raise ConfigError(f"unknown parallel.backend {cfg.parallel.backend!r}; choose one of {', '.join(BACKENDS)}")
