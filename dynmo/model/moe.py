"""Mixture of Experts block ("moe"): attention, then a Mixtral-style sparse MoE MLP.

Routing (Mixtral): router logits -> softmax over experts -> top-k experts per token -> their
probabilities renormalised to sum to 1 (`norm_topk_prob`). Auxiliary load-balancing loss
(Switch/Mixtral): `E * sum_e f_e * P_e`, f_e the fraction of the token->expert assignments
that chose expert e, P_e the mean router probability of e; it is 1 when perfectly balanced.
Optional capacity factor: each expert keeps at most `ceil(cf * tokens * k / E)` assignments,
first choices before second choices, earlier tokens first; dropped assignments contribute
nothing (the token keeps its residual).

Only active tokens (mask True) are routed; inactive ones get no MLP update. The routing keeps
fixed shapes (`Routing`: all N * k assignments, a `keep` flag for the computed ones), so neither
it nor the default expert compute waits for the host.

Expert compute, `moe.dispatch`:
- "grouped" (default): no padding, no host synchronisation. The kept assignments are sorted by
  expert on the device, each stacked expert weight is applied once by a grouped matmul over
  them (`dynmo.model.grouped`: `torch._grouped_mm`, or an exact per-expert loop where the
  installed torch lacks it), and the gate-weighted outputs are added back to their tokens.
  It costs sum_e kept_e = the kept assignments, however skewed the routing: `expert_rows` =
  `useful_rows`.
- "padded": every expert's tokens gathered into one [E, C, D] buffer, C = the largest kept load,
  and all experts run as one batched matmul over it (C is read on the host). This mimics one
  device per expert without expert parallelism: there the layer finishes when the busiest expert
  does, so its time follows the maximum load, not the mean, and `expert_rows` = E * C follows
  the routing imbalance. Padding rows are zeros whose outputs are discarded, so the result and
  the gradients are those of "grouped" (to float rounding).

Expert parallelism (`parallel.ep` = P > 1, set up by `dynmo.runtime.experts`): the experts
module then holds only its rank's num_experts/P experts and `parallel.expert_slots` copies
(rows of the stacked weights) and an
`ep` handle (its expert-parallel group) and a placement (`order`, `holders`: which ranks and
slots hold each expert; a hot expert may have copies on several ranks, which share its tokens).
Routing stays per replica as above; the kept assignments, sorted by their copy's position, go
to the rank holding it by one all-to-all, each rank computes its local experts grouped on
exactly the rows it received (whatever `moe.dispatch` says: no padding), and the outputs come
back by the reverse all-to-all and are gate-weighted and summed as without it. Across ranks the
layer already waits for the busiest rank in the all-to-all, so the imbalance is real and
measured as it happens (`expert_rows` counts this rank's rows; `ep_rank_rows` lists the rows
every rank of the group computed). The all-to-all's sizes are read on the host.

Per-layer stats (`block.last_stats`, summed/averaged over the forwards since
`block.reset_stats()`, kept as tensors where they are and read once per step by the metrics,
`dynmo.model.stats.as_numbers`): tokens_per_expert (assignments before dropping),
routing_imbalance (mean over forwards of max/mean expert load), expert_rows (rows computed: the
cost), useful_rows (kept assignments), dropped, active_tokens, aux_loss (mean), forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import MoEConfig, ModelConfig
from dynmo.model.aux_loss import add_with_aux
from dynmo.model.gpt import CausalSelfAttention, Halves
from dynmo.model.grouped import GroupRows, add_group_bias, dispatch_grouped, grouped_mm, probe
from dynmo.model.stats import StepStats

MoEOptions = MoEConfig  # options live in the config ([model.moe])


class ExpertLinear(nn.Module):
    """E independent linear maps, stacked: weight [E, in, out], bias [E, out]."""

    def __init__(self, num_experts: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_in, d_out).normal_(0.0, 0.02))
        self.bias = nn.Parameter(torch.zeros(num_experts, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The padded buffer [E, C, in] -> [E, C, out], one batched matmul."""
        return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight)

    def grouped(self, x: torch.Tensor, offs: torch.Tensor, idx: torch.Tensor | GroupRows) -> torch.Tensor:
        """Rows x [R, in] sorted by expert (`grouped_mm`'s offs; idx [R]: each row's expert, E
        for a row past the last offset: no bias, or its `GroupRows`) -> [R, out]."""
        return add_group_bias(grouped_mm(x, self.weight, offs), self.bias, idx)

    def before_compile(self, dtype: torch.dtype) -> None:
        probe(self.weight, dtype)  # the probe cannot run inside a graph


