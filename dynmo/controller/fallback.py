"""`auto`'s pre-registered fallbacks: the layouts fixed before any cost was seen, tested against the current one every step.

Why they need less evidence. The evidence of `dynmo.controller.evidence` guards a move to the
optimum of a noisy window: that layout was selected among many because it looked best on those
very steps, so its gain there is biased up (the winner's curse), and it needs a margin, fresh
confirming steps and the optimum's own luck to hold. The start layout and the static layouts a
user could have fixed (uniform, params, flops: `Controller.prior_layouts`) were chosen before
step 0. Their per-step gains over the current layout are not selected from the noise, so a
paired test on the steps themselves is fair, each fallback is tested on its own (not only the
forecast's optimum), and a move to one needs no confirming steps.

The test (`faster`). Each observed step k gives the relative saving g_k of fallback f over the
current layout under that step's own costs (both simulated, as the evidence's gains), on the
steps since the evidence last started afresh (a migration, a large change; up to
EVIDENCE_STEPS). The costs may have moved n steps ago for any n, so the test scans the last n
steps ("the run") for n from s = window + 1 (`short_steps`): every n up to 2s - 1, then a
doubling grid, 2s, 4s ... up to all of them (`evidence.scanned`). f is faster when for some n

    mean_t(run) - t(1 - a, df) x spread x sqrt((n - 1) / (h (h - 1))) >= margin

a one-sided paired test of the run's savings against the margin, Yuen's as the window's
evidence (`evidence.trimmed`: mean_t the mean of the run with TRIM of its steps cut from each
end, h the steps kept, spread the winsorized standard deviation), so that a few spiky steps
move it little: a fallback whose saving lives in a few steps of swinging routing is not taken
for a faster one (a plain mean moved the committed Mixtral trace off its start for a 1.6 %
loss). df = h - 1, the run's own degrees of freedom. Where s or more steps came before the
run, spread is the larger of the run's own and theirs: a few steps can lie close together by
chance (in one of 48 seeds of the noise injector, five steps of a saving whose step-to-step
spread is 3 % agreed within 0.3 %), and a run cannot claim less noise than the steps before it
showed. Their noise is read from their successive differences (von Neumann's mean square
successive difference, sum_k (g_k - g_k-1)^2 / (2 (m - 1)) over the m steps before the run): they
may hold an earlier change or a drift, which is not noise, and their spread about one mean
counted it as noise (a ramp's own first steps held its fallback back by four steps). Where
their noise is the larger and the run is on the doubling grid (2s steps or more), df is
theirs, 2 (m - 1)^2 / (3m - 4) (the chi-square whose variance matches that of von Neumann's
estimate of a normal noise), if above h - 1: the spread comes from them. The short runs keep
h - 1 whatever the spread: at 3 degrees of freedom the quantile is what holds a slow phase of
the noise injector as long as the run (seed 6 of `configs/noisy.toml`, step 154: savings of
12-15 % on four steps in a row, 3 % spread before them) from passing. Where fewer came before
(right after a migration) there is nothing to compare with, and a run shorter than 2s is held
to a level EVIDENCE_STEPS times stricter (a run of 2s steps or more reads its noise from itself
well enough). And each of the last s steps' savings must clear the margin,
whatever the run: the fallback is faster now, not in a regime that has ended (the trimmed mean
of a long run can still hold the old one). a is alpha times the length's share (`evidence.shares`, a
weighted Bonferroni: the change point is searched, so the search is paid for, and the shares
sum to at most 1). Each short run, up to 2s - 1 steps, keeps the share it would have among
every length from s to all of them (1/17 with 20 steps): there a step of misalignment with the
change swamps the run, and the noise injector's slow phases last about as long. The longer runs
share the rest on the doubling grid: runs of neighbouring lengths share most of their steps and
say almost the same, and paying for each of them held a return under a committed dense
trace's noise (savings spreading about 6 % per step) a step or two longer. alpha = (1 -
confidence_now) / the number of fallbacks (`level`; `confidence_now` as the window's evidence:
lowered for each block of EVIDENCE_STEPS steps since the evidence last started afresh). A
lasting change far above the noise passes on the shortest run, s = 4 steps after it by
default, where the window's optimum waits for window + confirm (5) and must then be confirmed;
a modest lasting saving passes once enough steps carry it (5 % on a 2 % spread: within 13
steps, where paying for every length took up to 14).

A far larger change moves after two steps (`far_faster`): the fallback saved FAR_GAIN (a
quarter) or more of the current layout's step time on each of the last two steps (the current
layout ran them 4/3 times as long). One step of noise can go that far (a straggler microbatch on
a busy core); two in a row the noise injector's do not: under `configs/noisy.toml`'s injected
costs the largest saving a fixed layout showed on two steps in a row was 0.151 (48 seeds x 200
steps, its slow phases and stragglers included, every split of 2 to 8 layers on the first stage
against the shipped one; `benchmarks/bench_far_noise.py`), so FAR_GAIN stands 1.7 times above
it. Between the static layouts of the committed dense traces at the paper's shapes (the noise of
the generated scenarios) it reached 0.200, so there FAR_GAIN stands 1.25 times above two steps
of noise: the committed traces and the scenarios replay as measured with it
(docs/bench/controller-scenarios.md). The large-change rule of the window's evidence needs its
departure to be twice anything the step times showed over 100 steps; a run's own step-to-step
noise (a committed trace's steps depart 30 to 60 %) can keep that from ever holding, where a
fixed layout's gain, relative on the same step's costs, is free of the noise all layouts share.
Where the costs move again soon after a move (a reversal, a hot region that moves on), every
step of the wait runs the current layout a third or more slower than the fallback: with the
threshold at 1.5 times (the window's `evidence.LARGE`), a layout 1.4 times as slow waited out
the whole shortest run. A layout a rebalance chose (`via == "rebalance"`: the optimum of a noisy
window, its pattern possibly just ended) is left after one step on which a fallback saved
FAR_ONE (0.4) or more of its step time (it ran 5/3 times as long), the move's first step
excepted (it pays the rebuilt stages' warm-up, which the migration judge leaves out too): the
largest one-step saving any fixed layout showed over the shipped one under the noise injector
was 0.224 (the same benchmark), so FAR_ONE stands 1.8 times above it (1.6 times above the dense
traces' 0.254); under noise alone the controller makes no move for the rule to undo, and a
straggler beyond it on a real machine costs the migration back and the steps until the window
follows again. A reversal that ends two steps after the move it was followed by costs one step
of a layout twice as slow, not two (seed 158 of the scenarios: 0.970 -> 0.987 of the best static
layout over the second half; the committed traces replay as before).

Its false alarms. Under the test's model (independent normal per-step savings whose mean is at
most the margin, the same spread before and during the run) one look at the fallbacks passes
with probability at most 1 - confidence_now; as for the window's evidence, a block's looks on
overlapping steps count as one, so a run of K blocks errs at most (1 - confidence) x H_K
(0.15 in 200 steps at the default 0.95) where a fallback is exactly the margin faster, and far
more rarely where it is slower than the current layout, the usual case. Measured
(tests/test_controller_fallback.py, docs/controller.md), 200 runs of 200 steps with three
fallbacks whose savings are normal with a 3 % spread: at mean 0 1 % of the runs passed (none
while runs of 2s steps or more right after a migration were held to the stricter level too);
at mean = the margin, 11.5 % of the runs (7 % then, 4 % with the steps before a run read about
their mean, 1.5 % paying for every length); a 3-step transient of 5 times the spread on mean-0
savings, 1 of 200;
`configs/noisy.toml` on its injected costs, with a fallback within 0.3 % of its layout, no
migration in 48 seeds x 200 steps.

What the move still needs: the saving over the horizon (the mean saving of the last s steps,
or of the last two) repays the migration; a layout left within the horizon needs twice the
margin and one judged lost within it is not taken (as every move). Where several pass, those
within the margin of the fastest on the latest steps are told apart by their record: each
fallback's simulated step time on every step the run observed, kept past the history's
clearing at a move (`Fallbacks._record`), compared over the steps all of them were recorded
on. They were fixed before any cost was seen, so their records are fair to compare, and costs
that moved tend to move again: after a hot region's layout was outpaced, uniform and params
were equally fast on its two steps, and uniform, the slower over the run, ran 1.4 times as long
as params when the region came its way. The controller then searches from there with the usual
evidence. Pure.
"""

