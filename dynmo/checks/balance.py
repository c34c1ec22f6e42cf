"""The balancing settings of a configuration: the layer layouts it starts on and switches to, the
expert placements it sets and lets the trainer choose, and the DynMo loop's `[balance]` knobs.

Part of `dynmo.checks` (validation before any process starts); import-light, no torch.
"""

from __future__ import annotations

from dynmo.balance.experts import check_order
from dynmo.config import Config, ConfigError
from dynmo.loop import check_balance
from dynmo.plan import NAMED_LAYOUTS, explicit_layout, parse_relayouts
from dynmo.schedules import Schedule


def check_layouts(cfg: Config, stages: int) -> None:
    """`parallel.layout` and `parallel.relayouts` over `stages` pipeline stages; `parallel.replace_experts`;
    `balance.experts`."""
    p = cfg.parallel
    lay = p.layout.strip().lower()
    if lay not in NAMED_LAYOUTS:
        explicit_layout(p.layout, cfg, stages, "parallel.layout")
    parse_relayouts(cfg, stages)
    parse_replacements(cfg)
    check_expert_balance(cfg)


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


def check_balancing(cfg: Config, schedule: Schedule, pp: int, v: int) -> None:
    """The DynMo loop's `[balance]` settings for this run: `schedule` over `pp` ranks, `v` stages per rank."""
    sched = schedule.name
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
