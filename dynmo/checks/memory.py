"""Pre-flight: a run whose ranks cannot hold what the config asks is refused before it starts.

The estimate is `dynmo.checks.footprint` (the balancer's memory model with figures from the config);
what a rank has is read by `dynmo.machine`: on CUDA (`parallel.backend` nccl, or auto with
GPUs listed by the driver) the free memory of the least free of the local devices the ranks
use; on CPU the available RAM divided among this machine's ranks. `train.preflight = false`
skips it. The same comparison covers each forced re-layout (`parallel.relayout`) and the
balancer's cap (`balance.memory_gb`), which must not promise a rank more than it has.
"""

from __future__ import annotations

from dynmo import machine
from dynmo.checks import footprint
from dynmo.config import Config, ConfigError
from dynmo.checks.footprint import RankMemory, gb
from dynmo.loop import bytes_per_param
from dynmo.plan import num_layers, parse_relayouts, resolve_pp

SKIP = "--train.preflight false"


def rank_limit(cfg: Config, nproc: int) -> tuple[int, str] | None:
    """(bytes one rank may use, how that was found), None when this machine cannot say."""
    try:
        gpus = machine.gpu_free() if cfg.parallel.backend != "gloo" else None
        if gpus is not None or cfg.parallel.backend == "nccl":
            if gpus is None or len(gpus) < nproc:
                return None  # the runtime reports a missing device itself
            used = gpus[:nproc]
            low = min(range(nproc), key=used.__getitem__)
            return used[low], f"GPU {low} has {gb(used[low])} free" + (f" (the least of {nproc})" if nproc > 1 else "")
        avail = machine.memory_available()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if avail is None:
        return None
    if nproc == 1:
        return avail, f"the machine has {gb(avail)} of RAM available"
    return avail // nproc, f"a rank has {gb(avail // nproc)} ({gb(avail)} of RAM available over {nproc} ranks)"


def _ways_out(cfg: Config, est: RankMemory, limit: int, world: int) -> list[str]:
    """The changes that would lower the fullest rank's estimate, those that apply."""
    p, t = cfg.parallel, cfg.train
    out = []
    biggest = max(n for n, _ in footprint.unit_params(cfg)) * bytes_per_param(p.shard, p.dp)
    if biggest < limit and resolve_pp(cfg, world) < num_layers(cfg):
        out.append("more ranks (--nproc)")
    if p.shard != "full":
        out.append("--parallel.shard full with --parallel.dp 2 or more" if p.dp < 2 else "--parallel.shard full")
    if est.activations > 0.1 * est.total:
        if t.activation_checkpointing.strip().lower() != "all":
            out.append("--train.activation_checkpointing all")
        if t.global_batch // max(1, p.dp) // max(1, t.microbatches) > 1:
            out.append("a smaller microbatch (more --train.microbatches)")
    return out


def _refusal(what: str, est: RankMemory, have: str, ways: list[str]) -> str:
    fix = f"; try {', '.join(ways)}" if ways else ""
    return (f"{what} needs about {gb(est.total)} on pipeline rank {est.rank} ({gb(est.state)} of weights, gradients "
            f"and optimizer state for {est.params:,} parameters, {gb(est.activations)} of activations) but "
            f"{have}{fix}; or skip this check with {SKIP}")


def check_memory(cfg: Config, world: int, nproc: int) -> None:
    """Raise ConfigError (one line) when a rank's estimate exceeds what it has. Run after `validate`."""
    if not cfg.train.preflight:
        return
    found = rank_limit(cfg, nproc)
    if found is None:
        return
    limit, have = found
    est = footprint.rank_memory(cfg, world)
    if est.total > limit:
        raise ConfigError(_refusal(f"this run on {world} ranks", est, have, _ways_out(cfg, est, limit, world)))
    cap = cfg.balance.memory_gb * footprint.GiB
    if cfg.balance.when != "never" and cap > limit:
        raise ConfigError(f"balance.memory_gb = {cfg.balance.memory_gb:g} lets the balancer fill a rank to "
                          f"{gb(cap)} but {have}: set balance.memory_gb to {limit / footprint.GiB:.2f} or less "
                          f"(or 0 for no cap); or skip this check with {SKIP}")
    stages = resolve_pp(cfg, world) * cfg.parallel.virtual_stages
    for step, layout in parse_relayouts(cfg, stages).items():
        moved = footprint.layout_memory(cfg, world, list(layout.boundaries))
        if moved.total > limit:
            raise ConfigError(_refusal(f"parallel.relayout at step {step} ({layout.format()})", moved, have,
                                       ["another layout"]))
