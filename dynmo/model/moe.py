"""Mixture of Experts block ("moe"): attention, then a Mixtral-style sparse MoE MLP.

Routing (Mixtral): router logits -> softmax over experts -> top-k experts per token -> their
probabilities renormalised to sum to 1 (`norm_topk_prob`). Auxiliary load-balancing loss
(Switch/Mixtral): `E * sum_e f_e * P_e`, f_e the fraction of the token->expert assignments
that chose expert e, P_e the mean router probability of e; it is 1 when perfectly balanced.
Optional capacity factor: each expert keeps at most `ceil(cf * tokens * k / E)` assignments,
first choices before second choices, earlier tokens first; dropped assignments contribute
nothing (the token keeps its residual).

Expert compute follows the routing and is *padded to the busiest expert*: every expert's
tokens are gathered into one [E, C, D] buffer with C = the largest expert load (capped by
the capacity), and all experts run as one batched matmul over it. Why padding rather than an
exact grouped matmul: on expert-parallel hardware each expert sits on its own device and the
layer finishes when the busiest one does, so the layer's time is proportional to the maximum
load, not the mean. On one device an exact grouped matmul costs sum_e load_e = tokens * k,
the same every step, and would hide the imbalance the balancer must see. Padding makes the
measured per-layer time (and the counted matmul rows, `expert_rows = E * C`) follow the
routing imbalance the way expert-parallel hardware does. Padding rows are zeros and their
outputs are discarded, so they change neither the result nor the gradients.

Only active tokens (mask True) are routed; inactive ones get no MLP update.

Expert parallelism (`parallel.ep` = P > 1, set up by `dynmo.runtime.experts`): the experts
module then holds only its rank's num_experts/P experts and `parallel.expert_slots` copies
(rows of the stacked weights) and an
`ep` handle (its expert-parallel group) and a placement (`order`, `holders`: which ranks and
slots hold each expert; a hot expert may have copies on several ranks, which share its tokens).
Routing stays per replica as above; the kept assignments, sorted by their copy's position, go
to the rank holding it by one all-to-all, each
rank computes its local experts on exactly the rows it received (a loop over its local
experts, one matmul each: no padding), and the outputs come back by the reverse all-to-all
and are gate-weighted and summed as without it. Why no padding here: across ranks the layer
already waits for the busiest rank in the all-to-all, so the imbalance is real and measured
as it happens; padding every local expert to the busiest one would add made-up work to
every rank on top of it. A loop rather than a padded buffer over the local experts keeps each
rank's work equal to its real load (`expert_rows` counts it; `ep_rank_rows` lists the rows
every rank of the group computed). Without expert parallelism (no `ep` handle) the code path
is the padded one above, unchanged.

Per-layer stats (`block.last_stats`, summed/averaged over the forwards since
`block.reset_stats()`): tokens_per_expert (assignments before dropping), routing_imbalance
(mean over forwards of max/mean expert load), expert_rows (padded rows computed: the cost),
useful_rows, dropped, active_tokens, aux_loss (mean), forwards; with expert parallelism
expert_rows is the rows this rank computed and ep_rank_rows the rows each rank of its
expert-parallel group computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import MoEConfig, ModelConfig
from dynmo.model.aux_loss import attach_aux_loss
from dynmo.model.gpt import CausalSelfAttention, Halves
from dynmo.model.stats import StepStats

MoEOptions = MoEConfig  # options live in the config ([model.moe])


class ExpertLinear(nn.Module):
    """E independent linear maps applied to an [E, C, in] buffer with one batched matmul."""

    def __init__(self, num_experts: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_in, d_out).normal_(0.0, 0.02))
        self.bias = nn.Parameter(torch.zeros(num_experts, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight)

    def one(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert j on its rows x [n, in] (expert parallelism)."""
        return torch.baddbmm(self.bias[j : j + 1].unsqueeze(1), x.unsqueeze(0), self.weight[j : j + 1])[0]


