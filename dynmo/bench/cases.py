"""The benchmark's cases: each dynamic-model config, its trigger, its paper-scale shape and its dense model; the paper's figures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DENSE = "configs/default.toml"


@dataclass(frozen=True)
class BenchCase:
    name: str
    config: str
    when: str  # the controller trigger dynmo uses for this case
    stages: int  # paper-scale simulation
    dp: int
    blocks: int
    steps: int = 60  # real runs: long enough for the case's dynamism to develop
    extra: tuple[str, ...] = ()  # overrides of the case's config for the benchmark
    dense: str | None = DENSE  # the model without the technique; None: no dense counterpart
    dense_extra: tuple[str, ...] = ()  # overrides that turn the technique off in `dense`
    repack: bool = False  # a shrinking model: also run dynmo with re-packing


CASES = [
    BenchCase("skewed", "configs/skewed.toml", "auto", 24, 30, 48, steps=60),
    # the dense counterpart of a block kind is the same config with dense blocks (same sizes, batch, data)
    BenchCase("moe", "configs/moe.toml", "auto", 16, 8, 32, steps=80,
              dense="configs/moe.toml", dense_extra=("--model.block", "dense")),
    BenchCase("mod", "configs/mod.toml", "auto", 16, 8, 32, steps=80,
              dense="configs/mod.toml", dense_extra=("--model.block", "dense")),
    BenchCase("hashattn", "configs/hashattn.toml", "auto", 24, 30, 48, steps=80,
              dense="configs/hashattn.toml", dense_extra=("--model.block", "dense")),
    # the whole cubic schedule (steps 10..50, to 90 %), then 70 steps at the final sparsity
    BenchCase("pruning", "configs/pruning.toml", "dynamism", 24, 30, 48, steps=120, repack=True),
    # the same schedule removing whole MLP units: the blocks' matrices really shrink
    BenchCase("pruning-structured", "configs/pruning.toml", "dynamism", 24, 30, 48, steps=120,
              extra=("--prune.structured", "true"), repack=True),
    # until all blocks but the last may freeze
    BenchCase("freezing", "configs/freezing.toml", "dynamism", 24, 30, 48, steps=150,
              extra=("--freeze.max_frozen", "-1"), repack=True),
    # exits from step 10 on, with the classifiers training from step 0
    BenchCase("earlyexit", "configs/earlyexit.toml", "auto", 24, 30, 48, steps=120, repack=True),
    BenchCase("mixtral", "configs/mixtral.toml", "auto", 16, 8, 32, steps=60, dense=None),
]
SIM_POLICIES = ["uniform", "params", "profile-once", "optimal", "optimal+repack", "deepspeed", "diffusion-contiguous",
                "oracle-window", "oracle"]
STATIC_VARIANTS = ("uniform", "params", "profile-once")
# whole blocks against half blocks: every sublayer trace in OUT/traces/sublayer/ scaled to this many
# blocks and replayed at this shape (4 microbatches per stage, as the cases' replays)
UNITS_BLOCKS, UNITS_STAGES, UNITS_DP = 48, 24, 30
UNITS_MICROBATCHES = 4 * UNITS_STAGES
# alternating pairs of the best static layout and dynmo per case: 6 is the fewest whose
# distribution-free interval for the median ratio covers 95%
PAIRS = 6

# The DynMo paper's end-to-end speedup for each case, and what it is measured against.
PAPER = {
    "moe": (1.23, "static Megatron-LM / DeepSpeed layouts"),
    "pruning": (3.18, "static layouts, pruning 52 % -> 79 % -> 90 % every 1,000 iterations"),
    "freezing": (2.23, "static layouts, freezing checked every 50 iterations"),
    "hashattn": (4.02, "the dense-attention model"),
    "earlyexit": (4.52, "the model without early exit"),
    "mod": (1.17, "static layouts"),
}
