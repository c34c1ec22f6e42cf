"""When and how to rebalance: the DynMo loop's decisions (paper Algorithm 1, automated). Pure.

The runtime feeds the controller each step's measured per-layer cost; the controller answers
with a new layout or nothing. No torch here, so the simulator can replay the same policy.

Forecast: per-layer cost is the median of the last `window` steps. A median ignores one-step
spikes (timing noise, a GC pause) and follows a real step change after ceil(window / 2)
steps, which is what per-step dynamism (MoE, MoD) needs.

Triggers (`when`):
  never    keep the initial layout;
  every    rebalance every `every` steps (the paper's fixed frequency);
  dynamism rebalance once after each step that changed the model (a pruning step, a block
           frozen, the skew switched on: events of type "dynamism"), from the cost measured
           over the `window` steps after the change (the paper's Algorithm 1: profile, then
           rebalance; one step's profile on a busy machine can be off by half);
  auto     rebalance when the layout is predicted to pay off, and the evidence says the gain
           is not noise (below).
Whatever the trigger, a rebalance must cut the predicted step time by the margin (`min_gain`)
and repay its migration over the horizon; `auto` and `dynamism` decisions are judged by the
measured step time afterwards (below), `every` (the user's fixed schedule) is not.

Step time. Layouts are compared by the step time of the schedule that runs, simulated
(`steptime.StepModel`: forward, backward and weight-gradient apart, link times charged to the
sender, the event-driven engine's numbers for many layouts at once); the closed form
(m - 1) x max_j s_j + sum_j s_j (`step_time`) stands in only beyond `MAX_SIM_OPS`. The
candidates are the balancer's layout, the current one and a bounded local search around them
(`candidates`). The saving of a rebalance over the next `horizon` steps must exceed the
migration's predicted cost (fixed + bytes / bandwidth, re-fitted from every migration measured).

`auto` against noise. A loaded machine, a straggler microbatch or per-step dynamism (MoE
routing) make each step's costs noisy, and the layout that is optimal for a forecast fitted
to that noise looks better than it is (the winner's curse). So `auto` moves layers only when
  - the forecast (per-layer median of the last `window` steps) saves at least `min_gain`
    (1 % by default, the simulator's measured accuracy) of the step time;
  - the saving is significant on the observed steps, each evaluated under its own costs: a
    one-sided trimmed-mean t-test on the per-step savings of the window, or of the latest run of
    some longer length up to all the observed steps (20 at most; the lengths scanned at their
    shares of the level, none claiming less noise than the steps before it showed:
    `evidence.supported`, `evidence.scan`), at `confidence` (0.95) spread over the looks since
    the evidence last started afresh, so a saving the steps' own variation could produce moves
    nothing;
  - the proposed move is confirmed on `confirm` fresh steps (2; `evidence.confirmed`; a proposal
    stands until they came, whatever the window's optimum does meanwhile), so a real
    change is acted on `window` + `confirm` steps after it happened (5 by default); a change
    far larger than any the noise showed (`evidence.large_change`) after 2; a change the model announces
    (a dynamism event) is acted on from its first window alone, `window` steps after it
    (`evidence.announced`): what changed and when is known, not selected from noise;
  - failing the window's optimum, the optimum of every observed step's median cost (`steady`,
    searched once a window) is tested the same way: a small gain under noise needs more steps
    than the window to stand out, and the window's optimum moves with the window's noise;
  - going back to a layout left within the horizon needs twice the gain (no ping-pong);
  - and after each migration the controller judges it by the measured step time
    (`judge.judge_migration`, both layouts step by step): a migration that made the step slower
    by more than that comparison's noise is undone, its layout is not chosen again for the
    horizon (the costs it lost on may move on), and the margin doubles.
Pre-registered fallbacks (`fallback`; `Controller.fallback`, on by default). The winner's curse
is a cost of selection: the window's optimum was chosen because it looked best on those very
steps. The start layout and the static layouts known before step 0 (uniform, params, flops)
were chosen before any cost was seen, so every step each of them is tested against the current
layout by a paired test on the observed steps' own costs (per-step savings, a one-sided test
of their trimmed mean against the margin on the last n steps for some n from window + 1 on
(every n up to twice that, then a doubling grid), a weighted Bonferroni over the lengths
scanned and the fallbacks, the noise the larger of the run's spread and the steps' before it
(read from their successive differences, so that an earlier change or a drift among them is not
taken for noise; with their degrees of freedom where they set it on a run of 2 (window + 1)
steps or more), or right after a migration a 20 times stricter level; each of the last window + 1 steps above
the margin), and a fallback that passes is moved to at once, no
confirming steps, its saving repaying the migration; two steps on which the current layout ran
4/3 times as long as a fallback (`fallback.FAR_GAIN`) are enough, and one step 5/3 times as
long (`fallback.FAR_ONE`, not the move's first) where a rebalance chose the current layout;
among fallbacks the latest steps cannot tell apart, the one with the best record over the run.
The controller then searches
from there as usual. So a layout the controller's own earlier move chose is left within a few
steps once the costs move again and a fixed layout is clearly faster, where the window's
optimum may keep failing its evidence. Its false-alarm rate and the measurements are in
`dynmo.controller.fallback`.
A moving target (`persistence`). A fallback that leaves a layout a rebalance chose, after that
layout ran longer than the fallback over its steps, records the move as outpaced, with the time
it lost on its slower steps. While the run has been outpaced within the horizon, a move to a
layout not fixed before step 0 must repay the way back (that loss, or two steps of the
candidate's excess on the costs before its pattern, the larger) by its saving per step times
its pattern's age (the steps it has been faster: the pattern's median remaining life), so a run
whose costs move every few steps stops chasing them and stays on its fallback.
Replayed figures and the trade-off between reaction time and false moves are in the
records docs/controller.md links (docs/bench/controller-*.md).

Re-packing (`repack=True`, paper Algorithm 1's optional step): when the model has shrunk (the
forecast total cost fell by `repack_shrink` below the largest seen: workers come back only
through a checkpoint restart, so a model that may still grow keeps them), the controller packs the layers onto the fewest
pipeline positions 0..k-1 whose predicted step time stays within `repack_tolerance` of the
best layout's on every worker the run started with (not today's: re-packs would compound), on
the forecast and on 80% of the observed steps (up to 20, all the evidence: released workers
come back only through a restart, so this decision reads more than the window); the runtime
releases the rest. When the packed layout runs beyond that tolerance again and the saving
repays a restart (`restart_s`), the controller grows back (`repack.grow`, reason "grow"). Its event reports both step times. With identical workers any k of them
are equivalent, so keeping the prefix loses nothing; with measured per-worker speeds the
balancer gets the kept workers' speeds.

Re-tuning microbatches after a re-pack (`retune_microbatches`): the paper's DynMo keeps the
microbatch count (its appendix E.4 names this as a gap). A shorter pipeline needs fewer
microbatches to hide its fill/drain bubble, and fewer, larger microbatches cost less fixed
per-microbatch overhead. We pick the fewest microbatches m' that divide the local batch and
keep both the schedule's inherent bubble, (p'-1)/(m'+p'-1), and the activations a 1F1B stage
holds in flight, min(m', p')/m' of the local batch, no worse than before the re-pack.

The decision, step by step (`Controller.decide`), each step in its own module:
  judge     the last migration, once measured: undone if it lost (`judge`)
  trigger   whether this step may decide at all (`when`, the dynamism window)
  forecast  per-layer median of the window (`Controller.forecast`)
  re-pack   the fewest workers within tolerance, once the model shrank (`repack`)
  fallback  `auto`: the start and the priors' layouts against the current one (`fallback`)
  propose   the balancer's layout for the forecast, worth its margin and its migration
  evidence  `auto`: the gain significant on the observed steps, then on fresh steps (`evidence`)
The step-time model (`steptime`), how the controller scores layouts with it on the forecast
and on each observed step (`scoring`), and the migration cost model (`migration`) are what
every step compares with. The `Controller` (`core`) keeps the state and runs the steps; its
mixins hold them: the proposals (`rebalancing`; a moving target: `persistence`), the fallbacks (`fallback`), the re-pack and
the grow (`packing`), and `auto`'s defences that span steps, large changes and the migration
judge (`safeguards`).
"""

from dynmo.controller.core import CONFIRM, JUDGE, RESTART_S, Controller, Decision
from dynmo.controller.migration import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S
from dynmo.controller.steptime import retune_microbatches, step_time

__all__ = ["CONFIRM", "JUDGE", "MIGRATION_BANDWIDTH", "MIGRATION_FIXED_S", "RESTART_S", "Controller", "Decision",
           "retune_microbatches", "step_time"]
