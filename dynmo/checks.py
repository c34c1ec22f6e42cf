"""Validate a configuration before any process starts work: clear errors, never a hang.

Import-light (no torch): the launcher calls it before spawning torchrun, and every rank calls
it again at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path

from dynmo import hf_config, rundir
from dynmo.balance.experts import check_order
from dynmo.config import Config, ConfigError, ModelConfig
from dynmo.layout import Layout
from dynmo.loop import check_balance
from dynmo.model.families import check_block
from dynmo.plan import (DTYPES, NAMED_LAYOUTS, UNITS, explicit_layout, layer_names, num_layers, parse_relayouts,
                        recompute_blocks, resolve_pp)
from dynmo.schedules import TRAINABLE, ScheduleError, get_schedule

MODEL_SHAPE_FIELDS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio", "tie_embeddings")
BACKENDS = ("auto", "gloo", "nccl")

# Numeric fields checked on every config, whatever is enabled: (field, bounds, what it is).
# Bounds: ge (>=), gt (>), le (<=), lt (<). Fields of the dynamic-model cases (prune, freeze,
# early_exit, noise) are checked by the cases' own check_options when enabled; the MoE and MoD
# options when their block is chosen; every float field, whatever its section, must be finite.
RANGES: tuple[tuple[str, dict, str], ...] = (
    ("model.dropout", {"ge": 0, "lt": 1}, "a probability"),
    ("data.val_fraction", {"ge": 0, "lt": 1}, "the fraction of the tokens held out for validation"),
    ("train.lr", {"ge": 0}, "the peak learning rate"),
    ("train.warmup_steps", {"ge": 0}, "steps of linear warm-up; 0 = none"),
    ("train.weight_decay", {"ge": 0}, "AdamW's decoupled weight decay"),
    ("train.beta1", {"ge": 0, "lt": 1}, "AdamW's decay of the gradient average"),
    ("train.beta2", {"ge": 0, "lt": 1}, "AdamW's decay of the squared-gradient average"),
    ("train.grad_clip", {"ge": 0}, "the largest global gradient norm; 0 = no clipping"),
    ("train.seed", {"ge": 0, "le": 2**32 - 1}, "a 32-bit seed"),
    ("train.eval_every", {"ge": 0}, "steps between validation losses; 0 = never"),
    ("train.eval_batches", {"ge": 1}, "batches per validation loss"),
    ("parallel.pp", {"ge": 0}, "pipeline ranks; 0 = world size / parallel.dp"),
    ("parallel.timeout_s", {"gt": 0}, "seconds an operation waits for a peer before the job fails"),
    ("balance.min_gain", {"ge": 0, "lt": 1}, "the fraction of the step time a rebalance must save"),
    ("balance.horizon", {"ge": 1}, "steps over which a rebalance must repay its migration"),
    ("balance.confidence", {"gt": 0.5, "lt": 1}, "how sure auto's evidence must be that a saving is not noise"),
    ("balance.confirm", {"ge": 0}, "fresh steps that must confirm a proposed move"),
    ("skew.factor", {"ge": 1}, "times the skewed blocks run their MLP; 1 = no skew"),
    ("skew.start_step", {"ge": 0}, "the first skewed step"),
    ("checkpoint.every", {"ge": 0}, "steps between checkpoints; 0 = only the final one"),
    ("checkpoint.keep", {"ge": 0}, "newest complete checkpoints kept; 0 = all"),
    ("log.every", {"ge": 1}, "steps between logged lines"),
)
# what a checkpoint's dynmo.json must hold: key -> (accepts the value, what it should be)
CHECKPOINT_KEYS = {
    "step": (lambda v: type(v) is int and v >= 0, "a step number >= 0"),
    "model": (lambda v: isinstance(v, dict), "the [model] section (an object)"),
    "layer_names": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of layer names"),
    "layout": (lambda v: isinstance(v, list) and all(type(x) is int for x in v), "a list of stage boundaries"),
}


def check_unit(cfg: Config) -> None:
    """`parallel.unit`: every block variant and dynamic case places half blocks."""
    unit = cfg.parallel.unit
    if unit not in UNITS:
        raise ConfigError(f"parallel.unit = {unit!r}: choose one of {', '.join(UNITS)}")


SHARDS = ("none", "optimizer", "full")


def check_shard(cfg: Config) -> None:
    """`parallel.shard`: what the data-parallel replicas of a stage shard."""
    shard, dp = cfg.parallel.shard, cfg.parallel.dp
    if shard not in SHARDS:
        raise ConfigError(f"parallel.shard = {shard!r}: choose one of {', '.join(SHARDS)}")
    if shard == "none":
        return
    if dp < 2:
        raise ConfigError(f"parallel.shard = {shard!r} shards over the data-parallel replicas, and parallel.dp = {dp}: "
                          "set parallel.dp >= 2, or parallel.shard = \"none\"")
    if cfg.prune.enabled:
        raise ConfigError(f"parallel.shard = {shard!r} does not work with pruning yet (prune.enabled = true): pruning "
                          "edits the AdamW moments of whole parameters; use parallel.shard = \"none\"")
    if shard != "full":
        return
    fix = "use parallel.shard = \"optimizer\" or \"none\""
    for section, what in (("freeze", "freezing"), ("early_exit", "early exit")):
        if getattr(cfg, section).enabled:
            raise ConfigError(f"parallel.shard = \"full\" does not work with {what} yet ({section}.enabled = true): "
                              f"it changes the parameters of units already sharded; {fix}")
    if cfg.model.tie_embeddings:
        raise ConfigError(f"parallel.shard = \"full\" does not work with model.tie_embeddings yet (the two copies' "
                          f"gradients are summed whole); {fix}")
    schedule = get_schedule(cfg.parallel.schedule)
    if schedule.split_backward:
        raise ConfigError(f"parallel.shard = \"full\" does not work with zero-bubble schedules (parallel.schedule = "
                          f"{schedule.name!r} computes weight gradients after FSDP has reduced them); use gpipe, 1f1b "
                          f"or interleaved1f1b, or {fix}")


def check_expert_parallel(cfg: Config) -> None:
    """`parallel.ep`: over how many data-parallel replicas the experts of every MoE layer spread."""
    ep, dp, m = cfg.parallel.ep, cfg.parallel.dp, cfg.model
    if type(ep) is not int or ep < 1:
        raise ConfigError(f"parallel.ep = {ep!r}: use a whole number >= 1 (1 = no expert parallelism)")
    slots = cfg.parallel.expert_slots
    if type(slots) is not int or slots < 0:
        raise ConfigError(f"parallel.expert_slots = {slots!r}: use a whole number >= 0 (0 = no copies of experts)")
    if ep == 1:
        if slots:
            raise ConfigError(f"parallel.expert_slots = {slots} holds copies of experts on other expert-parallel "
                              "ranks, and parallel.ep = 1: use parallel.ep > 1 or parallel.expert_slots = 0")
        return
    if not m.has_experts:
        raise ConfigError(f"parallel.ep = {ep} spreads the experts of MoE layers, and model.block = {m.block!r} has "
                          "none: use model.block = \"moe\" or parallel.ep = 1")
    if dp % ep:
        raise ConfigError(f"parallel.ep = {ep} does not divide parallel.dp = {dp}: the experts spread over groups of "
                          "parallel.ep data-parallel replicas")
    if m.moe.num_experts % ep:
        raise ConfigError(f"parallel.ep = {ep} does not divide moe.num_experts = {m.moe.num_experts}: every rank "
                          "holds the same number of experts")
    room = m.moe.num_experts - m.moe.num_experts // ep
    if slots > room:
        raise ConfigError(f"parallel.expert_slots = {slots}: a rank holds each expert at most once, so at most {room} "
                          f"copies beyond its {m.moe.num_experts // ep} experts (moe.num_experts = "
                          f"{m.moe.num_experts}, parallel.ep = {ep})")
    if cfg.parallel.shard != "none":
        raise ConfigError(f"parallel.shard = {cfg.parallel.shard!r} with parallel.ep = {ep}: expert parallelism runs "
                          "with parallel.shard = \"none\" for now")
    for section, what in (("prune", "pruning"), ("freeze", "freezing")):
        if getattr(cfg, section).enabled:
            raise ConfigError(f"parallel.ep = {ep} does not work with {what} yet ({section}.enabled = true): it reads "
                              f"or edits whole expert weights; use parallel.ep = 1")


def parse_replacements(cfg: Config) -> dict[int, dict[str, tuple[int, ...]]]:
    """`parallel.replace_experts` entries "STEP:ORDER" (every MoE block) or "STEP:BLOCK:ORDER"
    (block BLOCK, 0-based, as in the layer names) -> {step: {layer name: order}}. ORDER is the
    experts, rank by rank and slot by slot of the expert-parallel group: moe.num_experts +
    ep x parallel.expert_slots of them, every expert at least once, none twice on one rank (a
    permutation of 0 .. moe.num_experts - 1 without expert slots). Steps are 0-based steps of the run; at most one entry per block and
    step; needs parallel.ep > 1."""
    entries = cfg.parallel.replace_experts
    out: dict[int, dict[str, tuple[int, ...]]] = {}
    if not entries:
        return out
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(f"parallel.replace_experts = {entries!r}: use a list of \"STEP:ORDER\" or "
                          "\"STEP:BLOCK:ORDER\" strings")
    ep, m, steps = cfg.parallel.ep, cfg.model, cfg.train.steps
    if ep <= 1:
        raise ConfigError(f"parallel.replace_experts moves experts between expert-parallel ranks, and parallel.ep = "
                          f"{ep}: use parallel.ep > 1 or drop parallel.replace_experts")
    n = m.moe.num_experts
    for entry in entries:
        where = f"parallel.replace_experts entry {entry!r}"
        parts = entry.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"{where} must look like STEP:ORDER or STEP:BLOCK:ORDER, e.g. 2:1,0,3,2")
        try:
            step = int(parts[0])
            block = int(parts[1]) if len(parts) == 3 else None
            order = tuple(int(x) for x in parts[-1].split(","))
        except ValueError:
            raise ConfigError(f"{where}: STEP, BLOCK and the experts must be whole numbers") from None
        if not 0 <= step < steps:
            span = f"steps 0..{steps - 1}" if steps else "no steps"
            raise ConfigError(f"{where}: step {step} is not a step of the run ({span} with train.steps={steps})")
        if block is not None and not 0 <= block < m.n_layers:
            raise ConfigError(f"{where}: block {block} is not a block of the model (0..{m.n_layers - 1})")
        slots = n + ep * cfg.parallel.expert_slots
        if len(order) != slots:
            copies = f" and parallel.expert_slots = {cfg.parallel.expert_slots}" if cfg.parallel.expert_slots else ""
            raise ConfigError(f"{where}: {len(order)} experts listed; the ranks hold {slots} (moe.num_experts = {n}"
                              f"{copies})")
        try:
            check_order(order, n, ep)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        names = [f"block{block}"] if block is not None else [f"block{b}" for b in range(m.n_layers)]
        at = out.setdefault(step, {})
        if any(k in at for k in names):
            raise ConfigError(f"{where}: step {step} already re-places {'this block' if block is not None else 'a block'}; "
                              "give one entry per block and step")
        at.update(dict.fromkeys(names, order))
    return out


def check_expert_balance(cfg: Config) -> None:
    """`balance.experts` ("never" | "auto") and `balance.experts_every`."""
    b = cfg.balance
    if b.experts not in ("never", "auto"):
        raise ConfigError(f"balance.experts = {b.experts!r}: choose never or auto")
    if type(b.experts_every) is not int or b.experts_every < 1:
        raise ConfigError(f"balance.experts_every = {b.experts_every!r}: use a whole number of steps >= 1")
    if b.experts == "auto" and cfg.parallel.ep <= 1:
        raise ConfigError(f"balance.experts = \"auto\" places experts over expert-parallel ranks, and parallel.ep = "
                          f"{cfg.parallel.ep}: use parallel.ep > 1 or balance.experts = \"never\"")


def validate(cfg: Config, world: int) -> list[str]:
    """Raise ConfigError naming the problem and the fix. `world` = number of ranks.

    Resolves `checkpoint.resume = latest` to the newest checkpoint of the run folder that passes
    `check_checkpoint`, in place; returns the notes the user should see (one line each: the
    damaged checkpoints that were skipped)."""
    hf_config.apply(cfg)  # first: model.hf_path's config.json overwrites [model], which the checks below read
    check_hf_files(cfg)
    check_values(cfg)
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
    check_unit(cfg)
    check_shard(cfg)
    check_expert_parallel(cfg)
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
    if lay not in NAMED_LAYOUTS:
        explicit_layout(p.layout, cfg, stages, "parallel.layout")
    parse_relayouts(cfg, stages)
    parse_replacements(cfg)
    check_expert_balance(cfg)
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
        require("model.moe.aux_loss_coef", o.aux_loss_coef, ge=0, why="the weight of the load-balancing loss")
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
        require("model.mod.predictor_loss_coef", o.predictor_loss_coef, ge=0, why="the weight of the predictor's loss")
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
    # files and folders
    check_path("out", cfg.out, folder=True)
    if cfg.log.trace:
        check_path("log.trace", cfg.log.trace, folder=False)
    if cfg.data.cache_dir:
        check_path("data.cache_dir", cfg.data.cache_dir, folder=True)
    for path in cfg.data.paths:
        if not Path(path).exists():
            raise ConfigError(f"data path {path!r} does not exist (data.paths takes text files or folders)")
    if not cfg.data.paths:
        from dynmo.data import DataError, default_corpus_dir

        try:
            default_corpus_dir()
        except DataError as e:
            raise ConfigError(str(e)) from None
    if not cfg.checkpoint.resume:
        return []
    cfg.checkpoint.resume, note = rundir.resolve_resume(cfg.checkpoint.resume, cfg.out,
                                                        lambda path: check_checkpoint(cfg, path))
    return [note] if note else []


def check_hf_files(cfg: Config) -> None:
    """Every safetensors file of `model.hf_path` opens in safetensors itself, as a rank's loader
    opens it (memory-mapped, the header only): whatever `hf_config.read_header` let through and
    safetensors would refuse on every rank after launch is refused here, naming the file."""
    if not cfg.model.hf_path:
        return
    from safetensors import SafetensorError, safe_open

    for path in sorted(set(hf_config.weight_files(Path(cfg.model.hf_path)).values())):
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path} is not a file safetensors can open ({str(e).strip()}); "
                              f"{hf_config.COPY_AGAIN}") from None


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


def _fmt(x) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    return f"{x:g}" if isinstance(x, float) else str(x)


def require(where: str, value, *, ge=None, gt=None, le=None, lt=None, why: str = "") -> None:
    """Raise ConfigError unless `value` lies within the bounds (NaN never does)."""
    ok = ((ge is None or value >= ge) and (gt is None or value > gt)
          and (le is None or value <= le) and (lt is None or value < lt))
    if ok:
        return
    if (ge is not None or gt is not None) and (le is not None or lt is not None):
        lo = f"[{_fmt(ge)}" if ge is not None else f"({_fmt(gt)}"
        hi = f"{_fmt(le)}]" if le is not None else f"{_fmt(lt)})"
        rule = f"in {lo}, {hi}"
    else:
        rule = next(f"{op} {_fmt(b)}" for op, b in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if b is not None)
    raise ConfigError(f"{where}={_fmt(value)} must be {rule}" + (f" ({why})" if why else ""))


def check_values(cfg: Config) -> None:
    """Every float of the config is finite, and the numeric fields of `RANGES` are in range."""

    def finite(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            v, where = getattr(obj, f.name), prefix + f.name
            if dataclasses.is_dataclass(v):
                finite(v, where + ".")
                continue
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, float) and not math.isfinite(x):
                    shown = _fmt(x) if v is x else f"{v}: {_fmt(x)}"
                    raise ConfigError(f"{where}={shown} is not a finite number")

    finite(cfg, "")
    for where, bounds, why in RANGES:
        obj = cfg
        for part in where.split("."):
            obj = getattr(obj, part)
        require(where, obj, **bounds, why=why)
    t = cfg.train
    require("train.min_lr", t.min_lr, ge=0, le=t.lr, why="the learning rate the cosine decay ends at, at most train.lr")
    if cfg.parallel.backend not in BACKENDS:
        raise ConfigError(f"unknown parallel.backend {cfg.parallel.backend!r}; choose one of {', '.join(BACKENDS)}")


def check_path(where: str, path: str, folder: bool) -> None:
    """A path the run will create or write: a folder (`folder`) or a file whose folder may not exist
    yet. Refuse a folder that is an existing file, a file that is an existing folder, and a path
    under an existing file."""
    p = Path(path).expanduser()
    if p.exists():
        if folder and not p.is_dir():
            raise ConfigError(f"{where}={path!r} is an existing file, not a folder; give a folder path")
        if not folder and p.is_dir():
            raise ConfigError(f"{where}={path!r} is an existing folder, not a file; give a file path")
        return
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{where}={path!r}: {parent} is a file, so nothing can be created under it")
            return


def read_checkpoint_meta(path: str) -> dict:
    """The checkpoint folder's dynmo.json, checked to hold what a resume reads."""
    meta_path = Path(path) / "dynmo.json"
    if not meta_path.is_file():
        raise ConfigError(f"checkpoint.resume={path!r} is not a dynmo checkpoint (no dynmo.json inside)")
    damaged = "the checkpoint is incomplete or damaged; resume from another checkpoint"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON (JSONDecodeError is a ValueError)
        raise ConfigError(f"{meta_path} is not valid JSON ({e}); {damaged}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{meta_path} holds a JSON {type(meta).__name__}, not an object; {damaged}")
    missing = [k for k in CHECKPOINT_KEYS if k not in meta]
    if missing:
        raise ConfigError(f"{meta_path} lacks {', '.join(repr(k) for k in missing)}; {damaged}")
    for key, (ok, what) in CHECKPOINT_KEYS.items():
        if not ok(meta[key]):
            shown = repr(meta[key])
            raise ConfigError(f"{meta_path}: {key!r} should be {what}, got {shown[:60] + '...' if len(shown) > 60 else shown}"
                              f"; {damaged}")
    return meta


