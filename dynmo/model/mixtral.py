"""Mixtral-family block: the Llama block with a sparse Mixture-of-Experts SwiGLU MLP.

Routing is Mixtral's (`dynmo.model.moe.route`): router logits (`block_sparse_moe.gate`) ->
softmax over experts -> top-k experts per token -> their probabilities renormalised to sum to 1;
dropless by default, `moe.capacity_factor` > 0 caps each expert's assignments. Each expert is a
SwiGLU MLP, `w2(silu(w1 x) * w3 x)`; the experts' weights are stacked per projection
(`block_sparse_moe.experts.w1` is [experts, intermediate, d_model], expert j's row is
Hugging Face's `experts.{j}.w1.weight`).

As in the GPT MoE block (`dynmo.model.moe`), the experts run dropless and grouped by default:
the kept assignments sorted by expert, one grouped matmul per stacked weight (`w1`, `w3`, `w2`),
no padding and no host synchronisation; `moe.dispatch = "padded"` pads every expert to the
busiest one instead (one batched matmul over an [experts, rows, d_model] buffer). With expert
parallelism (`parallel.ep` > 1) each rank holds only its experts' rows of the stacked weights
and runs them, grouped, on exactly the rows routed to them.
The load-balancing loss (`moe.aux_loss_coef`) is this block's own Switch/Mixtral loss, carried
into the backward pass by `attach_aux_loss`. (transformers adds one loss over all layers'
router logits pooled, and only with `output_router_logits`; a pipeline stage sees only its own
layers, so dynmo sums the per-layer losses.)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import ModelConfig
from dynmo.model.grouped import grouped_mm, probe
from dynmo.model.llama import Attention, RMSNorm, intermediate_size
from dynmo.model.moe import RoutedBlock, sparse_mlp


class SwiGLUExperts(nn.Module):
    """E SwiGLU MLPs: on an [E, C, D] buffer with batched matmuls (padded), or on rows sorted by
    expert with grouped matmuls."""

    def __init__(self, num_experts: int, d_model: int, inter: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, d_model))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, inter))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(torch.bmm(x, self.w1.transpose(1, 2))) * torch.bmm(x, self.w3.transpose(1, 2))
        return torch.bmm(h, self.w2.transpose(1, 2))

    def grouped(self, x: torch.Tensor, offs: torch.Tensor, idx: torch.Tensor, spare: bool = True) -> torch.Tensor:
        """Rows x [R, D] sorted by expert (`dynmo.model.grouped`; idx unused: no biases) -> [R, D]."""
        h = F.silu(grouped_mm(x, self.w1.transpose(1, 2), offs)) * grouped_mm(x, self.w3.transpose(1, 2), offs)
        return grouped_mm(h, self.w2.transpose(1, 2), offs)

    def before_compile(self, dtype: torch.dtype) -> None:
        for w in (self.w1, self.w2):  # the probe cannot run inside a graph; w3 is w1's shape
            probe(w.transpose(1, 2), dtype)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        o = cfg.moe
        if not 1 <= o.top_k <= o.num_experts:
            raise ValueError(f"moe.top_k={o.top_k} must be in 1..moe.num_experts={o.num_experts}")
        self.opts = o
        self.gate = nn.Linear(cfg.d_model, o.num_experts, bias=False)
        self.experts = SwiGLUExperts(o.num_experts, cfg.d_model, intermediate_size(cfg))


class Block(RoutedBlock):
    """Pre-norm decoder block whose MLP is a sparse MoE (t)."""

    halves = (("input_layernorm", "self_attn"), ("post_attention_layernorm", "block_sparse_moe"))

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.opts = cfg.moe
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.block_sparse_moe = SparseMoE(cfg)
        self.reset_stats()

    def attn_half(self, x: torch.Tensor, mask: torch.Tensor):
        return x + self.self_attn(self.input_layernorm(x)), mask

    def moe_branch(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.block_sparse_moe
        return sparse_mlp(self.post_attention_layernorm(x), self.routed(mask), moe.gate, moe.experts, self.opts,
                          self._stats)
