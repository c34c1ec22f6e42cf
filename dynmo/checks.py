"""Validate a configuration before any process starts work: clear errors, never a hang.

Import-light (no torch): the launcher calls it before spawning torchrun, and every rank calls
it again at start-up.
"""

from __future__ import annotations

import json
from pathlib import Path

from dynmo import hf_config
from dynmo.config import Config, ConfigError, ModelConfig
from dynmo.loop import check_balance
from dynmo.model.families import check_block
from dynmo.plan import DTYPES, explicit_layout, num_layers, parse_relayouts, recompute_blocks, resolve_pp
from dynmo.schedules import TRAINABLE, ScheduleError, get_schedule

MODEL_SHAPE_FIELDS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio", "tie_embeddings")


def validate(cfg: Config, world: int) -> None:
    """Raise ConfigError naming the problem and the fix. `world` = number of ranks."""
    hf_config.apply(cfg)  # first: model.hf_path's config.json overwrites [model], which the checks below read
    m, t, p = cfg.model, cfg.train, cfg.parallel
    try:
        schedule = get_schedule(p.schedule)
    except ScheduleError:
        schedule = None
    if schedule is None or not schedule.trainable:
        raise ConfigError(f"unknown schedule {p.schedule!r}; choose one of {', '.join(TRAINABLE)}")
    sched = schedule.name
    pp = resolve_pp(cfg, world)
    if pp * p.dp != world:
        raise ConfigError(f"parallel.pp={pp} x parallel.dp={p.dp} = {pp * p.dp} ranks, but {world} were requested")
    v = p.virtual_stages
    if schedule.fixed_stages_per_rank == 2 and v != 2:
        raise ConfigError(f"schedule {sched} needs parallel.virtual_stages = 2")
    if not schedule.multi_stage and v != 1:
        multi = [s for s in TRAINABLE if get_schedule(s).multi_stage]
        raise ConfigError(f"schedule {sched} runs one stage per rank; set parallel.virtual_stages = 1 "
                          f"or use one of {', '.join(multi)}")
    if v < 1:
        raise ConfigError(f"parallel.virtual_stages must be >= 1, got {v}")
    stages = pp * v
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
    if t.steps < 0 or t.microbatches < 1 or t.global_batch < 1:
        raise ConfigError("train.steps must be >= 0, train.microbatches and train.global_batch >= 1")
    if t.global_batch % p.dp:
        raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by parallel.dp={p.dp}")
    local = t.global_batch // p.dp
    if local % t.microbatches:
        raise ConfigError(
            f"the per-replica batch {local} (train.global_batch / parallel.dp) is not divisible into "
            f"train.microbatches={t.microbatches}; pick a microbatch count that divides it"
        )
    if schedule.multi_stage and schedule.placement == "loop":
        rounds = max(1, t.microbatches // pp)
        if t.microbatches % rounds:
            raise ConfigError(f"{sched} needs train.microbatches to be a multiple of {rounds} with pp={pp}")
    if t.dtype not in DTYPES:
        raise ConfigError(f"train.dtype={t.dtype!r}: choose one of {', '.join(DTYPES)}")
    recompute_blocks(cfg)
    # initial layout
    lay = p.layout.strip().lower()
    if lay not in ("uniform", "params"):
        explicit_layout(p.layout, cfg, stages, "parallel.layout")
    parse_relayouts(cfg, stages)
    bc = cfg.balance
    check_balance(bc)
    changes = cfg.prune.enabled or cfg.freeze.enabled or cfg.early_exit.enabled or (cfg.skew.factor > 1)
    if bc.when == "dynamism" and not changes:
        raise ConfigError(
            "balance.when = dynamism rebalances after steps that change the model (prune, freeze, early_exit, "
            "skew), and none is enabled; use balance.when = auto (or every) for models whose cost drifts per step"
        )
    if bc.repack and v != 1:
        raise ConfigError(f"balance.repack needs one stage per rank (schedule gpipe or 1f1b), not {sched}")
    if bc.speeds and len(bc.speeds) != pp:
        raise ConfigError(f"balance.speeds needs one positive speed per pipeline rank ({pp}), got {bc.speeds}")
    if m.block == "moe":
        o = m.moe
        if not 1 <= o.top_k <= o.num_experts:
            raise ConfigError(f"model.moe.top_k={o.top_k} must be in 1..model.moe.num_experts={o.num_experts}")
        if o.capacity_factor < 0:
            raise ConfigError("model.moe.capacity_factor must be >= 0 (0 = dropless)")
    if m.block == "hashattn":
        o = m.hashattn
        if o.n_buckets < 1 or o.chunk < 1 or m.seq_len % o.chunk:
            raise ConfigError(f"model.hashattn.chunk={o.chunk} must divide model.seq_len={m.seq_len} "
                              f"and model.hashattn.n_buckets={o.n_buckets} must be >= 1")
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
    # the cases check their own options (imported only when enabled: they need torch)
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
    # data
    for path in cfg.data.paths:
        if not Path(path).exists():
            raise ConfigError(f"data path {path!r} does not exist (data.paths takes text files or folders)")
    if not cfg.data.paths:
        from dynmo.data import DataError, default_corpus_dir

        try:
            default_corpus_dir()
        except DataError as e:
            raise ConfigError(str(e)) from None
    if cfg.checkpoint.resume:
        check_checkpoint(cfg, cfg.checkpoint.resume)


def check_family(m) -> None:
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


def check_checkpoint(cfg: Config, path: str) -> dict:
    meta_path = Path(path) / "dynmo.json"
    if not meta_path.is_file():
        raise ConfigError(f"checkpoint.resume={path!r} is not a dynmo checkpoint (no dynmo.json inside)")
    meta = json.loads(meta_path.read_text())
    saved = {k: meta["model"].get(k, getattr(ModelConfig(), k)) for k in MODEL_SHAPE_FIELDS}  # older: defaults
    diffs = [
        f"model.{k}: checkpoint {saved[k]} vs config {getattr(cfg.model, k)}"
        for k in MODEL_SHAPE_FIELDS
        if saved[k] != getattr(cfg.model, k)
    ]
    if diffs:
        raise ConfigError(
            "the checkpoint holds a model of a different shape: " + "; ".join(diffs) +
            ". Resume with the checkpoint's model settings (its config.toml is beside it)."
        )
    return meta
