"""What `dynmo.runtime.pipeline.Pipeline` builds: a rank's layers at start-up, and its stages and
schedule, again after every re-layout."""

from __future__ import annotations

import torch
import torch.nn as nn

from dynmo.config import Config
from dynmo.layout import Layout
from dynmo.model.gpt import loss_fn
from dynmo.model.hf import HFReader, load_layer
from dynmo.model.layers import LayerSpec, build_layer, empty_layer
from dynmo.runtime import experts, fsdp
from dynmo.runtime.compiled import compile_unit
from dynmo.runtime.dist import DistContext
from dynmo.runtime.schedules import schedule_class
from dynmo.runtime.stage import StageModule, TimedPipelineStage, boundary_bools, example_io
from dynmo.schedules import Schedule, get_schedule


def build_layers(cfg: Config, device: torch.device, specs: list[LayerSpec], indices: list[int],
                 ep: experts.ExpertGroup | None, mesh) -> tuple[dict[int, nn.Module], tuple[int, int] | None]:
    """This rank's layers at start-up: seeded from (seed, index), or read from a Hugging Face
    checkpoint (`model.hf_path`: only these layers' tensors are read; then also the tensors and
    bytes read). With `parallel.shard = "full"` each is sharded as soon as it is built, so a
    rank holds one whole layer at a time."""
    m = cfg.model

    def placed(layer: nn.Module, i: int) -> nn.Module:
        # built whole (the same weights), then this rank's experts under the layer's placement
        layer = experts.localize(layer, ep, specs[i].prefix)
        return layer if mesh is None else fsdp.shard(layer, mesh)

    if not m.hf_path:
        return {i: placed(build_layer(specs[i], m, cfg.train.seed, device), i) for i in indices}, None
    layers = {}
    with HFReader(m.hf_path) as reader:
        for i in indices:
            layer = empty_layer(specs[i], m, device)
            load_layer(layer, specs[i], m, reader)
            layers[i] = placed(layer, i)
    return layers, (len(reader.names_read), reader.bytes_read)


def build_stages(cfg: Config, ctx: DistContext, specs: list[LayerSpec], layers: dict[int, nn.Module],
                 layout: Layout, mine: list[int], microbatch: int, *, dtype: torch.dtype,
                 recompute: frozenset[int], half_carry: tuple[str, ...]) -> list[TimedPipelineStage]:
    """The stages `mine` of `layout`, over the layers this rank holds."""
    m = cfg.model

    def carry(unit: int) -> tuple[str, ...]:
        # beside (x, mask), a boundary inside a split block also ships the block's carry
        return half_carry if 0 <= unit < len(specs) and specs[unit].part == "attn" else ()

    split_backward = get_schedule(cfg.parallel.schedule).split_backward  # zero bubble: two backward passes
    stages = []
    for s in mine:
        idx = list(layout.layers(s))
        if cfg.train.compile:  # each unit on its own; a unit compiled before (it stayed) is left as it is
            for i in idx:
                compile_unit(layers[i], dtype, cfg.train.compile_backend, split_backward, cfg.train.cuda_graphs)
        first, last = s == 0, s == layout.num_stages - 1
        carry_in, carry_out = carry(idx[0] - 1), carry(idx[-1])
        module = StageModule([specs[i].name for i in idx], [layers[i] for i in idx], idx,
                             profile=cfg.balance.profile, device=ctx.device, dtype=dtype,
                             recompute=recompute, received=None if first else boundary_bools(carry_in),
                             sends=not last)
        inputs, outputs = example_io(first, last, microbatch, m.seq_len, m.d_model, m.vocab_size,
                                     ctx.device, dtype, carry_in=carry_in, carry_out=carry_out)
        stages.append(TimedPipelineStage(module, s, layout.num_stages, ctx.device, input_args=inputs,
                                         output_args=outputs, group=ctx.pp_group))
    return stages


def build_schedule(info: Schedule, stages: list[TimedPipelineStage], microbatches: int):
    stage_arg = stages if info.multi_stage else stages[0]
    # scale_grads=False: the division by the number of microbatches is ours (grads.scale_grads)
    return schedule_class(info)(stage_arg, microbatches, loss_fn=loss_fn, scale_grads=False)
