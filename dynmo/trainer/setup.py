"""The `Trainer`'s set-up (`dynmo.trainer`), before its first step: the data, what the checkpoint
it resumes from says, the start-up lines about the layout, the probes of the workers and links,
and the DynMo loop and the expert balancer built on what they measured."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from dynmo import plan
from dynmo.balance.experts import MOVE_BYTES_PER_PARAM
from dynmo.config import Config
from dynmo.controller.experts import ExpertBalancer
from dynmo.data import TokenData, prepare
from dynmo.flops import expert_share
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop, bytes_per_param
from dynmo.runtime import checkpoint, experts, probe
from dynmo.runtime import dist as rdist
from dynmo.runtime.pipeline import Pipeline


def load_data(cfg: Config, ctx: rdist.DistContext) -> TokenData:
    """The `data.prepared` folders; else rank 0 prepares `data.paths` (or finds them in the cache)
    and every rank then loads the same folder."""
    d = cfg.data
    if d.prepared:
        return TokenData.load(d.prepared, cfg.model.seq_len, d.val_fraction, cfg.train.seed, d.weights or None)
    folder = prepare(d.paths, cfg.model.vocab_size, d.cache_dir, cfg.model.hf_path) if ctx.rank == 0 else None
    obj = [str(folder) if folder else None]
    dist.broadcast_object_list(obj, src=0)
    return TokenData.load(Path(obj[0]), cfg.model.seq_len, d.val_fraction, cfg.train.seed)


def read_saved(cfg: Config) -> dict:
    """The meta of the checkpoint to resume from (empty without one)."""
    saved = checkpoint.read_meta(Path(cfg.checkpoint.resume)) if cfg.checkpoint.resume else {}
    if saved.get("unit", "block") != cfg.parallel.unit:  # its layout and costs count other units
        saved = {**saved, "layer_costs": None, "layout": None, "grow": None}
    return saved


def say_resumed(cfg: Config, layout: Layout, letters: list[str], num_stages: int, saved: dict,
                grow: dict | None, rebalanced: bool) -> None:
    """Rank 0: the layout a resumed run starts on, when it is not the one it was saved on."""
    if grow and grow["layout"]:
        _say_grown(grow, letters, num_stages, len(saved["layout"]) - 1)
    if rebalanced:
        print(f"dynmo: resuming on {num_stages} stages (saved on {len(saved['layout']) - 1}): layout "
              f"{layout.format(letters)} chosen by the {cfg.balance.balancer} balancer "
              "from the layer costs measured before the checkpoint", flush=True)


def _say_grown(g: dict, letters: list[str], num_stages: int, saved_stages: int) -> None:
    """Resuming from a grow's checkpoint: the layout it resumes on, and why."""
    grown = g["layout"]
    if len(grown) - 1 == num_stages:
        print(f"dynmo: resuming on {num_stages} stages (saved on {saved_stages}): layout "
              f"{Layout(tuple(grown)).format(letters)}, the one the grow at step {g['step']} decided", flush=True)
    elif len(grown) - 1 > num_stages:
        print(f"dynmo: the grow at step {g['step']} decided {len(grown) - 1} stages, but this job has "
              f"{num_stages}; not using its layout", flush=True)
    else:
        print(f"dynmo: the grow at step {g['step']} decided {len(grown) - 1} of this job's {num_stages} stages: "
              f"re-packing onto {Layout(tuple(grown)).format(letters)} before step {g['step']}", flush=True)


def say_hf_read(cfg: Config, ctx: rdist.DistContext, pipe: Pipeline) -> None:
    names = ", ".join(pipe.specs[i].name for i in sorted(pipe.layers))
    print(f"dynmo: rank {ctx.rank} read {pipe.hf_read[0]} tensors ({pipe.hf_read[1] / 1e6:.2f} MB) "
          f"of {cfg.model.hf_path} for its layers {names}", flush=True)


def measure_workers(cfg: Config, ctx: rdist.DistContext,
                    pipe: Pipeline) -> tuple[list[float] | None, list[float] | None, list[float] | None]:
    """Worker speeds and link times (forward, backward) for the balancer, when it runs.

    They need one stage per rank: with virtual stages several stages share a worker and a
    link, which the balancers' load model does not describe."""
    if cfg.balance.when == "never" or cfg.parallel.virtual_stages != 1:
        return None, None, None
    m = cfg.model
    speeds, transfer, transfer_back = probe.measure_workers(cfg.balance, ctx, pipe.microbatch, m.seq_len,
                                                            m.d_model, pipe.dtype.itemsize)
    if ctx.is_logger:
        links = ", ".join(f"{f * 1e3:.2f}/{b * 1e3:.2f}" for f, b in zip(transfer or [], transfer_back or []))
        print(f"dynmo: worker speeds {', '.join(f'{x:.2f}' for x in speeds)}; link ms/microbatch "
              f"forward/backward [{links}]", flush=True)
    return speeds, transfer, transfer_back


def build_loop(cfg: Config, pipe: Pipeline, params: list[int], boundary_bytes: list[int], speeds: list[float] | None,
               transfer: list[float] | None, transfer_back: list[float] | None) -> DynmoLoop:
    return DynmoLoop(cfg.balance, microbatches=pipe.microbatches, schedule=cfg.parallel.schedule,
                     stages_per_rank=cfg.parallel.virtual_stages, layer_params=params, speeds=speeds,
                     transfer=transfer, transfer_back=transfer_back, boundary_bytes=boundary_bytes,
                     layer_flops=plan.layer_flops(cfg),
                     layer_bytes=[int(bytes_per_param(cfg.parallel.shard, cfg.parallel.dp) * n) for n in params])


def expert_balancer(cfg: Config, ctx: rdist.DistContext, pipe: Pipeline) -> ExpertBalancer | None:
    """balance.experts = "auto": rank 0's balancer of the measured routing; else None."""
    if cfg.balance.experts != "auto" or pipe.ep is None:
        return None
    b = cfg.balance
    return ExpertBalancer(
        ranks=ctx.ep, groups=ctx.dp // ctx.ep, names=[s.prefix for s in pipe.specs],
        extra_slots=cfg.parallel.expert_slots,
        expert_bytes=MOVE_BYTES_PER_PARAM * experts.params_per_expert(pipe.specs, cfg.model),
        every=b.experts_every, window=b.window, min_gain=b.min_gain, confidence=b.confidence, horizon=b.horizon,
        expert_share={s.prefix: expert_share(cfg.model, cfg.parallel.unit == "sublayer") for s in pipe.specs})
