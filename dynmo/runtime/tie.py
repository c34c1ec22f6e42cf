"""Tied input and output embeddings across pipeline stages (`model.tie_embeddings = true`).

One logical tensor, two owners: the embedding is always on pipeline stage 0 and the head on the
last stage, which are usually different ranks. Each owner keeps its own copy, a separate
nn.Parameter even when one rank holds both layers, so the computation is the same whatever the
layout (and bitwise so on CPU). The copies start equal (`build_layer`, the Hugging Face loader
and the checkpoint give both the same tensor), and after each backward both get the gradient of
the shared tensor, g_E + g_L (`TiedEmbeddings.sum_grads`). Equal tensors with equal gradients,
equal AdamW state and the same weight-decay group stay equal after every update.

Across ranks the sum is an all_reduce over a group of just the two owners, one group per
data-parallel replica. The gradient norm counts the tensor once (`norm_skip`) and a checkpoint
stores it once, under the embedding's name (`stored_as`, read by `dynmo.runtime.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from dynmo.config import ModelConfig
from dynmo.model.layers import LayerSpec, family
from dynmo.runtime.dist import DistContext


@dataclass
class TiedEmbeddings:
    """Where the two copies live, seen from one rank, and the group that sums their gradients."""

    embed: tuple[int, str]  # (layer index, parameter name) of the embedding's copy
    head: tuple[int, str]  # the same for the head's copy
    holds_embed: bool  # this rank holds the embedding
    holds_head: bool  # this rank holds the head
    group: dist.ProcessGroup | None  # the two owners' group; None when one rank holds both

    def sum_grads(self, layers: dict[int, nn.Module]) -> None:
        """Give both copies the gradient g_E + g_L. Call on every rank after the backward of a
        step (and after the microbatch scaling), before the data-parallel reduction."""
        if not (self.holds_embed or self.holds_head):
            return
        if self.holds_embed and self.holds_head:
            pe, ph = self._param(layers, self.embed), self._param(layers, self.head)
            total = _grad(pe) + _grad(ph)  # the same addition the two-rank all_reduce does
            pe.grad, ph.grad = total, total.clone()
            return
        p = self._param(layers, self.embed if self.holds_embed else self.head)
        p.grad = _grad(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)

    def norm_skip(self, index: int) -> tuple[str, ...]:
        """Parameters of layer `index` the gradient norm leaves out: the head's copy, which the
        embedding already counts."""
        return (self.head[1],) if index == self.head[0] else ()

    def stored_as(self, index: int, pname: str) -> tuple[int, str]:
        """(layer index, parameter name) a checkpoint stores parameter `pname` of layer `index`
        under: the head's copy is stored as the embedding's tensor, everything else as itself."""
        return self.embed if (index, pname) == self.head else (index, pname)

    @staticmethod
    def _param(layers: dict[int, nn.Module], where: tuple[int, str]) -> nn.Parameter:
        index, pname = where
        return layers[index].get_parameter(pname)


def _grad(p: nn.Parameter) -> torch.Tensor:
    """p's gradient, zeros if the backward left it None (both owners must add something)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def tied_embeddings(m: ModelConfig, specs: list[LayerSpec], ctx: DistContext,
                    placement: list[int]) -> TiedEmbeddings | None:
    """This rank's view of the tied pair (None unless `model.tie_embeddings`). Call on every
    active rank at the same point: at start-up, and again after a re-pack (the head's rank
    changes). `placement` is the pipeline rank of every stage."""
    if not m.tie_embeddings:
        return None
    emb_name, head_name = family(m).tied
    first, last = placement[0], placement[-1]  # pipeline ranks of the embedding's and the head's stages
    group = None if first == last else _pair_group(ctx, first, last)
    return TiedEmbeddings(embed=(specs[0].index, emb_name), head=(specs[-1].index, head_name),
                          holds_embed=ctx.pp_rank == first, holds_head=ctx.pp_rank == last, group=group)


def _pair_group(ctx: DistContext, first: int, last: int) -> dist.ProcessGroup | None:
    """The group of this replica's two owners (None on the ranks between them).

    With two pipeline ranks the pair is the replica's pipeline group. Otherwise each pair
    creates its group alone (`use_local_synchronization=True`: after a re-pack the released
    ranks take part in nothing, see `DistContext.shrink`). Such a group's name is a hash of its
    ranks and of how many groups the creating rank already has, so every active rank must have
    created as many groups as the others before the next re-pack creates more: the ranks
    between the two owners create a group of themselves alone.
    """
    if ctx.pp == 2:
        return ctx.pp_group
    pair = [ctx._global(ctx.dp_rank, first), ctx._global(ctx.dp_rank, last)]
    if ctx.rank in pair:
        return dist.new_group(pair, use_local_synchronization=True)
    dist.new_group([ctx.rank], use_local_synchronization=True)
    return None
