"""CALM-style early exit of tokens (Schuster et al. 2022; the paper's F.6), a `Case`.

After every block from `early_exit.first_block` on, a per-token confidence decides which of
the still-active tokens exit. An exited token keeps its hidden state from then on: later blocks
do not update it, and the head computes its logits (and the loss) from that final state.

Which confidence: CALM's strongest measure is the softmax response of the shared LM head, but
in a pipeline the head lives only on the last stage, so no earlier stage can evaluate it (and a
per-block copy of a vocabulary-sized head would cost more than the block). We use CALM's
learned alternative: a small per-block classifier, a Linear(d_model, 1) on the normalised,
detached hidden state, `conf = sigmoid(exit_head(layer_norm(h)))`; a token exits when
`conf >= early_exit.threshold`. Its training signal must also be local: the label is CALM's
hidden-state saturation, `cos(h_out, h_in) >= early_exit.saturation` (the block barely changed
the token, so later blocks are likely to change it little too). The binary cross-entropy over
the active tokens is carried into the backward pass by `attach_aux_loss` (coefficient
`early_exit.aux_loss_coef`); the detached input keeps it from changing the model itself. The
classifier trains from step 0; tokens exit from `early_exit.start_step` on.

Compute only on active tokens: the case turns on `skip_inactive` in every block (the dense
block of the gpt or the llama family, `dynmo.model.gpt.SkipsInactive`), which then computes the
active tokens only, with exited tokens still serving as keys and values with their frozen hidden state (CALM's state propagation), so an
active token's output is exactly what the dense block would give it. The exit decision is an
`ExitGate`, a forward hook on the block that runs the classifier on the block's output and
updates the mask. The classifier is a submodule of the block (`block.exit_head`), so it trains,
migrates and is checkpointed with it; a block that arrives by migration gets an empty one
before its weights load (`prepare_layer`).

One host read a block forward: how many rows to gather (the data's; read before the block's
forward, so a compiled block keeps one graph per width). The gate's counts, confidences and
the classifier's loss stay on the device; the metrics read them once per step.

Shapes crossing stage boundaries stay fixed: the hidden state keeps [batch, seq, d_model] and
the bool mask of active tokens travels with it.

Half-block units (`parallel.unit = "sublayer"`): a block still decides once, after its MLP
half, which holds the classifier. Both halves compute the active tokens only; the attention
half's gate counts its rows and hands the block's input on beside the residual stream (carry
`block_input`, across a stage boundary when one falls between the halves), for the MLP half's
saturation label. The decisions, and so the losses, are those of whole blocks.

Per-layer metrics (summed over the step's microbatch forwards): exit_active_tokens (tokens the
block computed on), exit_rows (rows it computed, incl. padding), exit_tokens (tokens that
exited after it), exit_rate (exit_tokens / exit_active_tokens), exit_confidence (mean over
active tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import ConfigError, EarlyExitConfig
from dynmo.dynamics.case import Case
from dynmo.model.aux_loss import attach_aux_loss
from dynmo.model.stats import StepStats, as_numbers


def check_options(e: EarlyExitConfig, cfg) -> None:
    n = cfg.model.n_layers
    if not 0 <= e.first_block < n:
        raise ConfigError(f"early_exit.first_block={e.first_block} must be a block number in 0..{n - 1}")
    if not 0.0 <= e.threshold <= 1.0:
        raise ConfigError(f"early_exit.threshold={e.threshold} must be in [0, 1] (a confidence)")
    if not -1.0 <= e.saturation <= 1.0:
        raise ConfigError(f"early_exit.saturation={e.saturation} must be in [-1, 1] (a cosine similarity)")
    if e.start_step < 0 or e.aux_loss_coef < 0:
        raise ConfigError("early_exit.start_step and early_exit.aux_loss_coef must be >= 0")
    if cfg.model.family not in ("gpt", "llama"):
        raise ConfigError(f"early_exit computes active tokens with the gpt and llama families' dense blocks; "
                          f"model.family={cfg.model.family!r} has no such path yet (set early_exit.enabled = false)")
    if cfg.model.block != "dense":
        raise ConfigError(
            f"early_exit works on the dense block; model.block={cfg.model.block!r} routes tokens itself "
            "(set model.block = \"dense\" or early_exit.enabled = false)"
        )


class ExitGate:
    """Forward hook of a block: counts the tokens and rows the block computed and, on blocks
    from `first_block` on (`can_exit`), lets confident active tokens exit after it (see the
    module docstring). `exiting` is set per step by the case (start_step)."""

    def __init__(self, opts: EarlyExitConfig, can_exit: bool, hands_input: bool = False):
        self.opts = opts
        self.can_exit = can_exit
        self.hands_input = hands_input  # an attention half: pass the block's input on to its MLP half
        self.exiting = False
        self.handle = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = StepStats()

    def __call__(self, block: nn.Module, args: tuple, output: tuple) -> tuple[torch.Tensor, ...]:
        # Everything here stays on the device (counts, confidences, the classifier's loss over
        # the active tokens as a masked mean): the metrics read the sums once per step.
        x, mask = args[0], args[1]
        out = output[0]
        B, T, D = x.shape
        n_active = mask.sum()
        width = block.active_width  # what the block gathered: None, every token
        rows = B * (T if width is None else width)  # rows the block computed, padding included
        exited, conf_sum = 0, 0.0
        if self.can_exit:
            active_in = mask
            logit = block.exit_head(F.layer_norm(out.detach(), (D,))).squeeze(-1)  # [B, T]
            with torch.no_grad():
                conf = torch.sigmoid(logit)
                block_input = args[2] if len(args) > 2 else x  # a split block's MLP half is handed it
                label = (F.cosine_similarity(out, block_input, dim=-1) >= self.opts.saturation).to(logit.dtype)
                conf_sum = torch.where(active_in, conf, 0).sum()
                if self.exiting:
                    leave = active_in & (conf >= self.opts.threshold)
                    exited = leave.sum()
                    mask = active_in & ~leave
            bce = F.binary_cross_entropy_with_logits(logit, label, reduction="none")
            # the mean over the tokens that were active at this block (none: 0, no gradient)
            aux = torch.where(active_in, bce, 0).sum() / n_active.clamp(min=1)
            out = attach_aux_loss(out, aux, self.opts.aux_loss_coef)
        self.stats.add(active_tokens=n_active, rows=rows, exited=exited, conf_sum=conf_sum)
        if self.hands_input:
            return out, mask, x.detach()
        return out, mask

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def summary(self, s: dict[str, float] | None = None) -> dict[str, float]:
        """The step's metrics from `s`, this gate's sums read as numbers (read here if not given)."""
        if not self.stats.forwards:
            return {}
        if s is None:
            (s,) = as_numbers([self.stats.sums])
        out = {"active_tokens": s["active_tokens"], "rows": s["rows"]}
        if self.can_exit:
            out["tokens"] = s["exited"]
            out["rate"] = s["exited"] / s["active_tokens"] if s["active_tokens"] else 0.0
            out["confidence"] = s["conf_sum"] / s["active_tokens"] if s["active_tokens"] else 0.0
        return out


def install_gate(block: nn.Module, opts: EarlyExitConfig, can_exit: bool) -> ExitGate:
    """Make `block` (a whole block or one half) compute active tokens only and decide exits
    after it (`can_exit` needs `block.exit_head`)."""
    block.skip_inactive = True
    gate = ExitGate(opts, can_exit, hands_input=getattr(block, "part", None) == "attn")
    gate.handle = block.register_forward_hook(gate)
    return gate


class EarlyExit(Case):
    name = "early-exit"
    section = "early_exit"

    def __init__(self, host):
        super().__init__(host)
        check_options(self.opts, host.cfg)
        self.gates: dict[int, ExitGate] = {}
        for i in range(host.num_layers):
            if host.is_block(i) and self._can_exit(i):
                host.add_params(i, ["exit_head.weight", "exit_head.bias"])
        states = host.optimizer_states()
        for i, block in host.blocks().items():
            if self._can_exit(i):
                block.exit_head = self._new_head(i)
            self.gates[i] = install_gate(block, self.opts, self._can_exit(i))
        host.rebuild_optimizer(states)  # the optimizer was built before the exit classifiers existed

    def _can_exit(self, i: int) -> bool:
        """Whether unit i decides exits: a whole block, or a block's MLP half, from first_block on."""
        return self.host.block_number(i) >= self.opts.first_block and self.host.part(i) != "attn"

    def _new_head(self, i: int) -> nn.Module:
        """The exit classifier of unit i: the same initial weights wherever the block lives,
        whether it is placed whole or as two halves (seeded by the block's number)."""
        d, seed = self.host.cfg.model.d_model, self.host.cfg.train.seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + 7919 * (self.host.block_number(i) + 2))
            head = nn.Linear(d, 1, device=self.host.device)
            nn.init.normal_(head.weight, 0.0, 0.02)
            nn.init.zeros_(head.bias)
        return head

    def before_step(self, step: int) -> list[dict]:
        for gate in self.gates.values():
            gate.exiting = step >= self.opts.start_step
            gate.reset_stats()
        if step == self.opts.start_step:
            return [{"type": "dynamism", "step": step, "first_block": self.opts.first_block,
                     "threshold": self.opts.threshold}]
        return []

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        out: dict[str, dict[int, Any]] = {}
        gates = {i: self.gates[i] for i in self.host.blocks()}
        sums = as_numbers([gate.stats.sums for gate in gates.values()])  # one read for all of them
        for (i, gate), s in zip(gates.items(), sums):
            for k, v in gate.summary(s).items():
                out.setdefault(f"exit_{k}", {})[i] = v
        return out

    # ---- migration: the classifier travels in the block's weights, the gate is rebuilt ----
    def pack_layer(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        gate = self.gates.pop(index, None)
        if gate is not None:
            gate.remove()
        return {}

    def prepare_layer(self, index: int, layer: nn.Module) -> None:
        if not self.host.is_block(index):
            return
        if self._can_exit(index):
            with torch.device("meta"):  # storage only: the arriving weights fill it
                head = nn.Linear(self.host.cfg.model.d_model, 1)
            layer.exit_head = head.to_empty(device=self.host.device)
        self.gates[index] = install_gate(layer, self.opts, self._can_exit(index))
