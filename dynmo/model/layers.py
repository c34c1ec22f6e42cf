"""The model as the list of layers a pipeline moves: E (embedding), t (blocks), L (head).

A `LayerSpec` is all a rank needs to build a layer (DeepSpeed's LayerSpec idea), so any rank
can build any layer: at start-up the layers of its stages, later a layer that migrates to it.
`build_layer` seeds each layer from (seed, layer index), so a layer has the same initial
weights wherever it is built.

A model family (`FAMILIES`, chosen by `model.family`) supplies the embedding, the head, its
block variants (chosen by `model.block`), its initialisation and the names of the two tensors
`model.tie_embeddings` shares (`Family.tied`). Every block takes
`(cfg: ModelConfig)` and maps `(x, mask) -> (x, mask)` with fixed shapes; the runtime, the
balancers and the cases ask the spec what a layer is (`is_block`), never its class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from typing import Callable

from dynmo.config import ModelConfig
from dynmo.model import gpt, llama, mixtral
from dynmo.model.families import FAMILY_BLOCKS, check_block
from dynmo.model.hashattn import HashAttnBlock, LlamaHashAttnBlock
from dynmo.model.mod import LlamaMoDBlock, MoDBlock
from dynmo.model.moe import MoEBlock


@dataclass(frozen=True)
class Family:
    embedding: type[nn.Module]
    head: type[nn.Module]
    blocks: dict[str, type[nn.Module]]  # model.block -> block class
    init_weights: Callable[[nn.Module, ModelConfig], None]
    # (embedding parameter, head parameter): one logical tensor with model.tie_embeddings.
    # The two layers live on different stages, so each keeps a copy (dynmo.runtime.tie).
    tied: tuple[str, str]


FAMILIES: dict[str, Family] = {
    "gpt": Family(gpt.Embedding, gpt.Head,
                  {"dense": gpt.Block, "moe": MoEBlock, "hashattn": HashAttnBlock, "mod": MoDBlock}, gpt.init_weights,
                  ("tok.weight", "lm_head.weight")),
    "llama": Family(llama.Embedding, llama.Head,
                    {"dense": llama.Block, "mod": LlamaMoDBlock, "hashattn": LlamaHashAttnBlock}, llama.init_weights,
                    ("embed_tokens.weight", "lm_head.weight")),
    "mixtral": Family(llama.Embedding, llama.Head, {"moe": mixtral.Block}, llama.init_weights,
                      ("embed_tokens.weight", "lm_head.weight")),
}
BLOCKS = FAMILIES["gpt"].blocks  # the GPT's block variants
# the names the config checks know, without torch, are these
assert {name: tuple(f.blocks) for name, f in FAMILIES.items()} == FAMILY_BLOCKS


def family(cfg: ModelConfig) -> Family:
    check_block(cfg.family, cfg.block)
    return FAMILIES[cfg.family]


@dataclass(frozen=True)
class LayerSpec:
    """Everything needed to build layer `index` on any rank."""

    letter: str  # "E" (embedding) | "t" (transformer block) | "L" (head): how a layout prints it
    index: int  # position in the model, 0 .. n_layers + 1

    @property
    def is_block(self) -> bool:
        return self.letter == "t"

    @property
    def block(self) -> int | None:
        """0-based block number, None for the embedding and the head."""
        return self.index - 1 if self.is_block else None

    @property
    def name(self) -> str:
        """Stable name, used as checkpoint key prefix: embed, block0, block1, ..., head."""
        if self.letter == "E":
            return "embed"
        if self.letter == "L":
            return "head"
        return f"block{self.index - 1}"


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    return [LayerSpec("E", 0)] + [LayerSpec("t", i + 1) for i in range(cfg.n_layers)] + [
        LayerSpec("L", cfg.n_layers + 1)
    ]


def block_class(cfg: ModelConfig) -> type[nn.Module]:
    return family(cfg).blocks[cfg.block]


def layer_class(spec: LayerSpec, cfg: ModelConfig) -> type[nn.Module]:
    if not spec.is_block:
        fam = family(cfg)
        return fam.embedding if spec.letter == "E" else fam.head
    return block_class(cfg)


def build_layer(spec: LayerSpec, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Build one layer with weights that depend only on (seed, spec), not on where it is built.

    With `model.tie_embeddings` the head's tied tensor starts as the embedding's: the embedding
    is built here too, from its own seed, so the head needs no other rank to get it.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + spec.index)
        layer = layer_class(spec, cfg)(cfg)
        family(cfg).init_weights(layer, cfg)
    if cfg.tie_embeddings and spec.letter == "L":
        emb_name, head_name = family(cfg).tied
        embedding = build_layer(LayerSpec("E", 0), cfg, seed)
        with torch.no_grad():
            layer.get_parameter(head_name).copy_(embedding.get_parameter(emb_name))
    return tag_layer(layer, spec).to(device)


def empty_layer(spec: LayerSpec, cfg: ModelConfig, device: torch.device | str) -> nn.Module:
    """Layer `spec` with uninitialised storage on `device`, for weights about to be loaded."""
    with torch.device("meta"):
        layer = layer_class(spec, cfg)(cfg)
    return tag_layer(layer.to_empty(device=device), spec)


def tag_layer(layer: nn.Module, spec: LayerSpec) -> nn.Module:
    """Tell a block its number (0-based), for per-block options such as MoD capacities."""
    if spec.is_block:
        layer.index = spec.block
    return layer


def param_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def layer_param_counts(cfg: ModelConfig) -> list[int]:
    """Parameters per layer without allocating weights (built on the meta device)."""
    with torch.device("meta"):
        return [param_count(layer_class(s, cfg)(cfg)) for s in layer_specs(cfg)]
