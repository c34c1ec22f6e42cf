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

from typing import Callable, NamedTuple

from dynmo.config import Config, ModelConfig
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


PARTS = {"a": "attn", "m": "mlp"}  # unit letter -> the half of a block it is


@dataclass(frozen=True)
class LayerSpec:
    """Everything needed to build placement unit `index` on any rank.

    A unit is the embedding (E), a whole transformer block (t), one half of a block --
    its attention half (a: norm, attention, residual add) or its MLP half (m: norm, MLP or
    MoE, residual add) -- or the head (L). `layer` is the unit's position in the model's
    layer list (E = 0, block b = b + 1, L = last), which seeds its weights: a block's halves
    start from exactly the weights of the whole block. Default: `index` (whole blocks).
    """

    letter: str  # E | t | a | m | L: how a layout prints it
    index: int  # position among the pipeline's units
    layer: int = -1  # position in the model's layer list; -1: the same as index

    @property
    def model_index(self) -> int:
        return self.index if self.layer < 0 else self.layer

    @property
    def is_block(self) -> bool:
        """A whole transformer block or one of its halves."""
        return self.letter in ("t", "a", "m")

    @property
    def part(self) -> str | None:
        """"attn" or "mlp" for a half block, None for a whole unit."""
        return PARTS.get(self.letter)

    @property
    def block(self) -> int | None:
        """0-based block number, None for the embedding and the head."""
        return self.model_index - 1 if self.is_block else None

    @property
    def prefix(self) -> str:
        """The model layer's stable name, the prefix of its parameters in checkpoints and
        exports: embed, block0, ..., head (a half block's parameters keep the block's names)."""
        if self.letter == "E":
            return "embed"
        if self.letter == "L":
            return "head"
        return f"block{self.block}"

    @property
    def name(self) -> str:
        """The unit's stable name: the prefix, with _attn / _mlp for a half block."""
        return self.prefix + (f"_{self.part}" if self.part else "")


def layer_specs(cfg: ModelConfig, unit: str = "block") -> list[LayerSpec]:
    """The pipeline's placement units in model order (`parallel.unit`)."""
    n = cfg.n_layers
    if unit == "sublayer":
        halves = [LayerSpec(letter, 1 + 2 * b + k, b + 1) for b in range(n) for k, letter in enumerate("am")]
        return [LayerSpec("E", 0)] + halves + [LayerSpec("L", 2 * n + 1, n + 1)]
    return [LayerSpec("E", 0)] + [LayerSpec("t", i + 1) for i in range(n)] + [LayerSpec("L", n + 1)]


class Carry(NamedTuple):
    """A tensor that may cross a boundary between a block's two halves beside the residual
    stream and the mask (`dynmo.model.gpt.Halves`): [B, T, D] or [B, T], in the compute dtype
    or bool, and whether a gradient flows back through it."""

    per_feature: bool
    floating: bool
    grad: bool


CARRIES = {
    "route": Carry(False, True, True),  # Mixture of Depths: each chosen token's router weight, 0 elsewhere
    "chosen": Carry(False, False, False),  # Mixture of Depths: the tokens the attention half chose
    "block_input": Carry(True, True, False),  # early exit: the block's input, for the decision after its MLP half
}


def half_carry(cfg: Config) -> tuple[str, ...]:
    """What a block's attention half hands its MLP half beside (x, mask), in order: the
    block's own carry, then the early-exit gate's (`dynmo.dynamics.earlyexit`)."""
    return block_class(cfg.model).carry + (("block_input",) if cfg.early_exit.enabled else ())


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
        torch.manual_seed(seed * 1_000_003 + spec.model_index)
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
    """Tell a block its number (0-based), for per-block options such as MoD capacities; a half
    block keeps only its half's modules (`keep_half`)."""
    if spec.is_block:
        layer.index = spec.block
    if spec.part:
        keep_half(layer, spec.part)
    return layer


def keep_half(block: nn.Module, part: str) -> None:
    """Make `block` one of its two placement units: the other half's modules are dropped, and
    its forward runs `part`'s half only (the block class's `halves` name the modules of each:
    attention half first, as the block registers them, so the parameters of the two halves in
    order are the block's in order, under the same names)."""
    halves = getattr(type(block), "halves", None)
    if halves is None:
        raise ValueError(f"{type(block).__name__} cannot be split into attention and MLP halves")
    drop = halves[1] if part == "attn" else halves[0]
    for name in drop:
        setattr(block, name, None)
    block.part = part


def param_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def layer_param_counts(cfg: ModelConfig, unit: str = "block") -> list[int]:
    """Parameters per placement unit without allocating weights (built on the meta device)."""
    with torch.device("meta"):
        return [param_count(tag_layer(layer_class(s, cfg)(cfg), s)) for s in layer_specs(cfg, unit)]
