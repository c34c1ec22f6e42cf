"""`auto`'s evidence that a move is real and not noise: the gain on each step of the window, then on fresh steps.

The test. Each observed step k gives the relative saving g_k of the proposed layout over the
current one under that step's own costs (the simulated step time of both). Step-to-step
variation of the machine and of the model (noise, per-step dynamism) spreads the g_k. A move
is significant on n steps when

    mean_t(g) - t(df) x se_t(g) >= margin   and   mean_t(g) > 0

with mean_t the trimmed mean (TRIM of the steps cut from each end: a transient of a few steps
moves it little), se_t its winsorized standard error and t(df) a one-sided quantile of
Student's t (`t_quantile`, exact for integer df): a saving the steps' own variation would
produce by chance does not move layers. It is tested twice (`supported`), on the forecast's
`window` steps (a large change shows at once) and on the latest run of some longer length, up
to the EVIDENCE_STEPS observed steps (a gain of a few percent under noise needs more steps to
stand out), each at `level(confidence)` (97.5 % for `balance.confidence` = 0.95). The costs
may have moved any number of steps ago, so the longer runs are scanned (`scan`): every length
from window + 1 to twice that, then a doubling grid, and all the steps, each at its share of
the level (a weighted Bonferroni: the change point is searched, and the search is paid for),
no run claiming less noise than the steps before it showed (read from their successive
differences). The same scan is the pre-registered fallbacks' test
(`dynmo.controller.fallback`, which has its statistics and measurements). The controller
lowers the confidence's risk as the
looks at the same evidence add up (`Controller.confidence_now`). `margin` is
`balance.min_gain` (1 % by default), doubled after a migration that lost. With no variation
(a noise-free replay) the test passes for any saving above the margin.

The window that proposes a move also chose it (the optimum of the window's forecast), so its
gains there are biased up (the winner's curse). A proposal is therefore confirmed only after
`balance.confirm` fresh steps that played no part in choosing it: their mean gain must clear the margin,
and the test above, fresh steps included, must still hold. The proposal stands until its fresh
steps came, whatever the window's optimum does meanwhile (`Rebalancing._standing_option`).

A change the model announces (a dynamism event: a pruning step, frozen blocks, exits switched
on, the skew) is not the winner's curse: what changed, and when, is known, not selected from
noise. The first window of steps of the changed model (`announced`) therefore moves layers on
its own evidence, the window test above, without waiting for fresh steps: the paper's
Algorithm 1 (profile the changed model, then rebalance), with the test added. Whether the
event's own step already ran the changed model differs between cases (the skew and pruning
change the step that reports them; exits and freezing the next one), so the window that ends
on the event's step + `window` - 1 and the one after it both qualify, once.

Each function takes what it judges and returns a verdict; the controller keeps the state.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import fmean, stdev
from typing import Callable, Sequence

import numpy as np

from dynmo.layout import Layout

CONFIRM = 2  # default fresh steps that confirm a proposed move (`balance.confirm`; see `confirmed`)
CONFIDENCE = 0.95  # default `balance.confidence`: how sure the evidence must be that a saving is no chance
EVIDENCE_STEPS = 20  # the longest run of observed steps the evidence reads (the forecast reads `window`)
LARGE = 0.5  # a step whose time departs this far from the forecast's may be a large change ...
FAR = 2.0  # ... when it departs this many times as far as any of the last JUMP_STEPS steps did
JUMP_STEPS = 100


def t_cdf_abs(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with an integer number of degrees of freedom, exactly (the
    finite trigonometric sums of the integer-df distribution)."""
    if t <= 0:
        return 0.0
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, acc = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        return 2 / math.pi * (theta + s * math.cos(theta) * acc)
    term, acc = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        acc += term
    return s * acc


def t_quantile(p: float, df: int) -> float:
    """The one-sided p-quantile (p > 0.5) of Student's t with df >= 1 degrees of freedom, by
    bisection on `t_cdf_abs` (to 1e-9)."""
    want = 2 * p - 1
    lo, hi = 0.0, 1.0
    while t_cdf_abs(hi, df) < want:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf_abs(mid, df) < want else (lo, mid)
        if hi - lo < 1e-9:
            break
    return (lo + hi) / 2


def level(confidence: float) -> float:
    """Each of `supported`'s two tests spends half of what the confidence leaves to chance."""
    return 1 - (1 - confidence) / 2


TRIM = 0.2  # the share of steps cut from each end of the gains before the test (Yuen's trimmed mean)


