"""`balance.experts = "auto"`: re-place the experts of each MoE layer when the measured routing
says a placement would lighten its busiest expert-parallel rank by more than the routing's
own step-to-step variation, and the saving repays the move. Pure (no torch): the trainer feeds
it the step records on rank 0 and broadcasts what it decides.

Every `balance.experts_every` steps, per MoE layer, over the observed steps (at least
2 x max(`balance.window`, MIN_JUDGE), at most `evidence.EVIDENCE_STEPS`), split into an older half that chooses
and a newer half that judges (a placement chosen on the steps that judge it would win on their
noise alone):

  propose   `dynmo.balance.experts.place_experts` on the mean tokens per expert of the older
            half (`moe_tokens_per_expert`); with `extra_slots` (`parallel.expert_slots`) it may
            copy hot experts into them (a copy takes an even share of its expert's tokens) and
            slots it leaves free are filled with the copies that cost least (`fill_slots`: the
            runtime holds a full set of rows on every rank); its ranks renamed (`align`) so the
            fewest experts move from the current placement.
  gains     per newer step k, the relative saving of the proposal on that step's own routing
            (`evidence.gains`), scored one of two ways:
            - with `step_times` (the trainer and the replay pass it: one decision with the layer
              layout), the simulated step time of the layout in force, the same objective and
              engine the layer controller scores layouts with. The layer's measured seconds
              per microbatch at step k are taken apart into the part its experts take, the
              share `expert_share` (the experts' nominal multiply-adds over the unit's,
              `dynmo.flops.expert_share`), which follows the busiest expert-parallel rank's
              tokens, and the rest, which does not: the layer costs
              c_k x (1 - s + s x busiest(proposal, loads_k) / busiest(current, loads_k)) under
              the proposal, every other layer as measured. A layer off the pipeline's critical
              path saves no step time, so its experts stay where they are;
            - without, the busiest rank's tokens alone: 1 - busiest(proposal) / busiest(current).
  evidence  `dynmo.controller.evidence.significant(g, balance.min_gain, level(confidence))`:
            the trimmed mean gain minus its t-scaled standard error must clear
            `balance.min_gain`.
  repay     mean gain x the seconds per step it applies to x the steps left (at most
            `balance.horizon`) must exceed the move's predicted seconds, `fixed_s + bytes /
            bandwidth` (`dynmo.controller.migration`'s prior, refitted from every measured
            `replacement` event). With `step_times` those seconds are the simulated steps';
            without, the layer's whole measured time stands for the time its busiest rank
            spends in the experts (an upper bound on what the placement can save).

A layer that moved starts its evidence afresh: it is not looked at again before 2 x
max(`balance.window`, MIN_JUDGE) steps have run under its new placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dynmo.balance.experts import (Placement, align, fill_slots, move_cost, order_placement, place_experts,
                                   placement_order, start_order)
from dynmo.controller import evidence, migration
from dynmo.record import StepRecord

MIN_JUDGE = 5  # fewest steps that judge a proposal: fewer lets a few alike steps pass the t-test by chance

# per-unit seconds per microbatch of some steps -> the simulated seconds of each on the layout in force
StepTimes = Callable[[list[list[float]]], list[float]]


def placement_of(order: tuple[int, ...] | list[int], ranks: int) -> Placement:
    """An order of the experts (rank by rank, slot by slot; an expert on several ranks is
    copied, each copy taking an even share of its tokens) as the solver's `Placement`."""
    return order_placement(order, ranks)


def order_of(p: Placement) -> tuple[int, ...]:
    """The solver's placement (every rank as many experts) as an order of the experts, rank by rank."""
    return placement_order(p)


def busiest(order, loads, ranks: int) -> float:
    return order_placement(order, ranks).busiest(loads)