class Experts(nn.Module):
    """E GELU MLPs, each the size of the dense block's MLP (names mirror `MLP` for the init)."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, dropout: float):
        super().__init__()
        self.fc = ExpertLinear(num_experts, d_model, hidden)
        self.proj = ExpertLinear(num_experts, hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))

    def one(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert j on its rows x [n, D] (expert parallelism)."""
        return self.drop(self.proj.one(j, F.gelu(self.fc.one(j, x))))


@dataclass
class Routing:
    """One forward's routing decisions, over the routed (active) tokens."""

    probs: torch.Tensor  # [N, E] router probabilities
    expert: torch.Tensor  # [A] expert of each kept assignment
    token: torch.Tensor  # [A] token (row of the routed tokens) of each kept assignment
    weight: torch.Tensor  # [A] gate weight of each kept assignment
    slot: torch.Tensor  # [A] row in the expert's padded buffer
    loads: torch.Tensor  # [E] assignments per expert before dropping
    capacity_rows: int  # C: rows per expert in the padded buffer


class MoELayer(nn.Module):
    def __init__(self, d_model: int, hidden: int, opts: MoEOptions, dropout: float = 0.0):
        super().__init__()
        if not 1 <= opts.top_k <= opts.num_experts:
            raise ValueError(f"moe.top_k={opts.top_k} must be in 1..moe.num_experts={opts.num_experts}")
        self.opts = opts
        self.router = nn.Linear(d_model, opts.num_experts, bias=False)
        nn.init.normal_(self.router.weight, 0.0, 0.02)
        self.experts = Experts(opts.num_experts, d_model, hidden, dropout)

    def route(self, x: torch.Tensor) -> Routing:
        return route(self.router(x), self.opts)

    def aux_loss(self, r: Routing) -> torch.Tensor:
        return aux_loss(r, self.opts.num_experts)

    def forward(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """x: [N, D] routed tokens -> [N, D] gate-weighted sum of their experts' outputs."""
        return dispatch(x, r, self.experts, self.opts.num_experts)


def route(logits: torch.Tensor, opts: MoEOptions) -> Routing:
    """Top-k token choice from router logits [N, E] (see the module docstring)."""
    E, k = opts.num_experts, opts.top_k
    N = logits.shape[0]
    probs = F.softmax(logits, dim=-1)
    top_p, top_e = probs.topk(k, dim=-1)  # [N, k]
    if opts.norm_topk_prob:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    # Assignments in priority order: every token's first choice, then second choices, ...
    expert = top_e.t().reshape(-1)
    weight = top_p.t().reshape(-1)
    token = torch.arange(N, device=logits.device).repeat(k)
    onehot = F.one_hot(expert, E)
    slot = (onehot.cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)  # rank within its expert
    loads = onehot.sum(0)
    rows = int(loads.max()) if N else 0
    if opts.capacity_factor > 0:
        cap = math.ceil(opts.capacity_factor * N * k / E)
        keep = slot < cap
        expert, token, weight, slot = expert[keep], token[keep], weight[keep], slot[keep]
        rows = min(rows, cap)
    return Routing(probs, expert, token, weight, slot, loads, rows)


def aux_loss(r: Routing, num_experts: int) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss of one layer: E * sum_e f_e * P_e."""
    if r.probs.shape[0] == 0:
        return r.probs.sum()
    f = r.loads.to(r.probs.dtype) / r.loads.sum()
    return num_experts * (f * r.probs.mean(0)).sum()


def dispatch(x: torch.Tensor, r: Routing, experts: nn.Module, num_experts: int) -> torch.Tensor:
    """Run `experts` ([E, C, D] -> [E, C, D]) on the routed tokens x [N, D], padded to the
    busiest expert, and return the gate-weighted sum of each token's experts' outputs."""
    E, C, D = num_experts, r.capacity_rows, x.shape[1]
    flat = r.expert * C + r.slot
    buf = x.new_zeros(E * C, D).index_copy(0, flat, x[r.token])
    y = experts(buf.view(E, C, D)).reshape(E * C, D)
    out = y[flat] * r.weight[:, None]  # in the experts' dtype (bf16 under autocast)
    return out.new_zeros(x.shape).index_add(0, r.token, out)


def dispatch_ep(x: torch.Tensor, r: Routing, experts: nn.Module, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Expert parallelism (see the module docstring): the kept assignments go to the ranks of
    their experts by all-to-all (`experts.ep`: the group's handle; `experts.holders[e]`: where
    the copies of expert e sit in the group, rank * K + slot, under the layer's placement), each
    rank runs its local experts exactly on the rows it received, and the outputs come back the
    same way. Returns the gate-weighted sum [N, D] and the rows each rank of the group computed.

    An expert with c copies: this replica's assignments to it, in routing order, are cut into c
    runs of equal length (within one), the j-th run to copy (j + this rank) mod c, so that the
    replicas' remainders spread over the copies. Without copies, which rank holds an expert
    does not change its numbers: an expert gets the same rows in the same order (by source rank,
    then in routing order) wherever it sits, and the outputs are summed per token in routing
    order, as in `dispatch`."""
    ep = experts.ep
    P = ep.size
    K = len(experts.order) // P  # slots a rank
    holders = experts.holders.to(r.expert.device)
    if not experts.copied:
        where = holders[r.expert, 0]  # rank * K + slot of each kept assignment
    else:
        copies = experts.copies.to(r.expert.device)
        per = torch.bincount(r.expert, minlength=num_experts)  # this replica's assignments per expert
        by = torch.argsort(r.expert, stable=True)
        first = torch.cumsum(per, 0) - per
        nth = torch.empty_like(r.expert)
        nth[by] = torch.arange(r.expert.numel(), device=r.expert.device) - first[r.expert[by]]
        c = copies[r.expert]
        # which copy: equal runs in routing order, the runs' lengths rotated by the source rank so
        # that no copy takes every replica's remainder
        run = (nth * c // per[r.expert].clamp(min=1) + ep.rank) % c
        where = holders[r.expert, run]
    order = torch.argsort(where, stable=True)  # by destination rank, then slot, then routing order
    token = r.token[order]
    counts = torch.bincount(where, minlength=P * K)  # this replica's kept assignments per position
    table = ep.gather_counts(counts)  # [P, P * K]: every rank's, the same on all of them
    send = counts.view(P, K).sum(1).tolist()
    mine = table[:, ep.rank * K : (ep.rank + 1) * K]  # [P, K]: rows from each source per local slot
    recv = mine.sum(1).tolist()
    xs = ep.all_to_all(x[token], send, recv)  # by source rank, then local slot
    local = torch.repeat_interleave(torch.arange(K).repeat(P), mine.reshape(-1)).to(x.device)
    rows = [(local == j).nonzero().squeeze(1) for j in range(K)]
    ys = [experts.one(j, xs[rows[j]]) for j in range(K)]
    y = ys[0].new_zeros(xs.shape[0], ys[0].shape[1]).index_copy(0, torch.cat(rows), torch.cat(ys))
    back = ep.all_to_all(y, recv, send)  # in the order the rows were sent
    back = back.new_empty(back.shape).index_copy(0, order, back)  # routing order again
    out = back * r.weight[:, None]  # promoted as in `dispatch`
    per_rank = table.view(P, P, K).sum(dim=(0, 2)).tolist()
    return out.new_zeros(x.shape).index_add(0, r.token, out), per_rank


def routing_stats(r: Routing, aux: torch.Tensor, n_active: int, num_experts: int,
                  ep_rank_rows: list[int] | None = None) -> dict:
    """One forward's routing figures for `StepStats.add` (see the module docstring)."""
    loads = r.loads.tolist()
    mean = sum(loads) / len(loads)
    if ep_rank_rows is not None:  # expert parallelism: this rank's exact rows, and every rank's
        return dict(
            tokens_per_expert=loads,
            routing_imbalance=max(loads) / mean if mean else 1.0,
            expert_rows=ep_rank_rows[0],
            ep_rank_rows=ep_rank_rows[1],
            useful_rows=int(r.expert.numel()),
            dropped=sum(loads) - int(r.expert.numel()),
            active_tokens=n_active,
            aux_loss=float(aux),
        )
    return dict(
        tokens_per_expert=loads,
        routing_imbalance=max(loads) / mean if mean else 1.0,
        expert_rows=num_experts * r.capacity_rows,
        useful_rows=int(r.expert.numel()),
        dropped=sum(loads) - int(r.expert.numel()),
        active_tokens=n_active,
        aux_loss=float(aux),
    )


def routing_summary(s: StepStats) -> dict:
    """A step's routing statistics from the forwards' sums ({} before the first forward)."""
    if not s.forwards:
        return {}
    return {
        "tokens_per_expert": s.sums["tokens_per_expert"],
        "routing_imbalance": s.mean("routing_imbalance"),
        "expert_rows": s.sums["expert_rows"],
        "useful_rows": s.sums["useful_rows"],
        "dropped": s.sums["dropped"],
        "active_tokens": s.sums["active_tokens"],
        "aux_loss": s.mean("aux_loss"),
        "forwards": s.forwards,
    } | ({"ep_rank_rows": s.sums["ep_rank_rows"]} if "ep_rank_rows" in s.sums else {})


def sparse_mlp(h: torch.Tensor, mask: torch.Tensor, router: nn.Module, experts: nn.Module, opts: MoEOptions,
               stats: StepStats) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE MLP on the active tokens of h [B, T, D] (inactive ones get zeros): its output and
    its (unweighted) load-balancing loss; the forward's routing figures go into `stats`."""
    B, T, D = h.shape
    h = h.reshape(B * T, D)
    active = mask.reshape(-1).nonzero().squeeze(1)
    routed = h[active]
    r = route(router(routed), opts)
    ep_rows = None
    if getattr(experts, "ep", None) is None:
        out = dispatch(routed, r, experts, opts.num_experts)
    else:
        out, per_rank = dispatch_ep(routed, r, experts, opts.num_experts)
        ep_rows = (per_rank[experts.ep.rank], per_rank)
    y = h.new_zeros(h.shape).index_copy(0, active, out.to(h.dtype) if ep_rows else out)
    aux = aux_loss(r, opts.num_experts)
    with torch.no_grad():
        stats.add(**routing_stats(r, aux, routed.shape[0], opts.num_experts, ep_rows))
    return y.view(B, T, D), aux


class RoutedBlock(Halves, nn.Module):
    """What every MoE block shares: its step statistics and its aux loss carried into backward.
    A subclass sets `opts` (MoEConfig) and defines `attn_half(x, mask) -> (x, mask)` and
    `moe_branch(x, mask) -> (y, aux)` (the MoE's output for the residual stream x, and its
    unweighted load-balancing loss). The MLP half adds y to x and carries aux into backward."""

    opts: MoEOptions

    def reset_stats(self) -> None:
        self._stats = StepStats()

    @property
    def last_stats(self) -> dict:
        return routing_summary(self._stats)

    def mlp_half(self, x: torch.Tensor, mask: torch.Tensor):
        y, aux = self.moe_branch(x, mask)
        return attach_aux_loss(x + y, aux, self.opts.aux_loss_coef), mask

    def forward_with_aux(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output and its (unweighted) load-balancing loss, for single-process use."""
        x = self.attn_half(x, mask)[0]
        y, aux = self.moe_branch(x, mask)
        return x + y, aux


class MoEBlock(RoutedBlock):
    """Pre-norm block whose MLP is a sparse MoE (see module docstring)."""

    halves = (("ln1", "attn"), ("ln2", "moe"))

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.opts = cfg.moe
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoELayer(cfg.d_model, cfg.mlp_ratio * cfg.d_model, self.opts, cfg.dropout)
        self.reset_stats()

    def attn_half(self, x: torch.Tensor, mask: torch.Tensor):
        return x + self.attn(self.ln1(x)), mask

    def moe_branch(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_mlp(self.ln2(x), mask, self.moe.router, self.moe.experts, self.opts, self._stats)
