"""What the benchmark reads from a real run's metrics records: throughput, worker-seconds, overhead, the oracle bound, profile-once."""

from __future__ import annotations

import statistics

from dynmo.balance import Problem, balance
from dynmo.layout import Layout
from dynmo.sim.replay import PROFILE_STEPS, profile_costs, profile_once_layout


def overhead_s(recs: list[dict]) -> float:
    """Profiler bookkeeping + deciding + migrating, seconds."""
    mig = [e for r in recs for e in r["events"] if e["type"] == "migration"]
    return sum(r.get("profile_s", 0.0) for r in recs) + sum(e.get("decide_s", 0.0) + e["seconds"] for e in mig)


def throughput(recs: list[dict]) -> float:
    """Tokens/s over all steps but the first (one-off set-up), migrations included."""
    rest = recs[1:] or recs
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in rest)
    return tokens / sum(r["step_s"] for r in rest)


def worker_seconds(recs: list[dict]) -> float:
    """Sum over steps (all but the first) of the step's wall time x its active workers."""
    return sum(r["step_s"] * r.get("workers", 2) for r in recs[1:] or recs)


def per_worker(recs: list[dict]) -> float:
    """Tokens per worker-second: the same training on fewer workers scores higher."""
    rest = recs[1:] or recs
    return sum(r["tokens_per_s"] * r["step_s"] for r in rest) / worker_seconds(recs)


def oracle_bound(recs: list[dict]) -> float:
    """Sum over steps of the run's bottleneck / the best contiguous bottleneck (measured costs)."""
    static, best = 0.0, 0.0
    for r in recs[1:] or recs:
        costs = r["layer_cost_s"]
        lay = Layout(tuple(r["layout"]))
        static += max(lay.stage_loads(costs))
        best += balance(Problem(costs=costs, stages=lay.num_stages), "optimal").bottleneck
    return static / best if best > 0 else float("nan")


def profile_once_of(recs: list[dict]) -> list[int]:
    """The replay's profile-once policy on a real run: the optimal layout for the median per-layer
    costs the profiler measured on the first steps after warm-up."""
    costs = profile_costs([r["layer_cost_s"] for r in recs], PROFILE_STEPS)
    return list(profile_once_layout(costs, Layout(tuple(recs[0]["layout"])).num_stages).boundaries)


def final_val(recs: list[dict]) -> float | None:
    vals = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    return vals[-1] if vals else None


def median_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """(median, low, high, coverage): the median of paired ratios and a distribution-free interval
    for it from order statistics, the narrowest pair (x_(k), x_(n+1-k)) whose exact binomial
    coverage, 1 - 2 P(Binomial(n, 1/2) < k), is at least `level`. With fewer than 6 pairs no such
    pair reaches 95%: the interval is then (min, max) and `coverage` says what it covers."""
    from math import comb

    x = sorted(ratios)
    n = len(x)
    med = statistics.median(x)
    k, coverage = 1, 1 - 2 * 0.5**n
    while k + 1 <= (n + 1) // 2:
        tail = sum(comb(n, i) for i in range(k + 1)) / 2**n  # P(B < k + 1)
        if 1 - 2 * tail < level:
            break
        k, coverage = k + 1, 1 - 2 * tail
    return med, x[k - 1], x[n - k], coverage


def verdict(low: float, high: float) -> str:
    """What a paired interval says: faster, slower, or no measurable difference (it holds 1.0)."""
    if low > 1.0:
        return "faster"
    if high < 1.0:
        return "slower"
    return "no measurable difference"