def trimmed(gains: list[float]) -> tuple[float, float, int]:
    """(trimmed mean, its standard error, degrees of freedom) of the gains, Yuen's way: the
    floor(TRIM n) largest and smallest cut for the mean, winsorized for the spread. A transient
    of a few steps -- a slow phase, a straggler -- moves it little, where it would move the plain
    mean; with fewer than 5 steps nothing is cut (the plain mean and its standard error)."""
    n = len(gains)
    g = int(TRIM * n)
    x = sorted(gains)
    kept = x[g:n - g]
    mean = fmean(kept)
    if n < 2:
        return mean, 0.0, 0
    win = [x[g]] * g + kept + [x[n - g - 1]] * g
    h = n - 2 * g  # Yuen: se = s_w sqrt((n - 1) / (h (h - 1))), s_w the winsorized sd
    return mean, stdev(win) * math.sqrt((n - 1) / (h * (h - 1))), h - 1


def noise_bound(gains: list[float], p: float = 0.95) -> float:
    """What the step-to-step variation of `gains` could produce by chance in their trimmed mean
    (one-sided, at level p)."""
    _, se, df = trimmed(gains)
    return t_quantile(p, df) * se if df >= 1 else 0.0


def large_change(rel: float, jumps: Sequence[float], window: int) -> bool:
    """A step whose simulated time on the current layout departs from the forecast's by `rel`
    (relative) may be a large change when |rel| >= LARGE and it departs FAR times as far as any
    of the last JUMP_STEPS steps did, EVIDENCE_STEPS of them seen at least (or `window`, if more):
    noise whose tails reach that far has shown it can. One such step is not evidence enough: under the noise injector's
    stragglers and slow phases single steps depart that far (measured in docs/controller.md),
    so the next step must agree (`confirms_large`)."""
    return abs(rel) >= LARGE and len(jumps) >= max(window, EVIDENCE_STEPS) and abs(rel) > FAR * max(jumps)


def confirms_large(rel: float, sign: int) -> bool:
    """The step after a possible large change departs from the same forecast at least LARGE the
    same way: two steps of it are evidence enough to act (`Controller._after_large_change`)."""
    return sign * rel >= LARGE


def gains(old_times: Sequence[float], new_times: Sequence[float]) -> list[float]:
    """Per observed step: the relative step-time saving of the proposed layout (its predicted
    step times `new_times`) over the current one (`old_times`), both under that step's own costs."""
    return [(old_t - new_t) / old_t if old_t > 0 else 0.0 for old_t, new_t in zip(old_times, new_times)]


def scanned(short: int, total: int, whole: bool = False) -> np.ndarray:
    """The run lengths a scan for a change point tests (the latest n steps for each n): every one
    from `short` to 2 `short` - 1, then a doubling grid, 2 `short`, 4 `short` ... up to `total`;
    with `whole`, `total` itself too (every step there is)."""
    grid = short * 2 ** np.arange(1, int(math.log2(total / short)) + 1) if total >= 2 * short else []
    n = np.concatenate([np.arange(short, min(2 * short, total + 1)), grid]).astype(int)
    return np.append(n, total) if whole and total >= short and (not len(n) or n[-1] != total) else n


def shares(short: int, total: int, whole: bool = False) -> np.ndarray:
    """Each scanned length's share of alpha, summing to at most 1 (a weighted Bonferroni): the
    short runs each keep the share they would have among every length from `short` to `total`,
    the grid's longer runs share the rest."""
    n = scanned(short, total, whole)
    each = 1.0 / (total - short + 1)
    near = n < 2 * short
    rest = (1.0 - each * near.sum()) / max(1, (~near).sum())
    return np.where(near, each, rest)


# a handful of (level, df) pairs recur every step: the quantile's bisection runs once for each
_t_quantile = lru_cache(maxsize=1024)(t_quantile)


