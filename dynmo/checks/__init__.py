"""Validate a configuration before any process starts work: clear errors, never a hang.

Import-light (no torch): the launcher calls it before spawning torchrun, and every rank calls
it again at start-up. `validate` runs the checks in order, each part in its own module:

    dynmo.checks.values      every float finite, the numeric fields in range (`RANGES`, `require`)
    dynmo.checks.parallel    schedule, pp x dp, units, sharding, expert parallelism, batch split
    dynmo.checks.model       the model's shape, family and block options, the dynamic-model cases
    dynmo.checks.balance     layouts, relayouts, expert placements, the `[balance]` knobs
    dynmo.checks.data        Hugging Face weights, the run folder, the trace, the text, and the
                             checkpoint `checkpoint.resume` names

and, once the config is valid, `dynmo.checks.memory.check_memory` (the launcher's pre-flight):
the fullest rank's estimate (`dynmo.checks.footprint`, the balancer's memory model from the
config) against what the machine has (`dynmo.machine`).

Their names stay importable from here.
"""

from __future__ import annotations

from dynmo import hf_config, rundir
from dynmo.checks.balance import check_balancing, check_expert_balance, check_layouts, parse_replacements
from dynmo.checks.data import (CHECKPOINT_KEYS, MODEL_SHAPE_FIELDS, check_checkpoint, check_checkpoint_cases,
                               check_checkpoint_grow, check_checkpoint_placement, check_files, check_hf_files,
                               check_path, model_signature, read_checkpoint_meta)
from dynmo.checks.model import (check_block_options, check_cases, check_compile, check_device_kernels, check_family,
                                check_model)
from dynmo.checks.parallel import (SHARDS, check_batch, check_expert_parallel, check_pipeline, check_shard,
                                   check_unit)
from dynmo.checks.values import BACKENDS, RANGES, check_values, require
from dynmo.config import Config
from dynmo.plan import recompute_blocks

__all__ = [
    "BACKENDS", "CHECKPOINT_KEYS", "MODEL_SHAPE_FIELDS", "RANGES", "SHARDS", "check_balancing", "check_batch",
    "check_block_options", "check_cases", "check_compile", "check_device_kernels", "check_checkpoint", "check_checkpoint_cases", "check_checkpoint_grow",
    "check_checkpoint_placement", "check_expert_balance", "check_expert_parallel", "check_family", "check_files",
    "check_hf_files", "check_layouts", "check_model", "check_path", "check_pipeline", "check_shard", "check_unit",
    "check_values", "model_signature", "parse_replacements", "read_checkpoint_meta", "require", "validate",
]


def validate(cfg: Config, world: int) -> list[str]:
    """Raise ConfigError naming the problem and the fix. `world` = number of ranks.

    Resolves `checkpoint.resume = latest` to the newest checkpoint of the run folder that passes
    `check_checkpoint`, in place; returns the notes the user should see (one line each: the
    damaged checkpoints that were skipped)."""
    hf_config.apply(cfg)  # first: model.hf_path's config.json overwrites [model], which the checks below read
    check_hf_files(cfg)
    check_values(cfg)
    schedule, pp, v = check_pipeline(cfg, world)
    check_unit(cfg)
    check_shard(cfg)
    check_expert_parallel(cfg)
    stages = pp * v
    check_model(cfg, stages)
    check_batch(cfg, schedule, pp)
    recompute_blocks(cfg)
    check_layouts(cfg, stages)
    check_balancing(cfg, schedule, pp, v)
    check_block_options(cfg.model)
    check_device_kernels(cfg)
    check_compile(cfg)
    check_cases(cfg, pp)
    check_files(cfg)
    if not cfg.checkpoint.resume:
        return []
    cfg.checkpoint.resume, note = rundir.resolve_resume(cfg.checkpoint.resume, cfg.out,
                                                        lambda path: check_checkpoint(cfg, path))
    return [note] if note else []
