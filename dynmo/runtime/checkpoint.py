"""Checkpoints with torch.distributed.checkpoint, keyed by layer names, not ranks.

Keys: `{layer}.{param}` for weights and `optim.{layer}.{param}.{step|exp_avg|exp_avg_sq}` for
AdamW state, e.g. `block3.attn.qkv.weight`. Each rank saves and loads only its own layers, so
a run can resume under any layout, number of stages or schedule. `dynmo.json` beside the
shards records the step, the model shape and the layout it was saved with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dynmo.config import Config, to_toml
from dynmo.runtime import optim
from dynmo.runtime.pipeline import Pipeline


def _state_dict(pipe: Pipeline, with_optim: bool) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for i, layer in pipe.layers.items():
        name = pipe.specs[i].name
        for k, v in layer.state_dict().items():
            sd[f"{name}.{k}"] = v
        if with_optim:
            for pname, p in layer.named_parameters():
                st = pipe.optimizer.state.get(p)
                if st:
                    for key in optim.STATE_KEYS:
                        sd[f"optim.{name}.{pname}.{key}"] = st[key]
    return sd


def save(pipe: Pipeline, path: Path, step: int, cfg: Config, cases: dict | None = None) -> None:
    """Collective over the active ranks. `step` = number of steps already trained."""
    path.mkdir(parents=True, exist_ok=True)
    has_optim = any(pipe.optimizer.state.get(p) for layer in pipe.layers.values() for p in layer.parameters())
    flag = torch.tensor([1.0 if has_optim else 0.0])
    group = pipe.ctx.active_group  # after a re-pack, the released ranks are gone
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    # Data-parallel replicas hold identical copies; DCP writes each key once.
    dcp.save(_state_dict(pipe, with_optim=True), checkpoint_id=str(path), process_group=group)
    if dist.get_rank() == 0:
        meta = {
            "step": step,
            "model": cfg.to_dict()["model"],
            "layout": list(pipe.layout.boundaries),
            "layer_names": [s.name for s in pipe.specs],
            "has_optimizer_state": bool(flag.item()),
            "seed": cfg.train.seed,
            "cases": cases or {},  # the dynamic-model cases' own state (dynmo.dynamics.case)
        }
        (path / "dynmo.json").write_text(json.dumps(meta, indent=2) + "\n")
        (path / "config.toml").write_text(to_toml(cfg))
    dist.barrier(group=group)


def read_meta(path: Path) -> dict:
    return json.loads((path / "dynmo.json").read_text())


def load(pipe: Pipeline, path: Path) -> int:
    """Load this rank's layers (and their AdamW state) from `path`; returns the step to resume at."""
    meta = read_meta(path)
    if meta["layer_names"] != [s.name for s in pipe.specs]:
        raise ValueError(f"checkpoint {path} has layers {meta['layer_names']}, the model has {[s.name for s in pipe.specs]}")
    if meta["has_optimizer_state"]:
        # AdamW state appears at the first step; allocate it so DCP can load in place.
        for layer in pipe.layers.values():
            for p in layer.parameters():
                if not p.requires_grad:
                    continue  # frozen: no optimizer state was saved for it
                pipe.optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
    sd = _state_dict(pipe, with_optim=meta["has_optimizer_state"])
    # state_dict() tensors share storage with the parameters: DCP loads into them in place.
    dcp.load(sd, checkpoint_id=str(path))
    return int(meta["step"])
