"""A readable GPT, built as a list of layers any rank can construct from a spec.

Read top to bottom: attention -> MLP -> Block -> Embedding -> Head -> specs.

Every layer maps `(x, mask) -> (x, mask)` except the embedding (`tokens -> (x, mask)`) and the
head (`(x, mask) -> logits`). `mask` is a bool [batch, seq] tensor of *active* tokens with a
fixed shape; dense models leave it all True. Dynamic models (early exit, Mixture of Depths)
use it to skip work on inactive tokens without changing the tensor shapes that cross stage
boundaries.

Each layer is initialised from its own seed (seed, layer index), so a model built whole in
one process and a model built piecewise on many ranks, or a layer rebuilt on the rank it
migrated to, start from identical weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"model.d_model={cfg.d_model} must be divisible by model.n_heads={cfg.n_heads}")
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Structured pruning (dynmo/dynamics/prune.py) removes hidden units, so a migrated or
        # restored MLP may be narrower than the config says: take the width of the weights.
        w = state_dict.get(prefix + "fc.weight")
        if w is not None and w.shape[0] != self.fc.out_features:
            dev, dt = self.fc.weight.device, self.fc.weight.dtype
            self.fc = nn.Linear(self.fc.in_features, w.shape[0], bias=self.fc.bias is not None, device=dev, dtype=dt)
            self.proj = nn.Linear(w.shape[0], self.proj.out_features, bias=self.proj.bias is not None, device=dev, dtype=dt)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Block(nn.Module):
    """Pre-norm transformer block (t)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        # Injected imbalance (SkewConfig): extra MLP passes whose result is multiplied by zero.
        # Real forward and backward work; y + 0 * z == y, so the math is unchanged.
        self.extra_mlp_passes = 0
        # Early exit (dynmo/dynamics/earlyexit.py) sets both: a per-token exit classifier (a
        # submodule, so it trains, migrates and is checkpointed with the block) and a router
        # that computes only the active tokens and lets confident ones exit. None: dense block.
        self.exit_head: nn.Module | None = None
        self.token_router = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        if self.token_router is not None:
            return self.token_router(self, x, mask)
        return self.dense_forward(x, mask)

    def dense_forward(self, x: torch.Tensor, mask: torch.Tensor):
        """The block on every token (mask passes through)."""
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        y = self.mlp(h)
        for _ in range(self.extra_mlp_passes):
            y = y + 0.0 * self.mlp(h)
        return x + y, mask

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A block migrated with an early-exit classifier is rebuilt without one: grow it.
        w = state_dict.get(prefix + "exit_head.weight")
        if w is not None and self.exit_head is None:
            self.exit_head = nn.Linear(w.shape[1], w.shape[0], device=self.ln1.weight.device, dtype=w.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Embedding(nn.Module):
    """Token + learned position embedding (E). Starts every token active."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor):
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        mask = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        return x, mask


class Head(nn.Module):
    """Final norm + LM head (L). The loss (`loss_fn`) is applied to its logits by the schedule.

    Not weight-tied to the embedding: E and L usually live on different stages.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one microbatch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---- layer specs --------------------------------------------------------------------------

KINDS = {"E": Embedding, "t": Block, "L": Head}

# Block variants for dynamic models (model.block selects one): each takes (cfg: ModelConfig)
# and maps (x, mask) -> (x, mask) with the same shapes as Block.
BLOCKS: dict[str, type[nn.Module]] = {"dense": Block}


def register_block(name: str):
    """Class decorator: make a block variant available as `model.block = name`."""

    def deco(cls):
        BLOCKS[name] = cls
        return cls

    return deco


def layer_class(kind: str, cfg: ModelConfig) -> type[nn.Module]:
    if kind != "t":
        return KINDS[kind]
    if cfg.block not in BLOCKS:
        import dynmo.dynamics  # noqa: F401  registers the dynamic-model blocks on first use
    try:
        return BLOCKS[cfg.block]
    except KeyError:
        raise ValueError(f"unknown model.block {cfg.block!r}; known: {sorted(BLOCKS)}") from None


@dataclass(frozen=True)
class LayerSpec:
    """Everything needed to build layer `index` on any rank (DeepSpeed's LayerSpec idea)."""

    kind: str  # "E" | "t" | "L"
    index: int  # position in the model, 0 .. n_layers + 1

    @property
    def name(self) -> str:
        """Stable name, used as checkpoint key prefix: embed, block0, block1, ..., head."""
        if self.kind == "E":
            return "embed"
        if self.kind == "L":
            return "head"
        return f"block{self.index - 1}"


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    return [LayerSpec("E", 0)] + [LayerSpec("t", i + 1) for i in range(cfg.n_layers)] + [
        LayerSpec("L", cfg.n_layers + 1)
    ]


def build_layer(spec: LayerSpec, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Build one layer with weights that depend only on (seed, spec), not on where it is built."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + spec.index)
        layer = layer_class(spec.kind, cfg)(cfg)
        _init_weights(layer, cfg)
    return tag_layer(layer, spec).to(device)


def tag_layer(layer: nn.Module, spec: LayerSpec) -> nn.Module:
    """Tell a block its number (0-based), for per-block options such as MoD capacities."""
    if spec.kind == "t":
        layer.index = spec.index - 1
    return layer


def _init_weights(layer: nn.Module, cfg: ModelConfig) -> None:
    # GPT-2 init: N(0, 0.02), residual projections scaled down by depth.
    for name, p in layer.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


def param_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def layer_param_counts(cfg: ModelConfig) -> list[int]:
    """Parameters per layer without allocating weights (built on the meta device)."""
    with torch.device("meta"):
        return [param_count(layer_class(s.kind, cfg)(cfg)) for s in layer_specs(cfg)]
