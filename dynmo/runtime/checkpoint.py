"""Checkpoints with torch.distributed.checkpoint, keyed by layer names, not ranks.

Keys: `{layer}.{param}` for weights and `optim.{layer}.{param}.{step|exp_avg|exp_avg_sq}` for
AdamW state, e.g. `block3.attn.qkv.weight`. Each rank saves and loads only its own layers, so
a run can resume under any layout, number of stages or schedule. With `parallel.shard =
"optimizer"` each data-parallel replica holds its rows of the AdamW moments and stores them as
one DTensor sharded over its data-parallel group (`dynmo.runtime.zero.stored`): the key is the
same whole tensor, which DCP reshards on load, so a sharded run resumes unsharded, on another
number of replicas, and the other way round. Under expert parallelism (`parallel.ep` > 1)
each rank holds its experts' rows of every stacked expert weight, under the layer's placement
(which rank holds which expert, `dynmo.runtime.experts`); a save gathers each such tensor (and
its AdamW state) whole over the expert-parallel group, experts in index order, and a load reads
the whole tensor and keeps this rank's rows: the keys and tensors are those of a run without
it, so a run resumes under another `parallel.ep` (or none) or placement and exports unchanged.
`dynmo.json` beside the shards records the step, the model shape, the layout it was saved
with, and the experts' placements (`expert_placement`, restored on resume).

Tied embeddings (`model.tie_embeddings`) are one tensor with a copy on each of two ranks
(`dynmo.runtime.tie`): both copies, and their AdamW state, are stored once under the
embedding's keys (`embed.tok.weight`, `optim.embed.tok.weight.exp_avg`, ...), never as
`head.lm_head.weight`. Both owners may write the key, as data-parallel replicas do (DCP writes
it once; the copies are bitwise equal), and both load it, so a resume under another layout or
rank count fills both copies.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from dynmo import rundir
from dynmo.config import Config, ConfigError, to_toml
from dynmo.runtime import experts, faults, optim, safeload, zero
from dynmo.runtime.pipeline import Pipeline


def layer_names(pipe: Pipeline) -> list[str]:
    """The model's layers (embed, block0, ..., head): what a checkpoint's keys are prefixed with,
    whatever the placement units (a block split in halves keeps its parameters' names)."""
    return list(dict.fromkeys(s.prefix for s in pipe.specs))


def _key(pipe: Pipeline, index: int, pname: str) -> str:
    """`{layer}.{param}`; the head's copy of a tied embedding is keyed as the embedding's tensor."""
    if pipe.tie is not None:
        index, pname = pipe.tie.stored_as(index, pname)
    return f"{pipe.specs[index].prefix}.{pname}"


def _state_dict(pipe: Pipeline, with_optim: bool, loading: bool = False) -> tuple[dict[str, torch.Tensor], list]:
    """This rank's tensors by checkpoint key, and what a load must scatter afterwards. Layers in
    index order, so when one rank holds both copies of a tied embedding the key gets the
    embedding's (`_fill_tied_copy` fills the other). An expert parameter's rows under expert
    parallelism (and their AdamW state) appear as the whole tensor, experts in index order:
    gathered over the expert-parallel group to save (collective, in one order on every rank of
    the group), an empty buffer to load into, whose rows `_scatter` copies back."""
    sd: dict[str, torch.Tensor] = {}
    after: list = []  # (layer, parameter name, whole buffer, this rank's tensor)

    def put(key: str, layer: nn.Module, pname: str, v: torch.Tensor) -> None:
        if not experts.is_held(layer, pname, v):
            sd.setdefault(key, v)
        elif loading:
            full = v.new_empty(experts.whole_shape(layer, pname, v))
            if key not in sd:
                sd[key] = full
                after.append((layer, pname, full, v))
        else:
            full = experts.whole(layer, pname, v)  # collective: gathered even if the key is taken
            sd.setdefault(key, full)

    for i in sorted(pipe.layers):
        layer = pipe.layers[i]
        for k, v in layer.state_dict().items():
            put(_key(pipe, i, k), layer, k, v)
        if with_optim:
            for pname, p in layer.named_parameters():
                st = pipe.optimizer.state.get(p)
                if st:
                    for key in optim.STATE_KEYS:
                        put(f"optim.{_key(pipe, i, pname)}.{key}", layer, pname,
                            zero.stored(pipe.optimizer, p, st[key]))
    return sd, after


def _scatter(after: list) -> None:
    for layer, pname, full, v in after:
        experts.scatter(layer, pname, full, v)


def placements(pipe: Pipeline) -> dict[str, list[int]]:
    """Every MoE layer's expert placement that is not the one it started from ({} without
    expert parallelism), the same on every rank."""
    if pipe.ep is None:
        return {}
    n = pipe.cfg.model.moe.num_experts
    return {k: list(v) for k, v in sorted(pipe.ep.orders.items()) if tuple(v) != pipe.ep.start(n)}


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


# what torch.distributed's errors say when a peer died or stopped answering
PEER_FAILURES = ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe", "Connection refused")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); the message says which
    complete checkpoint is left."""


def save(pipe: Pipeline, path: Path, step: int, cfg: Config, cases: dict | None = None, keep: int = 0,
         costs: list[float] | None = None, grow: dict | None = None) -> None:
    """Collective over the active ranks. `step` = number of steps already trained.

    Atomic: the shards and `dynmo.json` (last) go into a hidden temporary folder beside `path`,
    which rank 0 renames into place once every rank has written, so a kill at any moment leaves
    either the complete new checkpoint or none, and never a half-written `path`. A complete
    checkpoint already at `path` is replaced only after the new one is complete. `keep` > 0
    keeps that many newest complete checkpoints in the run folder and removes older ones.
    `costs`: the per-layer costs the run measured last (the controller's forecast), stored so a
    restart on another number of workers can lay the layers out before it measures anything.
    `grow`: the record of a grow this checkpoint is saved for (`dynmo.trainer`: its step, the
    layout to resume on, when it was decided); stored as `grow` with `saved_at` (epoch seconds)
    added, which tells the launcher to restart the job on the whole world from here.
    """
    group = pipe.ctx.active_group  # after a re-pack, the released ranks are gone
    tmp = path.parent / f".{path.name}.tmp"
    lead = dist.get_rank() == 0
    if lead:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a job killed while saving
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    has_optim = any(pipe.optimizer.state.get(p) for layer in pipe.layers.values() for p in layer.parameters())
    flag = torch.tensor([1.0 if has_optim else 0.0], device=pipe.ctx.device)  # NCCL takes no CPU tensor
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    sd: dict[str, torch.Tensor] = {}
    try:
        # Data-parallel replicas hold identical copies; DCP writes each key once and fsyncs its files.
        sd, _ = _state_dict(pipe, with_optim=True)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                 process_group=group)
        faults.point("checkpoint", step)
        if lead:
            meta = {
                "step": step,
                "model": cfg.to_dict()["model"],
                "layout": list(pipe.layout.boundaries),
                "layer_names": layer_names(pipe),
                "unit": pipe.cfg.parallel.unit,  # what "layout" and "layer_costs" count
                "has_optimizer_state": bool(flag.item()),
                "seed": cfg.train.seed,
                "cases": cases or {},  # the dynamic-model cases' own state (dynmo.dynamics.case)
                "layer_costs": costs,
                "expert_placement": placements(pipe),  # {layer: order}; absent layers: their start
                # the ranks and slots those orders are read with (an order with copies fits no others)
                "expert_ranks": {"ep": cfg.parallel.ep, "expert_slots": cfg.parallel.expert_slots},
            }
            if grow is not None:
                meta["grow"] = grow | {"saved_at": time.time()}
            _write_synced(tmp / "config.toml", to_toml(cfg))
            _write_synced(tmp / "dynmo.json", json.dumps(meta, indent=2) + "\n")  # the completion marker: last
            _put_in_place(tmp, path)
            if keep > 0:
                for old in rundir.complete_checkpoints(path.parent)[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        free = shutil.disk_usage(path.parent).free  # before the clean-up below gives space back
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what it took; it was never complete
        latest = rundir.latest_checkpoint(path.parent)
        left = f"the last complete checkpoint is {latest}" if latest else "no complete checkpoint exists yet"
        if _is_disk_full(e) or free < sum(t.numel() * t.element_size() for t in sd.values()):
            # torch's file writer reports a full disk as a short write, not always as ENOSPC
            err = CheckpointWriteError(f"no space left on device while writing {path} ({free / 1e6:.1f} MB free); "
                                       f"{left}")
        elif not isinstance(e, OSError) and any(s in str(e) for s in PEER_FAILURES):
            raise  # a peer stopped answering during the save: the caller names it
        else:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            err = CheckpointWriteError(f"cannot write {path}: {first}; {left}")
        if not lead:
            # the launcher shows the line of the rank that failed first: the lead's, which measured
            # the free space before its clean-up gave it back (a rank measuring after would not
            # see a full disk), so the others fail once that clean-up is done (10 s at most)
            _wait_gone(tmp, 10.0)
        raise err from e
    dist.barrier(group=group)


def _wait_gone(path: Path, limit_s: float) -> None:
    end = time.monotonic() + limit_s
    while path.exists() and time.monotonic() < end:
        time.sleep(0.05)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _put_in_place(tmp: Path, path: Path) -> None:
    """Rename the finished `tmp` to `path`; an older checkpoint of that name is moved aside
    first and removed only once the new one is in place."""
    aside = path.parent / f".{path.name}.old"
    if aside.exists():
        shutil.rmtree(aside)
    if path.exists():
        os.rename(path, aside)
    os.rename(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames themselves survive a power loss
    finally:
        os.close(fd)
    shutil.rmtree(aside, ignore_errors=True)


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in the exception, its causes, or DCP's per-rank failures."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if getattr(x, "errno", None) == errno.ENOSPC or "No space left on device" in str(x):
            return True
        failures = getattr(x, "failures", None) or {}  # DCP: rank -> (exception, traceback)
        todo += [x.__cause__, x.__context__, *(f[0] if isinstance(f, tuple) else f for f in failures.values())]
    return False


def read_meta(path: Path) -> dict:
    return json.loads((path / "dynmo.json").read_text())


def restore_placement(pipe: Pipeline, saved: dict[str, list[int]], saved_ranks: dict | None = None) -> None:
    """The saved expert placements become this run's (before the weights load, so each rank's
    rows are those of its experts under them). A placement without copies is valid under any
    `parallel.ep` that divides the experts' number and no `parallel.expert_slots`; one with
    copies only under the `parallel.ep` and `parallel.expert_slots` it was saved with
    (`saved_ranks`: cut under others, its slots would fall on other ranks); one that does not
    fit gives way to the start placement, which loses nothing (the checkpoint holds every expert
    whole). Without expert parallelism
    there is none to restore (every rank holds every expert)."""
    if pipe.ep is None or not saved:
        return
    n, size = pipe.cfg.model.moe.num_experts, pipe.ep.size
    same = isinstance(saved_ranks, dict) and saved_ranks == {"ep": size, "expert_slots": pipe.ep.slots}
    fits = {}
    for name, order in saved.items():
        try:
            order = experts.check_order(order, n, size)
        except ValueError:
            continue
        if len(order) == len(pipe.ep.start(n)) and (len(order) == n or same):
            fits[name] = order
    for i, layer in pipe.layers.items():
        name = pipe.specs[i].prefix
        if name in fits:
            for mod in experts.expert_modules(layer):
                if getattr(mod, "ep", None) is not None:
                    experts.set_order(mod, fits[name])
    pipe.ep.orders.update(fits)


def _refuse_unplaced(pipe: Pipeline, sd: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a checkpoint holding a tensor of this rank's layers that the model has no place
    for (a parameter an earlier model had): DCP would leave it behind without a word, and the
    run would go on without what was trained into it. Only layers whose every part is on this
    rank are checked (a block split into halves may have its other half, and its other
    parameters, on another rank)."""
    mine = {pipe.specs[i].prefix for i in pipe.layers}
    mine -= {s.prefix for j, s in enumerate(pipe.specs) if j not in pipe.layers}
    stored = safeload.read_metadata(path).state_dict_metadata
    extra = sorted(k for k in stored if k.split(".", 1)[0] in mine and k not in sd)
    if extra:
        shown = ", ".join(extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
        raise ConfigError(f"checkpoint {path} holds {shown}, which this model has no place for (saved by a "
                         "model with other parameters, e.g. an earlier dynmo's); resume it with the model it "
                         "was saved with")


def load(pipe: Pipeline, path: Path) -> int:
    """Load this rank's layers (and their AdamW state) from `path`; returns the step to resume at."""
    meta = read_meta(path)
    if meta["layer_names"] != layer_names(pipe):
        raise ValueError(f"checkpoint {path} has layers {meta['layer_names']}, the model has {layer_names(pipe)}")
    tied = bool(meta["model"].get("tie_embeddings", False))
    if tied != pipe.cfg.model.tie_embeddings:
        raise ValueError(f"checkpoint {path} was saved with model.tie_embeddings = {str(tied).lower()}; "
                         f"resume with model.tie_embeddings = {str(tied).lower()}")
    if meta.get("has_optimizer_state", True):
        # AdamW state appears at the first step; allocate it so DCP can load in place.
        for layer in pipe.layers.values():
            for p in layer.parameters():
                if not p.requires_grad:
                    continue  # frozen: no optimizer state was saved for it
                rows = zero.state_rows(pipe.optimizer, p)  # p, or this replica's rows of it
                pipe.optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(rows, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(rows, memory_format=torch.preserve_format),
                }
    restore_placement(pipe, meta.get("expert_placement") or {}, meta.get("expert_ranks"))
    sd, after = _state_dict(pipe, with_optim=meta.get("has_optimizer_state", True), loading=True)
    _refuse_unplaced(pipe, sd, path)
    # state_dict() tensors share storage with the parameters: DCP loads into them in place;
    # whole expert tensors load into buffers, whose rows `_scatter` copies to this rank's.
    safeload.load(sd, path)  # reads no pickle that could run code (docs/checkpoints.md)
    _scatter(after)
    _fill_tied_copy(pipe)
    return int(meta["step"])