def _with_defaults(saved: dict, defaults: dict) -> dict:
    """`saved` over `defaults`, section by section: what an older checkpoint lacks takes the default."""
    out = dict(defaults)
    for k, v in saved.items():
        out[k] = _with_defaults(v, defaults[k]) if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
    return out


def model_signature(m: dict) -> dict[str, object]:
    """What decides the set and the shapes of a model's parameters and saved buffers, by field
    name, sizes that 0 derives resolved: `MODEL_SHAPE_FIELDS`, the family and block, the
    llama/mixtral attention and MLP sizes, the MoE expert count, the hash buckets (a buffer)."""
    sig: dict[str, object] = {"family": m["family"], "block": m["block"]}
    sig |= {k: m[k] for k in MODEL_SHAPE_FIELDS}
    if m["family"] != "gpt":  # the GPT's layers ignore these
        heads = m["n_heads"]
        sig["n_kv_heads"] = m["n_kv_heads"] or heads
        sig["head_dim"] = m["head_dim"] or (m["d_model"] // heads if heads else 0)
        sig["intermediate_size"] = m["intermediate_size"] or m["mlp_ratio"] * m["d_model"]
        sig["attention_bias"] = m["attention_bias"]
    if m["block"] == "moe":
        sig["moe.num_experts"] = m["moe"]["num_experts"]
    if m["block"] == "hashattn":
        sig["hashattn.n_buckets"] = m["hashattn"]["n_buckets"]
    return sig


def check_checkpoint(cfg: Config, path: str) -> dict:
    """A checkpoint the config can resume from: a complete dynmo.json, the same model (the
    same parameters with the same shapes, the same layer names), the same dynamic-model cases
    where they add or remove parameters or optimizer state, and a step within train.steps."""
    meta = read_checkpoint_meta(path)
    defaults = dataclasses.asdict(ModelConfig())
    try:
        saved = model_signature(_with_defaults(meta["model"], defaults))  # older checkpoints: defaults
    except (TypeError, KeyError, ValueError, ArithmeticError):
        raise ConfigError(f"{Path(path) / 'dynmo.json'}: its 'model' section is malformed; the checkpoint is "
                          "incomplete or damaged; resume from another checkpoint") from None
    now = model_signature(dataclasses.asdict(cfg.model))
    diffs = [f"model.{k}: checkpoint {_fmt(saved[k])} vs config {_fmt(now[k])}"
             for k in now if k in saved and saved[k] != now[k]]
    if diffs:
        raise ConfigError(
            "the checkpoint holds a model of a different shape: " + "; ".join(diffs) +
            ". Resume with the checkpoint's model settings (its config.toml is beside it)."
        )
    names, theirs = layer_names(cfg), meta["layer_names"]
    if theirs != names:
        i = next((i for i, (a, b) in enumerate(zip(theirs, names)) if a != b), min(len(theirs), len(names)))
        a = repr(theirs[i]) if i < len(theirs) else "nothing"
        b = repr(names[i]) if i < len(names) else "nothing"
        raise ConfigError(f"{Path(path) / 'dynmo.json'}: the checkpoint's layers are not the model's: layer {i} is {a} "
                          f"in the checkpoint and {b} in the model ({len(theirs)} vs {len(names)} layers)")
    check_checkpoint_cases(cfg, path, meta)
    check_checkpoint_grow(cfg, path, meta)
    check_checkpoint_placement(cfg, path, meta)
    step, steps = meta["step"], cfg.train.steps
    if step > steps:
        raise ConfigError(f"checkpoint {path} is at step {step}, past train.steps={steps}; raise --steps "
                          f"(train.steps) to {step} or more to train on from it")
    # DCP's own metadata, read without running code (a crafted file is refused here, before launch),
    # and the shard files it names, each long enough for the bytes it is said to hold
    from dynmo.runtime.safeload import CheckpointError, check_files

    try:
        check_files(path)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return meta


def check_checkpoint_placement(cfg: Config, path: str, meta: dict) -> None:
    """The experts' placements a checkpoint records (`expert_placement`: {block name: order},
    restored on resume under expert parallelism where they fit its ranks and slots) must hold
    every expert of the model and no other."""
    saved = meta.get("expert_placement") or {}
    n = cfg.model.moe.num_experts
    blocks = {f"block{b}" for b in range(cfg.model.n_layers)}
    ok = isinstance(saved, dict) and all(
        k in blocks and isinstance(v, list) and all(type(e) is int for e in v) and set(v) == set(range(n))
        for k, v in saved.items())
    if not ok:
        raise ConfigError(f"{Path(path) / 'dynmo.json'}: its 'expert_placement' record is not an order of the "
                          f"{n} experts per MoE block; the checkpoint is damaged")


def check_checkpoint_grow(cfg: Config, path: str, meta: dict) -> None:
    """A checkpoint saved for a grow (`dynmo.trainer`) records the layout the run resumes on and
    when the grow was decided and saved; a record that does not hold them is refused."""
    grow = meta.get("grow")
    if grow is None:
        return
    try:
        layout = Layout(tuple(int(b) for b in grow["layout"]))
        ok = (type(grow["step"]) is int and all(type(k) is int for k in grow["stages"]) and len(grow["stages"]) == 2
              and all(isinstance(grow[k], (int, float)) for k in ("decided_at", "saved_at")))
        if meta.get("unit", "block") == cfg.parallel.unit and layout.num_layers != num_layers(cfg):
            ok = False
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{Path(path) / 'dynmo.json'}: its 'grow' record (the layout to resume on after a grow) "
                          "is malformed; the checkpoint is damaged: resume from another checkpoint")