from __future__ import annotations

from statistics import fmean

import numpy as np

from dynmo.balance import Problem
from dynmo.controller import candidates, evidence, persistence
from dynmo.controller.decision import Decision
from dynmo.layout import Layout


def short_steps(window: int) -> int:
    """The short run a change must outlast: the forecast's window plus one step."""
    return window + 1


def level(confidence: float, fallbacks: int) -> float:
    """alpha of one look at the fallbacks, each fallback's share: what the confidence leaves to
    chance, spread over them."""
    return (1 - confidence) / max(1, fallbacks)


# a fallback that saved this share of the current layout's step time on each of the last two
# steps moves at once (the current layout ran them 4/3 times as long): 1.7 times the largest such
# saving the noise injector's costs showed (0.151, configs/noisy.toml, 48 seeds x 200 steps;
# benchmarks/bench_far_noise.py prints it, and the committed dense traces' 0.200)
FAR_GAIN = 0.25
# a layout a rebalance chose is left after one step on which a fallback saved this share of its
# step time: 1.8 times the largest one-step saving a fixed layout showed over the shipped one
# under the noise injector's costs (0.224, configs/noisy.toml, 48 seeds x 200 steps;
# benchmarks/bench_far_noise.py)
FAR_ONE = 0.4

# the most steps of a layout's record `Fallbacks._record` keeps (the latest)
RECORD_STEPS = 1000


