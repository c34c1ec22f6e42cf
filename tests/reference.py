"""Single-process reference training: the same layers, data and update as the pipeline,
run as one model that accumulates the same microbatches. What the pipeline must equal.

With `model.tie_embeddings` the reference is a genuinely tied model: the head's output layer
holds the embedding's nn.Parameter itself, autograd sums both uses into one gradient, AdamW
and the gradient norm see each parameter once. It does not use dynmo.runtime.tie, which keeps
two copies on two ranks: that is what it checks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from dynmo.config import Config, load_config
from dynmo.data import TokenData, prepare
from dynmo.model.gpt import loss_fn
from dynmo.model.layers import build_layer, layer_specs
from dynmo.runtime import optim

# With tied embeddings: (embedding module, head module) whose `.weight` is one tensor, per family.
TIED_MODULES = {"gpt": ("tok", "lm_head"), "llama": ("embed_tokens", "lm_head"), "mixtral": ("embed_tokens", "lm_head")}


def reference_run(cfg: Config, steps: int, dp: int = 1):
    """Train `steps` steps (the LR schedule spans cfg.train.steps). Returns (per-step mean loss, final weights keyed like the checkpoints).

    `cfg.model.tie_embeddings` ties the head's output weight to the embedding (one Parameter);
    the tied tensor is then in the weights once, under the embedding's key.

    Runs on one thread, like each rank (OMP_NUM_THREADS=1): CPU kernels may sum in another
    order with more threads, which changes the last bits.
    """
    with _one_thread():
        return _run(cfg, steps, dp)


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _data(cfg: Config) -> TokenData:
    folder = prepare(cfg.data.paths, cfg.model.vocab_size, cfg.data.cache_dir, cfg.model.hf_path)
    return TokenData.load(folder, cfg.model.seq_len, cfg.data.val_fraction, cfg.train.seed)


def _forward(layers: dict, x: torch.Tensor) -> torch.Tensor:
    """The model's output: every layer in order on the previous one's outputs."""
    out = (x,)
    for layer in layers.values():
        out = layer(*out)
        out = out if isinstance(out, tuple) else (out,)
    return out[0]


def _run(cfg: Config, steps: int, dp: int):
    data = _data(cfg)
    specs = layer_specs(cfg.model)
    layers = {s.name: build_layer(s, cfg.model, cfg.train.seed) for s in specs}
    if cfg.model.tie_embeddings:
        emb, head = TIED_MODULES[cfg.model.family]
        getattr(layers["head"], head).weight = getattr(layers["embed"], emb).weight
    # every Parameter once, under the first layer (in model order) that uses it
    owned: dict[str, list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for name, layer in layers.items():
        owned[name] = [p for p in layer.parameters() if id(p) not in seen]
        seen |= {id(p) for p in owned[name]}
    params = [p for ps in owned.values() for p in ps]
    tc = cfg.train
    opt = optim.adamw(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        tc, torch.device("cpu"),
    )
    n_mb, G = cfg.train.microbatches, cfg.train.global_batch
    losses = []
    for step in range(steps):
        batch = torch.from_numpy(data.batch(step, G))
        per = G // dp
        replica_grads, step_losses = [], []
        for r in range(dp):
            mine = batch[r * per : (r + 1) * per]
            x_all, y_all = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
            for x, y in zip(x_all.tensor_split(n_mb), y_all.tensor_split(n_mb)):
                loss = loss_fn(_forward(layers, x), y)
                loss.backward()
                step_losses.append(loss.item())
            # a parameter no loss reaches (e.g. an unused MoD predictor) keeps no gradient, as in AdamW
            grads = [None if p.grad is None else p.grad.div_(n_mb).clone() for p in params]
            replica_grads.append(grads)
            opt.zero_grad(set_to_none=True)
        for k, p in enumerate(params):
            g = replica_grads[0][k]
            if g is None:
                continue
            for r in range(1, dp):
                g = g + replica_grads[r][k]
            p.grad = g.div_(dp) if dp > 1 else g
        sq = torch.stack([_sq_norm(ps) for ps in owned.values()])  # per layer, in layer order
        _, scale = optim.clip_coefficient(sq, cfg.train.grad_clip)
        if scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        for g in opt.param_groups:
            g["lr"] = optim.lr_at(step, cfg.train)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / len(step_losses))
    weights, kept = {}, set()
    for name, layer in layers.items():
        for k, v in layer.state_dict(keep_vars=True).items():
            if id(v) not in kept:  # a tied tensor once, as the embedding's
                weights[f"{name}.{k}"] = v.detach().clone()
                kept.add(id(v))
    return losses, weights


@torch.no_grad()
def reference_val_loss(cfg: Config, weights: dict[str, torch.Tensor]) -> float:
    """The validation loss a run reports (`Trainer.validate`, one replica) of the model with
    `weights` (keyed as `reference_run` returns them): per validation batch the mean of its
    microbatches' losses, then the mean over `train.eval_batches` batches."""
    data = _data(cfg)
    layers = {s.name: build_layer(s, cfg.model, cfg.train.seed) for s in layer_specs(cfg.model)}
    for name, layer in layers.items():
        layer.load_state_dict({k[len(name) + 1:]: v for k, v in weights.items() if k.startswith(name + ".")})
    n_mb, means = cfg.train.microbatches, []
    with _one_thread():
        for b in range(cfg.train.eval_batches):
            batch = torch.from_numpy(data.batch(b, cfg.train.global_batch, "val"))
            x_all, y_all = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            mb = [loss_fn(_forward(layers, x), y).item() for x, y in zip(x_all.tensor_split(n_mb), y_all.tensor_split(n_mb))]
            means.append(sum(mb) / len(mb))
    return sum(means) / len(means)


def _sq_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Squared L2 norm of the gradients, in parameter order."""
    norms = [optim.grad_sq_norm(p.grad) for p in params if p.grad is not None]
    return torch.stack(norms).sum() if norms else torch.zeros((), dtype=torch.float32)


def tiny_config(*overrides: str) -> Config:
    from tests.conftest import TINY

    return load_config(None, [*TINY, *overrides])
