"""Expert placement for expert parallelism: which rank holds which expert of one MoE layer. Pure.

    from dynmo.balance.experts import place_experts, static_placement, move_cost
    r = place_experts(loads=[900, 120, 300, 310, 80, 95, 400, 410], ranks=4)
    r.placement.ranks, r.rank_loads, r.busiest, r.lower_bound, r.exact, r.gap
    move_cost(static_placement(8, 4), r.placement, expert_bytes=2.1e6).bytes

The names callers use, gathered from the modules that do each job:

  `dynmo.balance.expert_model`   the problem (minimise the busiest rank's tokens), `Placement`,
                                 `PlacementResult`, the arguments' checks, the `lower_bound`
                                 reported beside every answer;
  `dynmo.balance.expert_solver`  `place_experts`: the greedy with local search, and the exact
                                 branch and bound of small instances;
  `dynmo.balance.expert_orders`  the start (`static_placement`, `start_order`), orders (rank by
                                 rank, slot by slot) checked and converted, free slots filled
                                 with copies (`fill_slots`);
  `dynmo.balance.expert_moves`   what changing placements ships (`move_cost`), and the renaming of
                                 ranks that ships least (`align`).
"""

from __future__ import annotations

from dynmo.balance.expert_model import EPS, Placement, PlacementResult, check_loads, lower_bound
from dynmo.balance.expert_moves import MOVE_BYTES_PER_PARAM, ExpertMoves, align, move_cost
from dynmo.balance.expert_orders import (check_order, fill_slots, order_placement, placement_order, start_order,
                                         static_placement)
from dynmo.balance.expert_solver import EXACT_EXPERTS, EXACT_RANKS, MAX_NODES, greedy, place_experts

__all__ = ["EPS", "EXACT_EXPERTS", "EXACT_RANKS", "MAX_NODES", "MOVE_BYTES_PER_PARAM", "ExpertMoves", "Placement",
           "PlacementResult", "align", "check_loads", "check_order", "fill_slots", "greedy", "lower_bound",
           "move_cost", "order_placement", "placement_order", "place_experts", "start_order", "static_placement"]
