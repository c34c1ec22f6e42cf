"""A toy task for training one block on its own: a fixed random batch, a linear head."""

import torch
import torch.nn.functional as F


def train_block(block: torch.nn.Module, steps: int, stat: str, B: int, T: int, D: int,
                classes: int = 5, lr: float = 2e-2) -> tuple[list[float], list]:
    """Train `block` + a head for `steps` AdamW steps on one random batch; every parameter must
    get a finite gradient each step. Returns the losses and `block.last_stats[stat]` per step."""
    head = torch.nn.Linear(D, classes)
    x, y = torch.randn(B, T, D), torch.randint(0, classes, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    params = list(block.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr)
    losses, stats = [], []
    for _ in range(steps):
        block.reset_stats()
        out, _ = block(x, mask)
        loss = F.cross_entropy(head(out).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
        opt.step()
        losses.append(loss.item())
        stats.append(block.last_stats[stat])
    return losses, stats