class Experts(nn.Module):
    """E GELU MLPs, each the size of the dense block's MLP (names mirror `MLP` for the init)."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, dropout: float):
        super().__init__()
        self.fc = ExpertLinear(num_experts, d_model, hidden)
        self.proj = ExpertLinear(num_experts, hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))

    def grouped(self, x: torch.Tensor, offs: torch.Tensor, idx: torch.Tensor, spare: bool = True) -> torch.Tensor:
        """Rows sorted by expert (`dynmo.model.grouped`) -> their experts' outputs; the rows' experts
        as one `GroupRows` for both biases (`spare`: whether a row may be nobody's, idx E)."""
        rows = GroupRows.of(idx, self.fc.bias.shape[0], x.dtype if not torch.is_autocast_enabled(x.device.type)
                            else torch.get_autocast_dtype(x.device.type), spare)
        return self.drop(self.proj.grouped(F.gelu(self.fc.grouped(x, offs, rows)), offs, rows))


@dataclass
class Routing:
    """One forward's routing decisions over all N tokens, in fixed shapes: A = N * top_k
    assignments in priority order (every token's first choice, then second choices, ...; the
    assignment of token n's j-th choice is j * N + n)."""

    probs: torch.Tensor  # [N, E] router probabilities
    expert: torch.Tensor  # [A] expert of each assignment
    token: torch.Tensor  # [A] its token
    weight: torch.Tensor  # [A] its gate weight
    slot: torch.Tensor  # [A] its rank among its expert's assignments (active tokens only)
    keep: torch.Tensor  # [A] bool: computed (its token active and within its expert's capacity)
    loads: torch.Tensor  # [E] assignments of active tokens per expert, before dropping
    kept: torch.Tensor  # [E] kept assignments per expert
    active: torch.Tensor  # [N] bool: tokens routed (the mask)
    n_active: torch.Tensor  # 0-dim: how many


class MoELayer(nn.Module):
    def __init__(self, d_model: int, hidden: int, opts: MoEOptions, dropout: float = 0.0):
        super().__init__()
        if not 1 <= opts.top_k <= opts.num_experts:
            raise ValueError(f"moe.top_k={opts.top_k} must be in 1..moe.num_experts={opts.num_experts}")
        self.opts = opts
        self.router = nn.Linear(d_model, opts.num_experts, bias=False)
        nn.init.normal_(self.router.weight, 0.0, 0.02)
        self.experts = Experts(opts.num_experts, d_model, hidden, dropout)


def choose(logits: torch.Tensor, opts: MoEOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [N, E] the router's probabilities, top_p [N, k] the gate weights of each token's
    top-k experts top_e [N, k]). Renormalised (`norm_topk_prob`, Mixtral's), the top-k
    probabilities divided by their sum are the softmax of the top-k logits: that is how they
    are computed, two operators forward and one backward fewer than a division."""
    probs = F.softmax(logits, dim=-1)
    if opts.norm_topk_prob:
        top_l, top_e = logits.topk(opts.top_k, dim=-1)  # the order of the probabilities'
        return probs, F.softmax(top_l, dim=-1).to(probs.dtype), top_e
    top_p, top_e = probs.topk(opts.top_k, dim=-1)
    return probs, top_p, top_e


def route(logits: torch.Tensor, opts: MoEOptions, active: torch.Tensor | None = None) -> Routing:
    """Top-k token choice from router logits [N, E] of the tokens `active` [N] (bool; None: all)
    marks (see the module docstring). Fixed shapes, no host synchronisation."""
    E, k = opts.num_experts, opts.top_k
    N = logits.shape[0]
    if active is None:
        active = torch.ones(N, dtype=torch.bool, device=logits.device)
    probs, top_p, top_e = choose(logits, opts)
    expert = top_e.t().reshape(-1)
    weight = top_p.t().reshape(-1)
    token = torch.arange(N, device=logits.device).repeat(k)
    live = active.repeat(k)
    # [E, A]: expert e's live assignments. Scanned along its inner dim: a GPU's scan along the
    # outer dim of an [A, E] tensor runs E columns wide and took milliseconds at A = 16k.
    onehot = ((torch.arange(E, device=expert.device).unsqueeze(1) == expert) & live).long()
    slot = (onehot.cumsum(1) - 1).gather(0, expert[None, :]).squeeze(0)  # rank within its expert
    loads = onehot.sum(1)
    n_active = active.sum()
    keep, kept = live, loads
    if opts.capacity_factor > 0:  # ceil(cf * tokens * k / E), the same float64 arithmetic as math.ceil's
        cap = torch.ceil(n_active.to(torch.float64) * opts.capacity_factor * k / E).to(loads.dtype)
        keep = live & (slot < cap)
        kept = torch.minimum(loads, cap)
    return Routing(probs=probs, expert=expert, token=token, weight=weight, slot=slot, keep=keep, loads=loads,
                   kept=kept, active=active, n_active=n_active)


def aux_loss(r: Routing, num_experts: int, all_active: bool = False) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss of one layer over its active tokens: E * sum_e f_e * P_e
    (0 without any); with `all_active` (no mask) `balance_loss`'s arithmetic."""
    if all_active:
        return balance_loss(r.loads, r.probs, num_experts, r.expert.shape[0] // r.probs.shape[0])
    f = r.loads.to(r.probs.dtype) / r.loads.sum().clamp(min=1)
    p = torch.where(r.active.unsqueeze(1), r.probs, 0.0).sum(0) / r.n_active.clamp(min=1)
    return num_experts * (f * p).sum()


def balance_loss(loads: torch.Tensor, probs: torch.Tensor, num_experts: int, k: int) -> torch.Tensor:
    """`aux_loss` with every one of the N tokens active (no mask): E * sum_e f_e P_e with
    f_e = loads_e / (N k) and P_e the probabilities [N, E] summed over the tokens / N, as one dot
    product with the constants folded into the loads: three operators, one backward."""
    N = probs.shape[0]
    return torch.dot(loads.to(probs.dtype) * (num_experts / (N * N * k)), probs.sum(0))


def dispatch_padded(x: torch.Tensor, r: Routing, experts: nn.Module) -> tuple[torch.Tensor, int]:
    """`model.moe.dispatch = "padded"`: run `experts` ([E, C, D] -> [E, C, D]) on the tokens x
    [N, D], every expert padded to the busiest one's C kept rows (read on the host: the buffer's
    shape follows the routing), and return the gate-weighted sum of each token's experts'
    outputs and the rows computed, E * C."""
    E, D = r.kept.shape[0], x.shape[1]
    C = int(r.kept.max())
    flat = torch.where(r.keep, r.expert * C + r.slot, E * C)  # a dropped assignment: the spare row
    buf = x.new_zeros(E * C + 1, D).index_copy(0, flat, x[r.token])
    y = experts(buf[: E * C].view(E, C, D)).reshape(E * C, D)
    y = torch.cat([y, y.new_zeros(1, D)])  # the spare row's output: zeros
    out = y[flat] * r.weight[:, None]  # in the experts' dtype promoted (bf16 x fp32 under autocast)
    return out.new_zeros(x.shape).index_add(0, r.token, out), E * C


def dispatch_ep(x: torch.Tensor, r: Routing, experts: nn.Module, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Expert parallelism (see the module docstring): the kept assignments go to the ranks of
    their experts by all-to-all (`experts.ep`: the group's handle; `experts.holders[e]`: where
    the copies of expert e sit in the group, rank * K + slot, under the layer's placement), each
    rank runs its local experts on exactly the rows it received (one grouped matmul per
    projection), and the outputs come back the same way. Returns the gate-weighted sum [N, D] and
    the rows each rank of the group computed.

    An expert with c copies: this replica's assignments to it, in routing order, are cut into c
    runs of equal length (within one), the j-th run to copy (j + this rank) mod c, so that the
    replicas' remainders spread over the copies. Without copies, which rank holds an expert
    does not change its numbers: an expert gets the same rows in the same order (by source rank,
    then in routing order) wherever it sits, and the outputs are summed per token in routing
    order."""
    ep = experts.ep
    P = ep.size
    K = len(experts.order) // P  # slots a rank
    kept = r.keep.nonzero().squeeze(1)  # the sizes of the all-to-all are read on the host anyway
    expert, token, weight = r.expert[kept], r.token[kept], r.weight[kept]
    holders = experts.holders.to(expert.device)
    if not experts.copied:
        where = holders[expert, 0]  # rank * K + slot of each kept assignment
    else:
        copies = experts.copies.to(expert.device)
        per = torch.bincount(expert, minlength=num_experts)  # this replica's assignments per expert
        by = torch.argsort(expert, stable=True)
        first = torch.cumsum(per, 0) - per
        nth = torch.empty_like(expert)
        nth[by] = torch.arange(expert.numel(), device=expert.device) - first[expert[by]]
        c = copies[expert]
        # which copy: equal runs in routing order, the runs' lengths rotated by the source rank so
        # that no copy takes every replica's remainder
        run = (nth * c // per[expert].clamp(min=1) + ep.rank) % c
        where = holders[expert, run]
    order = torch.argsort(where, stable=True)  # by destination rank, then slot, then routing order
    counts = torch.bincount(where, minlength=P * K)  # this replica's kept assignments per position
    table = ep.gather_counts(counts)  # [P, P * K]: every rank's, the same on all of them
    send = counts.view(P, K).sum(1).tolist()
    mine = table[:, ep.rank * K : (ep.rank + 1) * K]  # [P, K]: rows from each source per local slot
    recv = mine.sum(1).tolist()
    xs = ep.all_to_all(x[token[order]], send, recv)  # by source rank, then local slot
    local = torch.repeat_interleave(torch.arange(K).repeat(P), mine.reshape(-1)).to(x.device)
    by_slot = torch.argsort(local, stable=True)  # by local slot, then source rank, then routing order
    offs = torch.cumsum(mine.sum(0), 0).to(device=x.device, dtype=torch.int32)
    ys = experts.grouped(xs[by_slot], offs, local[by_slot])
    y = ys.new_empty(ys.shape).index_copy(0, by_slot, ys)
    back = ep.all_to_all(y, recv, send)  # in the order the rows were sent
    back = back.new_empty(back.shape).index_copy(0, order, back)  # routing order again
    out = back * weight[:, None]  # promoted as in `dispatch_padded`
    per_rank = table.view(P, P, K).sum(dim=(0, 2)).tolist()
    return out.new_zeros(x.shape).index_add(0, token, out), per_rank


def routing_stats(r: Routing, aux: torch.Tensor, expert_rows, ep_rank_rows: list[int] | None = None) -> dict:
    """One forward's routing figures for `StepStats.add` (see the module docstring), as device
    tensors (read once per step by the metrics); `expert_rows` the rows computed."""
    loads = r.loads
    total = loads.sum()
    useful = r.kept.sum()
    mean = total.to(torch.float64) / loads.shape[0]
    out = dict(
        tokens_per_expert=loads,
        routing_imbalance=torch.where(total > 0, loads.max() / mean, 1.0),  # max / mean load
        expert_rows=expert_rows,
        useful_rows=useful,
        dropped=total - useful,
        active_tokens=r.n_active,
        aux_loss=aux.detach(),
    )
    if ep_rank_rows is not None:  # expert parallelism: the rows every rank of the group computed
        out["ep_rank_rows"] = ep_rank_rows
    return out


def routing_summary(s: StepStats) -> dict:
    """A step's routing statistics from the forwards' sums ({} before the first forward)."""
    if not s.forwards:
        return {}
    if "routing" in s.sums:  # `dropless_grouped`: one vector, every assignment computed once, none dropped
        v = s.sums["routing"].detach()
        active = s.sums.get("active_tokens")  # `dropless_all_active`: counted on the host
        loads = v[:-2 if active is not None else -3].round().to(torch.int64)
        rows = loads.sum()
        if active is None:  # `dropless_grouped`: the active tokens and max / mean load a forward in the vector
            active, imbalance = v[-3].round().to(torch.int64), v[-1] / s.forwards
        else:  # the busiest loads summed over the mean loads summed (max / mean, every forward of one size)
            imbalance = v[-1] * loads.shape[0] / rows.clamp(min=1)
        return {"tokens_per_expert": loads, "routing_imbalance": imbalance, "expert_rows": rows,
                "useful_rows": rows, "dropped": rows - rows, "active_tokens": active,
                "aux_loss": v[-2] / s.forwards, "forwards": s.forwards}
    rows = s.sums["expert_rows"]
    return {
        "tokens_per_expert": s.sums["tokens_per_expert"],
        "routing_imbalance": s.mean("routing_imbalance"),
        "expert_rows": rows,
        "useful_rows": s.sums.get("useful_rows", rows),
        "dropped": s.sums.get("dropped", rows - rows),
        "active_tokens": s.sums["active_tokens"],
        "aux_loss": s.mean("aux_loss"),
        "forwards": s.forwards,
    } | ({"ep_rank_rows": s.sums["ep_rank_rows"]} if "ep_rank_rows" in s.sums else {})


def sparse_mlp(h: torch.Tensor, mask: torch.Tensor, router: nn.Module, experts: nn.Module, opts: MoEOptions,
               stats: StepStats) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE MLP on the active tokens of h [B, T, D] (`mask`; None: every token, and the fewest
    operators; inactive ones get zeros): its output and its (unweighted) load-balancing loss;
    the forward's routing figures go into `stats`."""
    B, T, D = h.shape
    h = h.reshape(B * T, D)
    ep = getattr(experts, "ep", None)
    if ep is None and opts.dispatch != "padded" and opts.capacity_factor <= 0:
        if mask is None:
            out, aux = dropless_all_active(h, router(h), experts, opts, stats)
        else:
            out, aux = dropless_grouped(h, router(h), mask.reshape(-1), experts, opts, stats)
        return out.to(h.dtype).view(B, T, D), aux
    r = route(router(h), opts, None if mask is None else mask.reshape(-1))
    ep_rows = None
    if ep is not None:
        out, per_rank = dispatch_ep(h, r, experts, opts.num_experts)
        rows, ep_rows = per_rank[experts.ep.rank], per_rank
    elif opts.dispatch == "padded":
        out, rows = dispatch_padded(h, r, experts)
    else:
        out = dispatch_grouped(h, r, experts)
        rows = r.kept.sum()
    aux = aux_loss(r, opts.num_experts, all_active=mask is None)
    with torch.no_grad():
        stats.add(**routing_stats(r, aux, rows, ep_rows))
    return out.to(h.dtype).view(B, T, D), aux


def by_expert(key: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The assignments' experts `key` [A] (in priority order) sorted by expert, stably (an
    expert's rows then in priority order, the order its weight gradients sum them): (sorted key,
    the permutation, ends [E + 1] = [0, end of expert 0's rows, ..., end of expert E-1's]: the
    grouped matmuls' offsets and the loads, from one `searchsorted`)."""
    key, order = torch.sort(key, stable=True)
    ends = torch.searchsorted(key, torch.arange(-1, E, device=key.device, dtype=key.dtype), right=True,
                              out_int32=True)
    return key, order, ends


def dropless_grouped(x: torch.Tensor, logits: torch.Tensor, active: torch.Tensor, experts: nn.Module,
                     opts: MoEOptions, stats: StepStats) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` + `dispatch_grouped` + `aux_loss` + `routing_stats` without a capacity, the
    default, in the operators its work needs: the same assignments in the same order, the same
    rows, values and loss. Assignments in priority order (a = j * N + n) are keyed by expert (E:
    an inactive token's, which sorts last, reads a spare zero row and adds into a spare output
    row, `dispatch_grouped`), one stable sort orders them, a `searchsorted` of the sorted keys
    gives the grouped matmuls' offsets and every expert's load, and the forward's figures go
    into `stats` as two small vectors (`routing_summary` reads them)."""
    E, k = opts.num_experts, opts.top_k
    N = x.shape[0]
    probs, top_p, top_e = choose(logits, opts)
    dead = ~active
    # [A] in priority order; E: an inactive token's, sorted last
    key, order, ends = by_expert(top_e.t().masked_fill(dead, E).reshape(-1), E)
    token = (order % N).masked_fill(key == E, N)
    offs = ends[1:]
    xs = F.pad(x, (0, 0, 0, 1)).index_select(0, token)  # row N: the spare zero token
    y = experts.grouped(xs, offs, key)
    # an inactive token's weight 0, so that its row's undefined output sends no gradient back
    y = y * torch.take(top_p.t().masked_fill(dead, 0.0), order).unsqueeze(1)  # promoted as in the padded path
    out = y.new_zeros(N + 1, y.shape[1]).index_add(0, token, y)[:N]
    # load-balancing loss E * sum_e f_e * P_e (`aux_loss`), f_e from the loads the offsets give
    loads = (offs - ends[:-1]).to(torch.float32)  # exact below 2**24 assignments an expert
    n_active = active.sum(dtype=torch.float32)
    f = loads.to(probs.dtype) / offs[-1].clamp(min=1)
    p = (probs * active.unsqueeze(1)).sum(0) / n_active.clamp(min=1)
    aux = E * (f * p).sum()
    with torch.no_grad():
        # one vector a forward, one addition a microbatch: the loads, the active tokens, the
        # loss and max / mean load (f's mean is 1 / E; 1 without any); `routing_summary` reads it
        stats.add(routing=torch.cat((loads, torch.stack((n_active, aux, (f.max() * E).clamp(min=1))))))
    return out, aux


def dropless_all_active(x: torch.Tensor, logits: torch.Tensor, experts: nn.Module, opts: MoEOptions,
                        stats: StepStats) -> tuple[torch.Tensor, torch.Tensor]:
    """`dropless_grouped` with every token active: no assignment to set aside, so no spare row,
    no masking, and the loss's counts are the shapes' (N tokens, N * k assignments). The same
    assignments, order, rows and values."""
    E, k = opts.num_experts, opts.top_k
    N = x.shape[0]
    probs, top_p, top_e = choose(logits, opts)
    key, order, ends = by_expert(top_e.t().reshape(-1), E)
    token = order % N
    offs = ends[1:]
    y = experts.grouped(x.index_select(0, token), offs, key, spare=False)
    y = y * torch.take(top_p.t(), order).unsqueeze(1)  # promoted as in the padded path
    out = y.new_zeros(N, y.shape[1]).index_add(0, token, y)
    loads = (offs - ends[:-1]).to(torch.float32)  # exact below 2**24 assignments an expert
    aux = balance_loss(loads, probs, E, k)
    with torch.no_grad():  # one vector a forward (loads, loss, busiest load), one addition a microbatch
        stats.add(routing=torch.cat((loads, aux.view(1).to(torch.float32), loads.max().view(1))), active_tokens=N)
    return out, aux


class RoutedBlock(Halves, nn.Module):
    """What every MoE block shares: its step statistics and its aux loss carried into backward.
    A subclass sets `opts` (MoEConfig) and defines `attn_half(x, mask) -> (x, mask)` and
    `moe_branch(x, mask) -> (y, aux)` (the MoE's output for the residual stream x, and its
    unweighted load-balancing loss). The MLP half adds y to x and carries aux into backward."""

    opts: MoEOptions
    # Whether the block may be handed inactive tokens (mask False) to leave out. Off (the
    # default), as for the dense blocks, the mask is not read: no case deactivates tokens in a
    # model of routed blocks (early exit runs on dense blocks only).
    skip_inactive = False

    def routed(self, mask: torch.Tensor) -> torch.Tensor | None:
        """The mask the MoE routes by: None (every token) unless `skip_inactive`."""
        return mask if self.skip_inactive else None

    def reset_stats(self) -> None:
        self._stats = StepStats()

    @property
    def last_stats(self) -> dict:
        return routing_summary(self._stats)

    def mlp_half(self, x: torch.Tensor, mask: torch.Tensor):
        y, aux = self.moe_branch(x, mask)
        return add_with_aux(x, y, aux, self.opts.aux_loss_coef), mask

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
        return sparse_mlp(self.ln2(x), self.routed(mask), self.moe.router, self.moe.experts, self.opts, self._stats)
