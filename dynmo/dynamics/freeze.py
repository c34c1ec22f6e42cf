"""Egeria-style layer freezing (Wang et al. 2022; the paper's F.4), a `Case`.

Training progress of a block is its *plasticity* against a reference copy of itself, refreshed
every `freeze.every` steps (Egeria keeps the reference model on the CPU and refreshes it
periodically): on an input the block really saw this step (the first microbatch's),

    plasticity = ||f_now(x) - f_ref(x)|| / ||f_now(x) - x||

the change of the block's residual update over the last `every` steps, relative to the update
itself. A block whose plasticity is below `freeze.tolerance` has converged.

Blocks freeze front to back, as in Egeria: at each check (steps start_step, start_step +
every, ...), the first not-yet-frozen block freezes if it has converged, then the next, and so
on, at most `freeze.max_per_check` blocks per check (Egeria: one) and `freeze.max_frozen` in
all (-1: all but the last). Front-first matters: the blocks
before a trainable block must still back-propagate to it, so a frozen block in the middle saves
less. Here the embedding stays trainable, so frozen blocks still run their input-gradient
backward; what they skip is the weight-gradient computation (about half of a block's backward),
the data-parallel gradient all-reduce, the gradient-norm and the optimizer update.

Freezing a block: `requires_grad_(False)` on its parameters (autograd then computes no weight
gradient; `dynmo.runtime.grads.sync_data_parallel` and the grad norm only see params with a grad),
its gradients dropped, the optimizer rebuilt without them (their AdamW state is released).

Decisions are global and identical on every rank: each rank measures the plasticity of the
blocks it holds, one all-reduce over the active ranks (data-parallel replicas averaged) gives
every rank the same vector, and every rank applies the same front-to-back rule. The set of
frozen blocks is therefore known everywhere, and a migrated block is re-frozen on arrival
(`unpack_layer`); its reference copy travels with it.

Half-block units (`parallel.unit = "sublayer"`): the units that freeze are the halves, front
to back (a block's attention half before its MLP half), each on its own plasticity;
`max_frozen` and `max_per_check` count halves, and -1 keeps the last half trainable. A half
block's MLP half is probed with what its attention half handed it (a Mixture-of-Depths
block's routing). The event still names block numbers (a block twice when both halves freeze).

Works with every schedule: the zero-bubble ones (interleavedzb, zbv) skip parameters that need
no gradient when they run the weight-gradient pass.

Per-layer metrics: freeze_frozen (0/1), freeze_progress (last plasticity measured),
freeze_wgrad_elems (weight-gradient elements accumulated in the step, counted by
post-accumulate-grad hooks; 0 for a frozen block. Zero-bubble schedules assign weight
gradients without accumulation hooks, so there it reads 0 for every block).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call

from dynmo.config import ConfigError, FreezeConfig
from dynmo.dynamics.case import Case
from dynmo.model import stats


def check_options(f: FreezeConfig, n_blocks: int) -> None:
    if f.every < 1 or f.start_step < 0:
        raise ConfigError(f"freeze.every={f.every} must be >= 1 and freeze.start_step={f.start_step} >= 0")
    if not f.tolerance > 0:
        raise ConfigError(f"freeze.tolerance={f.tolerance} must be > 0 (plasticity below it counts as converged)")
    if f.max_frozen < -1 or f.max_frozen > n_blocks:
        raise ConfigError(f"freeze.max_frozen={f.max_frozen}: use -1 (all but the last block) or 0..{n_blocks}")
    if f.max_per_check < 0:
        raise ConfigError(f"freeze.max_per_check={f.max_per_check}: use 0 (no limit) or a number of blocks >= 1")


@torch.no_grad()
def plasticity(block: nn.Module, ref: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor,
               *carry: torch.Tensor) -> float:
    """||f_now(x) - f_ref(x)|| / ||f_now(x) - x||: how much the block's function moved since `ref`.
    Computed in float32 whatever the training's dtype (the captured input may be bf16): a
    measurement, outside autocast, on the fp32 parameters. `carry`: what a half block's MLP
    half is handed beside (x, mask) (`dynmo.model.gpt.Halves`)."""
    x = x.float()
    carry = tuple(c.float() if c.is_floating_point() else c for c in carry)
    with stats.paused():  # probe forwards are not training work: leave the layers' statistics alone
        now = block(x, mask, *carry)[0]
        old = functional_call(block, ref, (x, mask, *carry), strict=True)[0]
    return float((now - old).norm() / (now - x).norm().clamp_min(1e-12))


def freeze_layer(layer: nn.Module) -> None:
    for p in layer.parameters():
        p.requires_grad_(False)
        p.grad = None


class Freeze(Case):
    name = "freeze"
    section = "freeze"

    def __init__(self, host):
        super().__init__(host)
        n = host.num_layers
        n_blocks = sum(host.is_block(i) for i in range(n))  # blocks, or half blocks: the units that freeze
        check_options(self.opts, n_blocks)
        self.max_frozen = n_blocks - 1 if self.opts.max_frozen < 0 else self.opts.max_frozen
        self.frozen = [False] * n  # by global layer index; identical on every rank
        self.progress: list[float | None] = [None] * n
        self.refs: dict[int, dict[str, torch.Tensor]] = {}  # reference copies of the blocks held here
        self.probes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.wgrad: dict[int, int] = {}
        self._capture: list = []
        for i, layer in self._blocks().items():
            self._count_wgrads(i, layer)

    def _blocks(self) -> dict[int, nn.Module]:
        return self.host.blocks()

    def _refresh_step(self, step: int) -> bool:
        return step >= 0 and (step - self.opts.start_step) % self.opts.every == 0

    def _count_wgrads(self, i: int, layer: nn.Module) -> None:
        # A tensor keeps its hooks where Python's garbage collector cannot see them: a hook that
        # held this case would keep it, its host, the model and the optimizer alive after the run.
        case = weakref.ref(self)

        def hook(p, i=i):
            me = case()
            if me is not None:
                me.wgrad[i] = me.wgrad.get(i, 0) + p.numel()

        for p in layer.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)

    # ---- hooks ----
    def before_step(self, step: int) -> list[dict]:
        self.wgrad = {i: 0 for i in self._blocks()}
        if self._refresh_step(step) and step >= self.opts.start_step:
            # capture each trainable block's input of the step's first microbatch
            for i, layer in self._blocks().items():
                if not self.frozen[i] and i in self.refs:
                    self._capture.append(layer.register_forward_pre_hook(self._probe_hook(i)))
        return []

    def _probe_hook(self, i: int):
        def hook(module, args):
            if i not in self.probes and torch.is_grad_enabled():
                self.probes[i] = tuple(a.detach().clone() for a in args)

        return hook

    def after_step(self, step: int, result: Any) -> list[dict]:
        for h in self._capture:
            h.remove()
        self._capture = []
        if not self._refresh_step(step):
            return []
        events: list[dict] = []
        if step >= self.opts.start_step:
            events = self._check(step)
        self.probes = {}
        self.refs = {
            i: {k: v.detach().clone() for k, v in layer.state_dict().items()}
            for i, layer in self._blocks().items()
            if not self.frozen[i]
        }
        return events

    def _check(self, step: int) -> list[dict]:
        n = len(self.frozen)
        vec = torch.zeros(2, n, dtype=torch.float64)  # [plasticity sum, measurements]
        for i, layer in self._blocks().items():
            if i in self.probes and i in self.refs:
                vec[0, i] = plasticity(layer, self.refs[i], *self.probes[i])
                vec[1, i] = 1.0
        # every replica of a block measured it; summed on the rank's device (NCCL takes no CPU tensor)
        on_dev = vec.to(self.host.device)
        dist.all_reduce(on_dev, group=self.host.active_group)
        vec = on_dev.cpu()
        newly = []
        for i in range(n):
            if vec[1, i] > 0:
                self.progress[i] = float(vec[0, i] / vec[1, i])
        for i in range(n):
            if not self.host.is_block(i) or self.frozen[i]:
                continue
            p = self.progress[i]
            if sum(self.frozen) >= self.max_frozen or p is None or not p < self.opts.tolerance:
                break  # front to back: stop at the first block still learning
            if self.opts.max_per_check and len(newly) >= self.opts.max_per_check:
                break
            self.frozen[i] = True
            newly.append(i)
        if not newly:
            return []
        host = self.host
        layers = host.layers()
        states = host.optimizer_states()
        for i in newly:
            if i in layers:
                freeze_layer(layers[i])
                states.pop(i, None)
                self.refs.pop(i, None)
        host.rebuild_optimizer(states)
        return [{
            "type": "dynamism",
            "step": step,
            "frozen_blocks": [host.block_number(i) for i in newly],
            "plasticity": [self.progress[i] for i in newly],
        }]

    def state(self) -> dict:
        return {"frozen": [i for i, f in enumerate(self.frozen) if f]}

    def load_state(self, state: dict) -> None:
        """Resume: re-freeze the blocks frozen when the checkpoint was saved (before the load,
        so their missing optimizer state is not expected). Reference copies restart."""
        layers = self.host.layers()
        states = self.host.optimizer_states()
        for i in state.get("frozen", []):
            self.frozen[i] = True
            if i in layers:
                freeze_layer(layers[i])
                states.pop(i, None)
        self.host.rebuild_optimizer(states)

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        out: dict[str, dict[int, Any]] = {"freeze_frozen": {}, "freeze_wgrad_elems": {}}
        for i in self._blocks():
            out["freeze_frozen"][i] = float(self.frozen[i])
            out["freeze_wgrad_elems"][i] = self.wgrad.get(i, 0)
            p = self.progress[i]
            if p is not None and math.isfinite(p):
                out.setdefault("freeze_progress", {})[i] = p
        return out

    # ---- migration ----
    def pack_layer(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        ref = self.refs.pop(index, None)
        return {} if ref is None else {f"ref.{k}": v for k, v in ref.items()}

    def unpack_layer(self, index: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        ref = {k[4:]: v for k, v in tensors.items() if k.startswith("ref.")}
        if ref:
            self.refs[index] = ref
        if self.frozen[index]:
            freeze_layer(layer)  # before the optimizer is rebuilt: it will not hold these params
        else:
            self._count_wgrads(index, layer)