def check_checkpoint_cases(cfg: Config, path: str, meta: dict) -> None:
    """The cases that change the parameters (early exit adds classifiers, structured pruning
    narrows MLPs) or the optimizer state (freezing drops it) must be on to resume their state."""
    cases = meta.get("cases")
    if not isinstance(cases, dict):  # older checkpoints record no cases
        return
    if cfg.early_exit.enabled:
        if "early-exit" not in cases:  # the case's name (dynmo.dynamics.earlyexit.EarlyExit.name)
            raise ConfigError(f"checkpoint {path} was saved without early exit, so its blocks have no exit classifiers; "
                              "resume with early_exit.enabled = false, or start a new run")
        first = _saved_setting(path, "early_exit", "first_block")
        if isinstance(first, int) and cfg.early_exit.first_block < first:
            raise ConfigError(f"checkpoint {path} has exit classifiers from block {first} on; resume with "
                              f"early_exit.first_block >= {first} (got {cfg.early_exit.first_block})")
    freeze, prune = cases.get("freeze"), cases.get("prune")
    frozen = freeze.get("frozen") if isinstance(freeze, dict) else None
    if frozen and not cfg.freeze.enabled:
        names = layer_names(cfg)
        shown = ", ".join(names[i] if type(i) is int and 0 <= i < len(names) else str(i) for i in frozen)
        raise ConfigError(f"checkpoint {path} has frozen layers ({shown}), saved without optimizer state; "
                          "resume with freeze.enabled = true")
    hidden = prune.get("hidden") if isinstance(prune, dict) else None
    if hidden and not cfg.prune.enabled:
        raise ConfigError(f"checkpoint {path} holds structurally pruned blocks (narrower MLPs); resume with "
                          "prune.enabled = true and prune.structured = true")


def _saved_setting(path: str, section: str, name: str):
    """A setting of the config.toml saved beside a checkpoint, or None if it is not there."""
    try:
        return tomllib.loads((Path(path) / "config.toml").read_text()).get(section, {}).get(name)
    except (OSError, ValueError, AttributeError):
        return None