def far_faster(gains: list[float], chosen: bool = False) -> int:
    """The latest steps that show the fallback far faster, 0 where they do not: 2 where the last
    two each saved FAR_GAIN or more of the current layout's step time, 1 where the last one saved
    FAR_ONE or more, the current layout is one a rebalance `chosen`, and that step is not the
    move's first (`gains` start at the move; its first step pays the rebuilt stages' warm-up)."""
    if len(gains) >= 2 and min(gains[-2:]) >= FAR_GAIN:
        return 2
    return 1 if chosen and len(gains) >= 2 and gains[-1] >= FAR_ONE else 0


def faster(gains: list[float], short: int, margin: float, alpha: float) -> bool:
    """The fallback's per-step gains (oldest first) show it faster than the current layout by
    more than the margin beyond what the noise explains over the latest run of some length
    (`evidence.scan`), and each of the last `short` steps above the margin."""
    g = np.asarray(gains[::-1], dtype=float)  # newest first: g[:n] is the last n steps
    total = len(g)
    if total < short or g[:short].min() <= margin:  # faster now, not in a regime that has ended
        return False
    return evidence.scan(gains, short, margin, alpha)


class Fallbacks:
    """`decide`'s fallback step: a mixin of the `Controller`, reading its state (`cfg`, `start`,
    `history`, `margin`, `lost`, `left`) and its scoring
    (`dynmo.controller.scoring.Scoring`), and handing a move to `_rebalanced`
    (`dynmo.controller.rebalancing.Rebalancing`)."""

    def _fallbacks(self, problem: Problem, current: Layout) -> list[Layout]:
        """The start and the priors' layouts on the current stages, each within the memory cap,
        but the current one and those judged lost."""
        lays = [self.start] if self.start is not None and self.start.num_stages == current.num_stages \
            and candidates.fits(problem, self.start) else []
        lays += self.prior_layouts(problem, current.num_stages)
        return [lay for lay in dict.fromkeys(lays) if lay != current and lay.boundaries not in self.lost]

    def _record(self, layouts: list[Layout], times: list[list[float]]) -> None:
        """Keep each layout's simulated step time on every observed step of the history, by the
        step's number in the run (`fallback_record`), past the history's clearing at a move."""
        first = self.observed - len(self.history)
        for lay, ts in zip(layouts, times):
            rec = self.fallback_record.setdefault(lay.boundaries, {})
            rec.update((first + i, t) for i, t in enumerate(ts))
            while len(rec) > RECORD_STEPS:  # the oldest steps first: a long run's memory stays bounded
                del rec[next(iter(rec))]

    def _record_mean(self, layout: Layout, among: list[Layout]) -> float:
        """`layout`'s mean recorded step time over the steps every one of `among` was recorded on."""
        recs = [self.fallback_record.get(lay.boundaries, {}) for lay in among]
        common = set.intersection(*(set(r) for r in recs)) if recs else set()
        mine = self.fallback_record.get(layout.boundaries, {})
        return fmean(mine[k] for k in common) if common else 0.0

    def _fall_back(self, step: int, current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        """The fastest fallback `faster` than the current layout whose saving repays its migration."""
        short = short_steps(self.cfg.window)
        problem = self.problem(self.forecast(), current.num_stages, current)
        options = self._fallbacks(problem, current)
        if not options:
            return None
        now, *times = self.history_times([current, *options])
        self._record([current, *options], [now, *times])
        alpha = level(self.confidence_now(), len(options))
        horizon = max(0, min(self.cfg.horizon, steps_left))
        passed = []
        for lay, t in zip(options, times):
            margin = self.margin
            if step - self.left.get(lay.boundaries, -10**9) <= self.cfg.horizon:
                margin *= 2  # no ping-pong, as every move
            gains = evidence.gains(now, t)
            if far := far_faster(gains, chosen=self.via == "rebalance"):
                recent = far
            elif faster(gains, short, margin, alpha):
                recent = short
            else:
                continue
            t_now, t_new = fmean(now[-recent:]), fmean(t[-recent:])
            if (t_now - t_new) * horizon <= self.migration_cost(layer_bytes, current, lay):
                continue
            passed.append((lay, t_now, t_new))
        if not passed:
            return None
        fastest = min(p[2] for p in passed)
        # among the fallbacks the latest steps cannot tell apart (within the margin of the
        # fastest), the one of the best record over the whole run: fixed before any cost was
        # seen, their records are fair to compare, and the costs that move again tend to come back
        near = [p for p in passed if p[2] <= fastest * (1 + self.margin)]
        among = [p[0] for p in near]
        lay, t_now, t_new = min(near, key=lambda p: (self._record_mean(p[0], among), p[2]))
        if self.via == "rebalance":  # a move the controller chose, undone: was it outpaced?
            loss = persistence.return_loss(now, times[options.index(lay)])
            if loss > 0:
                self.outpaced.append((step, loss))
        return self._rebalanced(step, problem, current, lay, t_now, t_new, horizon, layer_bytes, reason="fallback")
