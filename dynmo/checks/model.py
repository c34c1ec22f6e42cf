"""The model a configuration builds: its shape, its family and block, the block's options, and the
dynamic-model cases enabled on it.

Part of `dynmo.checks` (validation before any process starts); import-light: the cases' own
`check_options` need torch and are imported only when their case is enabled.
"""

from __future__ import annotations

from dynmo.checks.values import require
from dynmo.config import HASH_KERNELS, MOE_DISPATCH, Config, ConfigError, ModelConfig
from dynmo.model.families import check_block
from dynmo.plan import num_layers


def check_model(cfg: Config, stages: int) -> None:
    """Every one of `stages` pipeline stages gets a layer; the model's sizes fit together."""
    m = cfg.model
    n = num_layers(cfg)
    if stages > n:
        raise ConfigError(
            f"{stages} pipeline stages but only {n} layers (embedding + {m.n_layers} blocks + head); "
            "every stage needs at least one layer: use fewer ranks/virtual stages or more model.n_layers"
        )
    if m.d_model % m.n_heads and not (m.family != "gpt" and m.head_dim):
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")
    for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} must be >= 1")
    check_family(m)


def check_family(m: ModelConfig) -> None:
    """The model family and its block exist, and the family's options are ones it implements."""
    try:
        check_block(m.family, m.block)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.family == "gpt":
        return
    kv = m.n_kv_heads or m.n_heads
    if m.n_kv_heads < 0 or m.head_dim < 0 or m.intermediate_size < 0 or m.n_heads % kv:
        raise ConfigError(f"model.n_heads={m.n_heads} must be a multiple of model.n_kv_heads={m.n_kv_heads} "
                          "(0 = n_heads), and head_dim / intermediate_size >= 0 (0 = derived)")
    if m.dropout:
        raise ConfigError(f"model.dropout={m.dropout}: the {m.family} family has no dropout (set model.dropout = 0)")
    if not m.rope_theta > 0 or not m.norm_eps > 0:
        raise ConfigError(f"model.rope_theta={m.rope_theta} and model.norm_eps={m.norm_eps} must be > 0")


def check_block_options(m: ModelConfig) -> None:
    """The options of the chosen block: MoE, hash attention or mixture-of-depths."""
    if m.block == "moe":
        o = m.moe
        if not 1 <= o.top_k <= o.num_experts:
            raise ConfigError(f"model.moe.top_k={o.top_k} must be in 1..model.moe.num_experts={o.num_experts}")
        if o.capacity_factor < 0:
            raise ConfigError("model.moe.capacity_factor must be >= 0 (0 = dropless)")
        require("model.moe.aux_loss_coef", o.aux_loss_coef, ge=0, why="the weight of the load-balancing loss")
        if o.dispatch not in MOE_DISPATCH:
            raise ConfigError(f"model.moe.dispatch={o.dispatch!r} is not one of {', '.join(MOE_DISPATCH)}")
    if m.block == "hashattn":
        o = m.hashattn
        if o.n_buckets < 1 or o.chunk < 1 or m.seq_len % o.chunk:
            raise ConfigError(f"model.hashattn.chunk={o.chunk} must divide model.seq_len={m.seq_len} "
                              f"and model.hashattn.n_buckets={o.n_buckets} must be >= 1")
        if o.kernel not in HASH_KERNELS:
            raise ConfigError(f"model.hashattn.kernel={o.kernel!r} is not one of {', '.join(HASH_KERNELS)}")
    if m.block == "mod":
        o = m.mod
        if o.routing not in ("topk", "predictor"):
            raise ConfigError(f"model.mod.routing={o.routing!r}; use topk or predictor")
        if o.capacities and len(o.capacities) != m.n_layers:
            raise ConfigError(f"model.mod.capacities has {len(o.capacities)} entries; give one per block "
                              f"(model.n_layers={m.n_layers}) or leave it empty to use model.mod.capacity everywhere")
        bad = [c for c in [o.capacity, *o.capacities] if not 0.0 < c <= 1.0]
        if bad:
            raise ConfigError(f"model.mod capacities {bad} must be in (0, 1] (a fraction of each sequence)")
        require("model.mod.predictor_loss_coef", o.predictor_loss_coef, ge=0, why="the weight of the predictor's loss")


