"""The parallel settings of a configuration: the schedule, the pipeline and data-parallel ranks
it spreads over, the units it places, what the replicas shard, expert parallelism, and how the
batch splits over replicas and microbatches.

Part of `dynmo.checks` (validation before any process starts); import-light, no torch.
"""

from __future__ import annotations

from dynmo.config import Config, ConfigError
from dynmo.plan import DTYPES, UNITS, resolve_pp
from dynmo.schedules import TRAINABLE, Schedule, ScheduleError, get_schedule


def check_pipeline(cfg: Config, world: int) -> tuple[Schedule, int, int]:
    """A trainable schedule, pp x dp = `world` ranks, the stages per rank it runs: (schedule, pp,
    virtual stages per rank)."""
    p = cfg.parallel
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
    return schedule, pp, v


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


def check_batch(cfg: Config, schedule: Schedule, pp: int) -> None:
    """The global batch splits evenly over the data-parallel replicas and their microbatches (and
    the rounds of a looped multi-stage schedule over `pp` ranks); the dtype exists."""
    t, p, sched = cfg.train, cfg.parallel, schedule.name
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
