"""AdamW over a rank's layers, its per-parameter state, grad norms independent of the layout."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from dynmo.config import TrainConfig
from dynmo.runtime.fsdp import local

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def param_groups(layers: dict[str, nn.Module], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on biases, norms); ordered by layer name then param."""
    decay, no_decay = [], []
    for lname in layers:
        for _, p in layers[lname].named_parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(layers: dict[str, nn.Module], tc: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    return adamw(param_groups(layers, tc.weight_decay), tc, device)


def adamw(groups: list[dict], tc: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        groups,
        lr=tc.lr,
        betas=(tc.beta1, tc.beta2),
        # On CPU the fused kernel: one pass over each parameter, 9x the per-tensor loop, and
        # elementwise, so the update is bitwise the same however parameters are grouped or
        # split into rows (ZeRO) and for any thread count.
        **({"foreach": None} if device.type == "cuda" else {"fused": True}),
    )


def layer_state(opt: torch.optim.Optimizer, layer: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """{param name: {step, exp_avg, exp_avg_sq}} for one layer (empty before the first step)."""
    return {n: dict(opt.state[p]) for n, p in layer.named_parameters() if p in opt.state and opt.state[p]}


def load_layer_state(opt: torch.optim.Optimizer, layer: nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    params = dict(layer.named_parameters())
    for n, st in state.items():
        opt.state[params[n]] = dict(st)


def layer_state_bytes(opt: torch.optim.Optimizer, layer: nn.Module) -> int:
    """Bytes a layer holds: weights, gradients and optimizer state."""
    total = 0
    for p in layer.parameters():
        total += _bytes(p)
        if p.grad is not None:
            total += _bytes(p.grad)
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                total += _bytes(v)
    return total


def _bytes(t: torch.Tensor) -> int:
    """Bytes this worker holds of `t`: of a sharded tensor (DTensor), its own shard."""
    t = local(t)
    return t.numel() * t.element_size()


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr at the last step."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = max(1, tc.steps - tc.warmup_steps)
    frac = min(1.0, (step - tc.warmup_steps) / span)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * frac))


def layer_sq_norm(layer: nn.Module, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """Squared L2 norm of a layer's gradients, computed in a fixed order.

    `skip` names parameters left out: a copy of a tensor another layer already counts (the
    head's copy of a tied embedding), so the norm sees each logical tensor once.
    """
    norms = list(param_sq_norms(layer, skip).values())
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(norms).sum()


def param_sq_norms(layer: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """{parameter name: squared L2 norm of its gradient}, in parameter order, for the parameters
    that have a gradient and are not in `skip` (of a sharded gradient, its local shard's)."""
    return {n: grad_sq_norm(local(p.grad)) for n, p in layer.named_parameters()
            if p.grad is not None and n not in skip}


def grad_sq_norm(g: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of one gradient, in float32, in one pass with no temporary of the
    gradient's size (`g.float().pow(2).sum()` allocates one: 12x slower on a large gradient)."""
    return torch.linalg.vector_norm(g.detach(), dtype=torch.float32).square()



def clip_coefficient(layer_sq_norms: torch.Tensor, max_norm: float) -> tuple[float, float]:
    """(total grad norm, scale factor) from per-layer squared norms indexed by layer.

    Summing a fixed-length per-layer vector in layer order makes the norm, and so the
    training, independent of which stage holds which layer.
    """
    total = float(layer_sq_norms.double().sum().sqrt())
    if max_norm <= 0 or total <= max_norm:
        return total, 1.0
    return total, max_norm / (total + 1e-6)
