"""Checkpoints with torch.distributed.checkpoint, keyed by layer names, not ranks.

Keys: `{layer}.{param}` for weights and `optim.{layer}.{param}.{step|exp_avg|exp_avg_sq}` for
AdamW state, e.g. `block3.attn.qkv.weight`. Each rank saves and loads only its own layers, so
a run can resume under any layout, number of stages or schedule. `dynmo.json` beside the
shards records the step, the model shape and the layout it was saved with.

Tied embeddings (`model.tie_embeddings`) are one tensor with a copy on each of two ranks
(`dynmo.runtime.tie`): both copies, and their AdamW state, are stored once under the
embedding's keys (`embed.tok.weight`, `optim.embed.tok.weight.exp_avg`, ...), never as
`head.lm_head.weight`. Both owners may write the key, as data-parallel replicas do (DCP writes
it once; the copies are bitwise equal), and both load it, so a resume under another layout or
rank count fills both copies.
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


def _key(pipe: Pipeline, index: int, pname: str) -> str:
    """`{layer}.{param}`; the head's copy of a tied embedding is keyed as the embedding's tensor."""
    if pipe.tie is not None:
        index, pname = pipe.tie.stored_as(index, pname)
    return f"{pipe.specs[index].name}.{pname}"


def _state_dict(pipe: Pipeline, with_optim: bool) -> dict[str, torch.Tensor]:
    """This rank's tensors by checkpoint key. Layers in index order, so when one rank holds both
    copies of a tied embedding the key gets the embedding's (`_fill_tied_copy` fills the other)."""
    sd: dict[str, torch.Tensor] = {}
    for i in sorted(pipe.layers):
        layer = pipe.layers[i]
        for k, v in layer.state_dict().items():
            sd.setdefault(_key(pipe, i, k), v)
        if with_optim:
            for pname, p in layer.named_parameters():
                st = pipe.optimizer.state.get(p)
                if st:
                    for key in optim.STATE_KEYS:
                        sd.setdefault(f"optim.{_key(pipe, i, pname)}.{key}", st[key])
    return sd


def _fill_tied_copy(pipe: Pipeline) -> None:
    """After a load on a rank that holds both copies of a tied embedding: the head's copy (and
    its AdamW state) becomes the embedding's, which is what the checkpoint filled."""
    tie = pipe.tie
    if tie is None or not (tie.holds_embed and tie.holds_head):
        return
    pe = pipe.layers[tie.embed[0]].get_parameter(tie.embed[1])
    ph = pipe.layers[tie.head[0]].get_parameter(tie.head[1])
    with torch.no_grad():
        ph.copy_(pe)
    if pipe.optimizer.state.get(pe):
        pipe.optimizer.state[ph] = {k: v.clone() for k, v in pipe.optimizer.state[pe].items()}


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
    tied = bool(meta["model"].get("tie_embeddings", False))
    if tied != pipe.cfg.model.tie_embeddings:
        raise ValueError(f"checkpoint {path} was saved with model.tie_embeddings = {str(tied).lower()}; "
                         f"resume with model.tie_embeddings = {str(tied).lower()}")
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
    _fill_tied_copy(pipe)
    return int(meta["step"])