def check_device_kernels(cfg: Config) -> None:
    """A kernel the config names runs on the device the ranks will use (CUDA where the backend is
    nccl, or auto with a GPU; else CPU): `model.hashattn.kernel` (imports torch only when a
    kernel other than auto or tiles is named, both of which run everywhere)."""
    m = cfg.model
    if m.block != "hashattn" or m.hashattn.kernel in ("auto", "tiles"):
        return
    import torch

    from dynmo.model.hashattn import check_kernel

    backend = cfg.parallel.backend
    cuda = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
    problem = check_kernel(m.hashattn.kernel, "cuda" if cuda else "cpu")
    if problem:
        raise ConfigError(problem)


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def check_compile(cfg: Config) -> None:
    """`train.compile`: a backend torch has, and no block that reads a routing on the host (no
    graph could hold it); `train.cuda_graphs` (`check_cuda_graphs`)."""
    t, m = cfg.train, cfg.model
    if t.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(f"train.compile_backend={t.compile_backend!r}: choose one of {', '.join(COMPILE_BACKENDS)}")
    if t.cuda_graphs:
        check_cuda_graphs(cfg)
    if not t.compile or m.block != "moe":
        return
    if m.moe.dispatch == "padded":
        raise ConfigError("train.compile needs model.moe.dispatch = \"grouped\": the padded dispatch reads each "
                          "step's busiest expert on the host, which breaks the graph")
    if t.dtype != "bf16":
        raise ConfigError("train.compile with MoE blocks needs train.dtype = \"bf16\": torch compiles its grouped "
                          "expert matmul in bf16 only (or leave train.compile off)")


def check_cuda_graphs(cfg: Config) -> None:
    """`train.cuda_graphs`: replaying a compiled unit's recorded kernels needs the compiled units
    on CUDA, fixed shapes and no host read between a unit's kernels, and one backward pass a
    forward. Each refusal names what to change."""
    t, m, p = cfg.train, cfg.model, cfg.parallel
    from dynmo.schedules import get_schedule

    why = None
    if not t.compile:
        why = "it replays the compiled units' kernels: set train.compile = true too"
    elif t.compile_backend != "inductor":
        why = f"only Inductor records CUDA graphs (train.compile_backend={t.compile_backend!r}): use inductor"
    elif get_schedule(p.schedule).split_backward:
        why = (f"parallel.schedule={p.schedule!r} runs each backward in two passes (input, then weight "
               "gradients) and a recorded backward is one: use gpipe, 1f1b or interleaved1f1b")
    elif t.activation_checkpointing != "none":
        why = "recomputing a unit inside the backward replays its forward out of order: set train.activation_checkpointing = \"none\""
    elif cfg.early_exit.enabled:
        why = "early exit reads each block's active width on the host between units: leave early_exit off"
    elif m.block == "mod" and m.mod.routing != "topk":
        why = "predictor routing sizes each block's rows from the data (a host read): use model.mod.routing = \"topk\""
    elif p.ep > 1:
        why = "expert parallelism exchanges row counts read on the host: leave parallel.ep at 1"
    if why is None:
        import torch

        backend = p.backend
        if backend == "gloo" or not torch.cuda.is_available():
            why = "CUDA graphs record GPU kernel launches and this run has no GPU: leave train.cuda_graphs off"
    if why:
        raise ConfigError(f"train.cuda_graphs: {why}")


def check_cases(cfg: Config, pp: int) -> None:
    """The dynamic-model cases enabled (prune, freeze, early exit, skew, noise) on this model, over
    `pp` pipeline ranks. The cases check their own options (imported only when enabled: they need torch)."""
    m = cfg.model
    if cfg.prune.enabled:
        from dynmo.dynamics.prune import check_options as check_prune

        check_prune(cfg.prune, m)
    if cfg.freeze.enabled:
        from dynmo.dynamics.freeze import check_options as check_freeze

        check_freeze(cfg.freeze, m.n_layers)
    if cfg.early_exit.enabled:
        from dynmo.dynamics.earlyexit import check_options as check_exit

        check_exit(cfg.early_exit, cfg)
    bad = [b for b in cfg.skew.blocks if not 0 <= b < m.n_layers]
    if bad:
        raise ConfigError(f"skew.blocks {bad} outside 0..{m.n_layers - 1} (block numbers are 0-based)")
    if cfg.noise.enabled:
        from dynmo.dynamics.noise import check_options as check_noise

        check_noise(cfg.noise, pp)
