"""Mixture of Depths block ("mod", Raposo et al. 2024): per sequence, a router picks the top-k
tokens (k = capacity x sequence length) that go through the block; the others bypass it on the
residual stream, bit for bit.

    r = router(x)                      one scalar per token
    chosen = top-k of r per sequence   (expert-choice routing; kept in position order)
    w = sigmoid(r[chosen])             the router weight of each chosen token
    h = x[chosen] + w * attn(x[chosen])          attention among the chosen tokens, causal
    out[chosen] = h + w * mlp(h) ;  out[others] = x[others]

The router weight multiplies each of the block's two residual updates so the router gets a
gradient from the loss (Raposo et al. multiply the block's whole update by the raw logit; the
sigmoid keeps the update bounded and starts every block at half strength instead of near
zero). Weighting each half's update makes the block two halves (`Halves`): the attention half
routes and hands its decision -- `route` (w at the chosen positions, 0 elsewhere, [B, T]) and
`chosen` ([B, T] bool) -- to the MLP half beside the residual stream, across a stage boundary
when one falls between them (`parallel.unit = "sublayer"`), and the MLP half updates the same
rows. A whole block (`dense_forward`) does the same on the chosen rows gathered once and
scattered once: the same values with fewer operators.

Top-k over the whole sequence is not causal: whether token t is chosen depends on later
tokens. As in the paper, a small predictor (a linear map of the detached input) learns to
predict top-k membership with a binary cross-entropy loss, carried into the backward pass by
`attach_aux_loss` (`predictor_loss_coef`); the detached input keeps it from changing the
model. With `routing = "predictor"` the block routes causally: a token goes through iff the
predictor says so (the work per block then varies with the predictor, padded to the busiest
sequence of the microbatch).

Capacity may differ per block (`capacities`, indexed by block number). The constructor gets
only the config; `dynmo.model.layers.tag_layer` sets `layer.index = spec.index - 1` when
`build_layer` builds the block and when a migrated block is rebuilt on its new rank. Without
`capacities`, every block uses `capacity` and the index is not needed.

At capacity 1.0 there is no choice: every token goes through the block in place, each update
weighted by its router weight, and there is no predictor to train.

With `skip_inactive` set, only active tokens (mask True) can be chosen; unset (the default, as
in the dense blocks: no case deactivates tokens in a model of routed blocks) the mask is not
read. The mask passes through unchanged.

`MoDRouting` holds all of the above; a family's block only supplies its sub-layers and their
attention and MLP branches: `MoDBlock` (gpt) and `LlamaMoDBlock` (llama, whose attention
rotates each chosen token at its original position, since the gathered rows no longer sit
where their rotary phase would otherwise be taken from).

Per-layer stats (`block.last_stats`, summed over the forwards since `block.reset_stats()`):
rows (token rows the block computed: its cost, B x k per forward), tokens_processed (active
chosen tokens), active_tokens, capacity, attn_pairs (causal query-key pairs among chosen
tokens), predictor_accuracy and aux_loss (means; not at capacity 1.0), forwards. A split block's MLP half reports
its own rows, tokens_processed and forwards; its attention half everything else. The
measured ones stay device tensors until the metrics read them (`dynmo.model.stats.as_numbers`,
once per step); with top-k routing no step of the block waits on the device.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import MoDConfig, ModelConfig
from dynmo.model import llama
from dynmo.model.aux_loss import attach_aux_loss
from dynmo.model.gated import gated_add, routed_add
from dynmo.model.gpt import MLP, CausalSelfAttention, Halves, active_rows
from dynmo.model.predictor import predictor_loss
from dynmo.model.rows import put_rows, take_rows
from dynmo.model.stats import StepStats

MoDOptions = MoDConfig  # options live in the config ([model.mod])


class MoDRouting(Halves, nn.Module):
    """What every family's Mixture of Depths block shares: router, predictor, capacities,
    routing, the weighted updates, the predictor loss and the stats. A family's block adds its
    sub-layers after calling this constructor and defines `attend(sel, positions)` (the
    attention branch of the chosen rows `sel` [B, k, D] at original positions [B, k], causal
    among them) and `feed(h)` (the MLP branch of rows h), and `halves` (router and predictor
    belong to the attention half)."""

    carry = ("route", "chosen")
    index: int | None = None  # block number (0-based); set by layers.tag_layer, needed only for `capacities`

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.opts = cfg.mod
        if self.opts.routing not in ("topk", "predictor"):
            raise ValueError(f"mod.routing={self.opts.routing!r}; use 'topk' or 'predictor'")
        for c in [self.opts.capacity, *self.opts.capacities]:
            if not 0.0 < c <= 1.0:
                raise ValueError(f"MoD capacity {c} must be in (0, 1] (a fraction of the sequence)")
        # The router is a linear map with no bias (Raposo et al.'s w^T x, as MoE routers): a
        # shift of every score changes no choice. It is made with one and the bias dropped, so
        # the random stream, and every later parameter's initial value, is as it always was.
        # The predictor keeps its bias, the prior of a token being chosen (the capacity).
        self.router = nn.Linear(cfg.d_model, 1)
        self.router.bias = None
        self.predictor = nn.Linear(cfg.d_model, 1)
        for lin in (self.router, self.predictor):
            nn.init.normal_(lin.weight, 0.0, 0.02)
        nn.init.zeros_(self.predictor.bias)
        self.reset_stats()

    def attend(self, sel: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def feed(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    _settled: float | None = None  # the capacity read once before compiling (`before_compile`)

    def before_compile(self, dtype: torch.dtype) -> None:
        """Read the capacity once, before the graph is traced (`dynmo.runtime.compiled`): inside
        the graph it is then a number, not `capacities[self.index]`, so the blocks of one
        capacity share their compiled graphs (a guard on each block's index compiled one set per
        block and ran past the compile cache's limit with per-block capacities and half blocks)."""
        self._settled = self.capacity

    @property
    def capacity(self) -> float:
        if self._settled is not None:
            return self._settled
        caps = self.opts.capacities
        if not caps:
            return self.opts.capacity
        if self.index is None:
            raise RuntimeError(
                "mod.capacities is per block but this block's layer.index is unset; build it with "
                "dynmo.model.layers.build_layer (or tag_layer it) so it knows its block number"
            )
        if not 0 <= self.index < len(caps):
            raise ValueError(f"mod.capacities has {len(caps)} entries, no entry for block {self.index}")
        return caps[self.index]

    def tokens_per_sequence(self, T: int) -> int:
        return min(T, max(1, math.ceil(self.capacity * T)))

    def reset_stats(self) -> None:
        self._stats = StepStats()

    @property
    def last_stats(self) -> dict:
        s = self._stats
        if not s.forwards:
            return {}
        if self.part == "mlp":  # a split block's MLP half: its own rows; the routing is the attention half's
            return {"rows": s.sums["rows"], "tokens_processed": s.sums["tokens_processed"], "forwards": s.forwards}
        out = {"rows": s.sums["rows"], "attn_pairs": s.sums["attn_pairs"]}
        if "routing" in s.sums:  # routed with the mask (`_attn_rows`): one device vector a forward
            v = s.sums["routing"].detach()
            tokens, active, correct, aux = v[0].round().to(torch.int64), v[1].round().to(torch.int64), v[2], v[3]
        else:  # every token active: the counts are the shapes', the loss summed over the tokens
            tokens, active = s.sums["tokens_processed"], s.sums["active_tokens"]
            wrong, aux = s.sums.get("wrong"), s.sums.get("aux")
            correct = None if wrong is None else active - wrong
            aux = None if aux is None else aux * (s.forwards / active)
        out |= {"tokens_processed": tokens, "active_tokens": active, "capacity": self.capacity, "forwards": s.forwards}
        if correct is not None:  # a block at capacity 1.0 has no predictor to train
            out |= {"predictor_accuracy": correct / (active.clamp_min(1) if torch.is_tensor(active) else max(active, 1)),
                    "aux_loss": aux / s.forwards}
        return out

    # Whether the block may be handed inactive tokens (mask False) and must never choose them.
    # Off (the default), as for the dense blocks, the block never looks at the mask: no case
    # deactivates tokens in a model of routed blocks (early exit runs on dense blocks only), so
    # every token is active and routing costs no masking.
    skip_inactive = False

    def _lean(self) -> bool:
        """Top-k routing over a sequence whose tokens are all active: the routing path with the
        fewest operators (`_lean_rows`)."""
        return self.opts.routing == "topk" and not self.skip_inactive

    def _whole(self) -> bool:
        """Capacity 1.0 (and no inactive token to leave out): every token goes through the
        block, in place, each update weighted by its router weight (`routed_add`); there is no
        choice to make, so no top-k, gather or scatter, and no predictor to train."""
        return self.capacity >= 1.0 and not self.skip_inactive

    def attn_half(self, x: torch.Tensor, mask: torch.Tensor):
        if self._whole():
            self._whole_stats(x)
            h, w = routed_add(x, self.attend(x, None), self.router)
            return h, mask, w.squeeze(-1), mask
        if self._lean():
            xp, h, g, idx, w, aux, n = self._lean_rows(x)
            route = w.new_zeros(x.shape[:2]).scatter(1, idx, w.squeeze(-1))
            chosen = torch.zeros_like(mask).scatter(1, idx, True)
            return put_rows(xp, g, h, aux, self.opts.predictor_loss_coef / n), mask, route, chosen
        x, mask, route, chosen, aux = self._attn_half(x, mask)
        return attach_aux_loss(x, aux, self.opts.predictor_loss_coef), mask, route, chosen

    def dense_forward(self, x: torch.Tensor, mask: torch.Tensor):
        """The whole block: the chosen rows gathered once, attention and MLP on them, scattered
        back once. The same rows, weights and operations as the two halves (which scatter after
        the attention and gather again for the MLP, as a stage boundary between them needs), so
        the same values, with fewer operators."""
        if self._whole():
            self._whole_stats(x)
            h, w = routed_add(x, self.attend(x, None), self.router)
            return gated_add(h, w, self.feed(h)), mask
        if self._lean():
            xp, h, g, idx, w, aux, n = self._lean_rows(x)
            coef = self.opts.predictor_loss_coef / n
        else:
            xp, h, g, idx, valid, w, _, aux = self._attn_rows(x, mask)
            w, coef = w.unsqueeze(-1), self.opts.predictor_loss_coef
        new = gated_add(h, w, self.feed(h))
        return put_rows(xp, g, new, aux, coef), mask

    def forward_with_aux(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output and its (unweighted) predictor loss, for single-process use."""
        if self._whole():
            return self.dense_forward(x, mask)[0], x.new_zeros(())
        if self._lean():
            xp, h, g, idx, w, aux, n = self._lean_rows(x)
            return put_rows(xp, g, gated_add(h, w, self.feed(h))), aux / n
        h, mask, route, chosen, aux = self._attn_half(x, mask)
        return self.mlp_half(h, mask, route, chosen)[0], aux

    def _whole_stats(self, x: torch.Tensor) -> None:
        """The stats of a forward at capacity 1.0."""
        B, T, _ = x.shape
        self._stats.add(rows=B * T, attn_pairs=B * T * (T + 1) // 2, tokens_processed=B * T, active_tokens=B * T)

    def _lean_rows(self, x: torch.Tensor):
        """`_attn_rows` for top-k routing with every token active: (x passed through for
        `put_rows`, h [B, k, D] the chosen rows after attention, g their gather index, idx
        [B, k] their positions in order, w [B, k, 1] their router weights, the predictor loss
        summed over the tokens, and their number: the mean's gradient is the sum's with the
        coefficient divided by it, no division a step). The router scores every token without
        a gradient, to choose; the chosen rows' weights are the router's again on those rows
        (`routed_add`), so its gradient runs through k rows, not a gather of T."""
        B, T, D = x.shape
        k = self.tokens_per_sequence(T)
        with torch.no_grad():
            top = self.router(x).squeeze(-1).topk(k, dim=1, sorted=False).indices
            idx = top.sort(dim=1).values  # in position order: attention stays causal among them
        aux, wrong = predictor_loss(x, self.predictor, top)
        g = idx.unsqueeze(-1).expand(-1, -1, D)
        xp, sel = take_rows(x, g)  # [B, k, D]: the only tokens the block computes on
        h, w = routed_add(sel, self.attend(sel, idx), self.router)
        self._stats.add(rows=B * k, attn_pairs=B * k * (k + 1) // 2, tokens_processed=B * k, active_tokens=B * T,
                        wrong=wrong, aux=aux.detach())
        return xp, h, g, idx, w, aux, B * T

    def _attn_half(self, x: torch.Tensor, mask: torch.Tensor):
        xp, h, g, idx, valid, w, logits, aux = self._attn_rows(x, mask)
        out = put_rows(xp, g, h)  # non-chosen tokens are copied from x untouched
        route = torch.zeros_like(logits).scatter(1, idx, w)
        chosen = torch.zeros_like(mask).scatter(1, idx, valid)
        return out, mask, route, chosen, aux

    def _choose(self, masked: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor, k: int):
        """(idx [B, k'] the chosen positions in position order, padding rows last; valid [B, k'];
        target [B, T] the router's top-k membership among active tokens, the predictor's label;
        live) from the router logits with inactive tokens at -inf (`masked`)."""
        T = mask.shape[1]
        top = masked.topk(k, dim=1)
        if self.opts.routing == "topk":
            # a top-k row is an inactive token's exactly where its logit is -inf
            idx, pad, live = top.indices, top.values == float("-inf"), mask
        else:  # causal: each token decides alone; pad to the sequence with most accepted tokens
            live = (pred > 0) & mask
            n = max(1, int(live.sum(1).max()))
            idx = pred.masked_fill(~live, float("-inf")).topk(n, dim=1).indices
            pad = ~live.gather(1, idx)
        # Chosen tokens in position order (attention stays causal among them); padding rows
        # (inactive or not accepted) go last, so no chosen token attends to them: one sort of
        # position + T for padding rows, whose keys give back both.
        keys = idx.add(pad, alpha=T).sort(dim=1).values
        idx, valid = keys.remainder(T), keys < T
        if self.opts.routing == "topk":  # the chosen active tokens are the router's top-k among them
            target = torch.zeros_like(mask).scatter(1, idx, valid)
        else:
            target = torch.zeros_like(mask).scatter(1, top.indices, True) & mask
        return idx, valid, target, live

    def _attn_rows(self, x: torch.Tensor, mask: torch.Tensor):
        """Routing and the attention update of the chosen rows: (x passed through for
        `put_rows`, h [B, k, D] the chosen rows after attention, g their gather index, idx [B, k] their positions, valid, w their router
        weights, the router logits, the predictor loss). A padding row's weight is 0, so its
        update adds an exact zero: it passes as it came."""
        B, T, D = x.shape
        k = self.tokens_per_sequence(T)
        logits = self.router(x).squeeze(-1)  # [B, T]
        pred = self.predictor(x.detach()).squeeze(-1)  # [B, T]
        masked = logits.masked_fill(~mask, float("-inf"))
        with torch.no_grad():
            idx, valid, target, live = self._choose(masked.detach(), pred, mask, k)
            # tokens processed (top-k: the chosen active ones; the predictor's: its accepted
            # ones), predictions that agree with the router, active tokens; as floats, the
            # predictor loss's target and weight among them
            flags = torch.stack((target if self.opts.routing == "topk" else live, mask,
                                 ((pred > 0) == target) & mask, target)).to(torch.float32)
            counts = flags.sum((1, 2))  # exact below 2**24 tokens
            tw = flags if pred.dtype == torch.float32 else flags.to(pred.dtype)
        g = idx.unsqueeze(-1).expand(-1, -1, D)
        xp, sel = take_rows(x, g)  # [B, k, D]: the only tokens the block computes on
        if self.opts.routing == "topk":  # sigmoid(-inf) = 0: a padding row (inactive) weighs 0
            w = torch.sigmoid(masked).gather(1, idx)
        else:
            w = torch.sigmoid(logits.gather(1, idx)) * valid  # 0 on padding rows
        h = gated_add(sel, w.unsqueeze(-1), self.attend(sel, idx))
        den = counts[1].clamp_min(1)
        aux = F.binary_cross_entropy_with_logits(pred, tw[3], tw[1], reduction="sum") / den
        self._record(idx.shape[1], B, counts, aux)
        return xp, h, g, idx, valid, w, logits, aux

    def mlp_half(self, h: torch.Tensor, mask: torch.Tensor, route: torch.Tensor, chosen: torch.Tensor):
        """The MLP's weighted update of the rows the attention half chose (in position order,
        padded to the sequence with most of them); every other row passes bit for bit."""
        B, T, D = h.shape
        if self._whole():
            if self.part == "mlp":  # a whole block counted its rows in its attention half
                self._stats.add(rows=B * T, tokens_processed=B * T)
            return gated_add(h, route.unsqueeze(-1), self.feed(h)), mask
        # top-k routing chose at most k tokens a sequence: k rows, padded, with no host
        # synchronisation; the predictor's count is the data's
        width = self.tokens_per_sequence(T) if self.opts.routing == "topk" else None
        idx, valid = active_rows(chosen, width)
        g = idx.unsqueeze(-1).expand(-1, -1, D)
        hp, sel = take_rows(h, g)
        w = route.gather(1, idx).unsqueeze(-1)  # 0 on padding rows: their update is an exact zero
        new = gated_add(sel, w, self.feed(sel))
        if self.part == "mlp":  # a whole block counted its rows in its attention half
            self._stats.add(rows=B * idx.shape[1], tokens_processed=B * width if self._lean() else valid.sum())
        return put_rows(hp, g, new), mask

    @torch.no_grad()
    def _record(self, k: int, B: int, counts, aux) -> None:
        # one device vector a forward (tokens processed, active tokens, agreeing predictions,
        # loss), summed where it is: one addition a microbatch; the metrics read it once a step
        self._stats.add(rows=B * k, attn_pairs=B * k * (k + 1) // 2, routing=torch.cat((counts[:3], aux.view(1))))


class MoDBlock(MoDRouting):
    """GPT pre-norm block that processes only the router's top-k tokens of each sequence."""

    prunable = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # its Linears, for weight pruning
    mlp_units = ("mlp.fc", "mlp.proj")  # the MLP's in and out Linears, for structured pruning
    halves = (("router", "predictor", "ln1", "attn"), ("ln2", "mlp"))

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def attend(self, sel: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # learned position embeddings are already in the hidden state: positions are not needed
        return self.attn(self.ln1(sel))

    def feed(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln2(h))


class LlamaMoDBlock(MoDRouting):
    """Llama decoder block that processes only the router's top-k tokens of each sequence, at
    their original positions (rotary), causal among them."""

    prunable = llama.Block.prunable
    halves = (("router", "predictor", "input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.input_layernorm = llama.RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = llama.Attention(cfg)
        self.post_attention_layernorm = llama.RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = llama.SwiGLU(cfg)

    def attend(self, sel: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(sel), positions)

    def feed(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(h))