def scan(gains: Sequence[float], short: int, margin: float, alpha: float, whole: bool = False) -> bool:
    """Per-step gains (oldest first) faster than the margin beyond what the noise explains, over
    the last n steps for some n of `scanned` (`whole`: all of them too): each length's test
    (Yuen's trimmed mean, as `trimmed`) at its share of alpha (`shares`), its spread the larger
    of the run's own (winsorized) and that of the steps before it (from their successive
    differences, with their degrees of freedom on the doubling grid's runs) when `short` or more
    came before, else, below 2 `short` steps, at alpha / EVIDENCE_STEPS (a short run with
    nothing to compare its spread with). The reasons are `dynmo.controller.fallback`'s: a change
    point searched and paid for, and a run that cannot claim less noise than the steps before it
    showed."""
    g = np.asarray(gains[::-1], dtype=float)  # newest first: g[:n] is the last n steps
    total = len(g)
    if total < short:
        return False
    n = scanned(short, total, whole)
    cols = np.arange(total)
    inside = cols[None, :] < n[:, None]
    x = np.sort(np.where(inside, g[None, :], np.inf), axis=1)  # each run sorted, padded after it
    cut = (TRIM * n).astype(int)
    h = n - 2 * cut
    rows = np.arange(len(n))
    lo, hi = x[rows, cut], x[rows, n - cut - 1]
    kept = inside & (cols[None, :] >= cut[:, None]) & (cols[None, :] < (n - cut)[:, None])
    mean = np.where(kept, x, 0.0).sum(axis=1) / h
    win = np.where(inside, np.clip(x, lo[:, None], hi[:, None]), 0.0)
    wmean = win.sum(axis=1) / n
    spread = np.sqrt(np.where(inside, (win - wmean[:, None]) ** 2, 0.0).sum(axis=1) / (n - 1))
    m = total - n  # the steps before each run
    # the noise of the steps before each run, from their successive differences (von Neumann's
    # mean square successive difference): an earlier change or a drift among them is not noise
    d2 = np.concatenate(([0.0, 0.0], np.cumsum(np.diff(g[::-1]) ** 2)))  # oldest first: d2[m] over the m steps before
    referenced = m >= short
    mm = np.maximum(m, 2)
    before = np.sqrt(d2[m] / (2 * (mm - 1)))
    # where the steps before set the spread, its degrees of freedom are theirs: von Neumann's
    # estimate over m steps varies as a chi-square's with 2 (m - 1)^2 / (3 m - 4) of them
    df_before = np.floor(2 * (mm - 1) ** 2 / np.maximum(3 * mm - 4, 1)).astype(int)
    df = np.where(referenced & (before > spread) & (n >= 2 * short), np.maximum(df_before, h - 1), h - 1)
    spread = np.where(referenced, np.maximum(spread, before), spread)
    se = spread * np.sqrt((n - 1) / (h * (h - 1)))
    # a short run with nothing before it may agree by chance: held to a stricter level; a run of
    # 2 short steps or more reads its noise well enough from itself (held to it too, the run
    # from uniform onto a faster params layout waited: over 200 scenarios 25 ran slower)
    a = np.where(referenced | (n >= 2 * short), alpha, alpha / EVIDENCE_STEPS) * shares(short, total, whole)
    t = np.asarray([_t_quantile(1 - float(ak), int(k)) for ak, k in zip(a, df)])
    return bool(((mean > margin) & (mean - t * se >= margin)).any())


def significant(gains: list[float], margin: float, p: float = 0.95) -> bool:
    """The (trimmed) mean gain clears the margin beyond what the gains' variation could produce."""
    if not gains:
        return False
    mean = trimmed(gains)[0]
    return mean > 0 and mean - noise_bound(gains, p) >= margin


def supported(gains: list[float], window: int, margin: float, confidence: float = CONFIDENCE) -> bool:
    """Significant on the last `window` steps (a large change shows within the window) or on the
    latest run of some longer length, up to all the steps observed (EVIDENCE_STEPS at most: a
    small gain needs more steps to stand out of the noise); each of the two at `level(confidence)`
    (97.5% one-sided by default), so that together they err at most 1 - confidence of the time.
    The longer runs are scanned (`scan`: window + 1 steps and up, every step there is last, each
    at its share of the level, none claiming less noise than the steps before it showed): the
    costs may have moved n steps ago for any n, and a test of every step observed read the steps
    before the move as the gain's noise (a lasting 15 % gain waited 15 steps behind its own old
    regime)."""
    if significant(gains[-window:], margin, level(confidence)):
        return True
    return len(gains) > window and scan(gains, window + 1, margin, 1 - level(confidence), whole=True)


def confirmed(proposal: tuple | None, observed: int, fresh_max: int, window: int, current: Layout, new: Layout,
              margin: float, gains_of: Callable[[Layout], list[float]], confirm: int = CONFIRM,
              confidence: float = CONFIDENCE) -> tuple[Layout | None, tuple | None]:
    """(the layout to move to, or None; the proposal that stands after this step).

    The window that proposes a move also chose it (the optimum of the window's forecast), so
    its gain there is biased up; only steps that played no part in choosing it are fair
    evidence. A proposal `(boundaries, steps observed then)` is confirmed once `confirm` steps
    were observed after it (no more than the evidence holds: `fresh_max`), when their mean gain
    clears the margin and the evidence, fresh steps included, still `supported` it. Under noise
    the forecast's optimum may flip between layouts of the same step time: the proposal stands
    until its own fresh steps judge it; then `new` is proposed afresh. With `confirm` = 0 a
    supported move is made at once."""
    if confirm == 0:
        return new, None
    if proposal is not None:
        proposed, since = Layout(proposal[0]), proposal[1]
        fresh = min(observed - since, fresh_max)
        if fresh < min(confirm, window):
            return None, proposal
        if proposed.num_stages == current.num_stages and proposed != current:
            gains = gains_of(proposed)
            if fmean(gains[-fresh:]) > margin and supported(gains, window, margin, confidence):
                return proposed, None
    return None, (new.boundaries, observed)


def announced(gains: list[float], window: int, margin: float, confidence: float = CONFIDENCE) -> bool:
    """The first window after an announced change: the window's steps alone, at `level(confidence)`."""
    return len(gains) >= window and significant(gains[-window:], margin, level(confidence))