@dataclass
class ExpertBalancer:
    ranks: int  # parallel.ep
    groups: int  # expert-parallel groups per pipeline position: dp / ep (each moves the same bytes)
    names: list[str]  # per placement unit: the model layer's name (what placements are keyed by)
    expert_bytes: float  # bytes one expert ships: weights and both AdamW moments
    extra_slots: int = 0  # parallel.expert_slots: slots per rank beyond N / ranks, for copies of hot experts
    every: int = 5
    window: int = 3
    min_gain: float = 0.01
    confidence: float = evidence.CONFIDENCE
    horizon: int = 50
    fixed_s: float = migration.MIGRATION_FIXED_S
    bandwidth: float = migration.MIGRATION_BANDWIDTH
    expert_share: dict[str, float] = field(default_factory=dict)  # layer -> share of its time in the experts (1)
    loads: dict[str, list[list[float]]] = field(default_factory=dict)  # layer -> per step tokens per expert
    seconds: dict[str, list[float]] = field(default_factory=dict)  # layer -> per step measured seconds
    costs: dict[str, list[list[float]]] = field(default_factory=dict)  # layer -> per step every unit's seconds
    units: dict[str, list[int]] = field(default_factory=dict)  # layer -> the units that hold its experts
    last: dict = field(default_factory=dict)  # what the last decision weighed, per layer (for its event)

    def observe(self, rec: StepRecord) -> None:
        """One step's routing and layer times; a `replacement` event refits the move's cost."""
        tpe = rec.stats.get("moe_tokens_per_expert") or []
        per_step: dict[str, float] = {}
        for i, loads in enumerate(tpe):
            if loads is None or i >= len(self.names):
                continue
            name = self.names[i]
            self.loads.setdefault(name, []).append([float(x) for x in loads])
            self.units.setdefault(name, [])
            if i not in self.units[name]:
                self.units[name].append(i)
            cost = rec.layer_cost_s[i] if i < len(rec.layer_cost_s) else 0.0
            per_step[name] = per_step.get(name, 0.0) + cost * max(1, rec.microbatches)
        costs = [float(c) for c in rec.layer_cost_s]
        for name, s in per_step.items():
            self.seconds.setdefault(name, []).append(s)
            self.costs.setdefault(name, []).append(costs)
        for kept in (self.loads, self.seconds, self.costs):  # a decision reads EVIDENCE_STEPS steps at most
            for name, hist in kept.items():
                del hist[:-evidence.EVIDENCE_STEPS]
        for e in rec.events:
            if e.get("type") == "replacement":
                self.fixed_s, self.bandwidth = migration.refit(self.fixed_s, self.bandwidth, int(e.get("bytes", 0)),
                                                               float(e.get("seconds", 0.0)))
                for name in e.get("placements", {}):
                    self.loads.pop(name, None)  # fresh evidence under the new placement
                    self.seconds.pop(name, None)
                    self.costs.pop(name, None)

    def decide(self, step: int, orders: dict[str, tuple[int, ...]], steps_left: int,
               step_times: StepTimes | None = None) -> dict[str, tuple[int, ...]]:
        """{layer: new order} for the layers worth re-placing before `step` ({} for none).
        `orders`: the current placements (a layer absent: its start, `start_order`). `step_times`: the simulated
        step times of per-unit costs on the layout in force (module doc); None scores by the
        busiest rank's tokens alone."""
        self.last = {}
        if self.every <= 0 or step % self.every:
            return {}
        out: dict[str, tuple[int, ...]] = {}
        for name, hist in self.loads.items():
            if len(hist) < 2 * max(MIN_JUDGE, self.window):
                continue
            steps = hist[-evidence.EVIDENCE_STEPS:]
            choose, judge = steps[: len(steps) // 2], steps[len(steps) // 2:]
            n = len(steps[0])
            current = tuple(orders.get(name) or start_order(n, self.ranks, self.extra_slots))
            mean = [sum(s[e] for s in choose) / len(choose) for e in range(n)]
            if sum(mean) <= 0:
                continue
            S = self.extra_slots
            proposal = fill_slots(place_experts(mean, self.ranks, extra_slots=S, copies=self.ranks * S).placement,
                                  mean, S)
            now = placement_of(current, self.ranks)
            proposal = align(now, proposal, self.expert_bytes)
            new = order_of(proposal)
            if sorted(map(sorted, now.rank_experts())) == sorted(map(sorted, proposal.rank_experts())):
                continue  # the same experts together on as many ranks: nothing to gain
            ratios = [busiest(new, s, self.ranks) / b if (b := busiest(current, s, self.ranks)) > 0 else 1.0
                      for s in judge]
            if step_times is not None and len(self.costs.get(name, [])) >= len(judge):
                gains, per_step_s = self._step_gains(name, ratios, step_times)
            else:
                gains = [1.0 - r for r in ratios]
                secs = self.seconds.get(name, [0.0])[-len(judge):]
                per_step_s = sum(secs) / len(secs)
            moved = move_cost(now, proposal, self.expert_bytes)
            nbytes = moved.bytes * self.groups
            cost_s = self.fixed_s + nbytes / self.bandwidth
            mean_gain = sum(gains) / len(gains) if gains else 0.0
            saving_s = mean_gain * per_step_s * min(self.horizon, steps_left)
            significant = evidence.significant(gains, self.min_gain, evidence.level(self.confidence))
            self.last[name] = {"gain": mean_gain, "significant": significant, "saving_s": saving_s,
                               "predicted_s": cost_s, "predicted_bytes": nbytes, "steps": len(gains),
                               "scored_by": "step time" if step_times is not None else "busiest rank"}
            if significant and saving_s > cost_s:
                out[name] = new
        return out

    def _step_gains(self, name: str, ratios: list[float], step_times: StepTimes) -> tuple[list[float], float]:
        """Per judging step, the simulated step time's relative saving when this layer's expert
        part scales by that step's busiest-rank ratio; and the mean simulated step (seconds)."""
        share = self.expert_share.get(name, 1.0)
        olds = self.costs[name][-len(ratios):]
        news = []
        for c, r in zip(olds, ratios):
            c = list(c)
            for i in self.units.get(name, []):
                c[i] *= 1.0 - share + share * r
            news.append(c)
        t = step_times(olds + news)
        t_old, t_new = t[: len(olds)], t[len(olds):]
        return evidence.gains(t_old, t_new), sum(t_old) / len(t_old)
