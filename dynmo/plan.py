"""What a config asks of the pipeline, parsed: ranks, the initial layout, forced re-layouts. Pure.

The checks (`dynmo.checks`) call these to reject a bad config before any process starts; the
trainer calls them to get the values.
"""

from __future__ import annotations

from dynmo.balance import Problem, balance
from dynmo.config import Config, ConfigError
from dynmo.flops import unit_macs
from dynmo.layout import Layout, LayoutError


UNITS = ("block", "sublayer")
# parallel.layout's named layouts (anything else is an explicit layout)
NAMED_LAYOUTS = ("uniform", "params", "flops")


def num_layers(cfg: Config) -> int:
    """Units the pipeline places ("layers" in layouts): the embedding, the blocks (each two
    units, its attention and MLP halves, with `parallel.unit = "sublayer"`), the head."""
    return cfg.model.n_layers * (2 if cfg.parallel.unit == "sublayer" else 1) + 2


def layer_names(cfg: Config) -> list[str]:
    """The layers' names in model order (checkpoint key prefixes): embed, block0, ..., head.
    The same names as `dynmo.model.layers.LayerSpec.name`, without importing torch."""
    return ["embed", *(f"block{b}" for b in range(cfg.model.n_layers)), "head"]


def resolve_pp(cfg: Config, world: int) -> int:
    """Pipeline ranks: `parallel.pp`, or the world size over the data-parallel replicas."""
    p = cfg.parallel
    if p.dp < 1:
        raise ConfigError(f"parallel.dp must be >= 1, got {p.dp}")
    if p.pp:
        return p.pp
    if world % p.dp:
        raise ConfigError(f"{world} ranks cannot be split into parallel.dp={p.dp} replicas")
    return world // p.dp


def explicit_layout(text: str, cfg: Config, num_stages: int, where: str) -> Layout:
    try:
        layout = Layout.parse(text, num_layers(cfg))
    except LayoutError as e:
        raise ConfigError(f"{where}: {e}") from None
    if layout.num_stages != num_stages:
        raise ConfigError(
            f"{where}: layout {layout} has {layout.num_stages} stages but the pipeline has {num_stages}"
        )
    return layout


def layer_flops(cfg: Config) -> list[float]:
    """Each unit's nominal multiply-adds per token (`dynmo.flops.unit_macs`), in layout order."""
    return unit_macs(cfg.model, sublayer=cfg.parallel.unit == "sublayer")


def named_layout(name: str, units: int, num_stages: int, layer_params: list[int] | None = None,
                 flops: list[float] | None = None) -> Layout:
    """A named layout of `units` layers: uniform (Megatron: equal layer counts), params
    (DeepSpeed's partition of `layer_params`) or flops (the min-max partition of the layers'
    nominal multiply-adds `flops`, the optimal balancer)."""
    if name == "uniform":
        return Layout.uniform(units, num_stages)
    costs, how = (layer_params, "deepspeed") if name == "params" else (flops, "optimal")
    if name not in NAMED_LAYOUTS[1:] or costs is None:
        raise ValueError(f"layout {name!r} needs {'the layers parameter counts' if name == 'params' else 'their FLOPs'}")
    return Layout(tuple(balance(Problem(costs=[float(c) for c in costs], stages=num_stages), how).boundaries))


def initial_layout(cfg: Config, num_stages: int, layer_params: list[int] | None = None) -> Layout:
    """`parallel.layout`: uniform (Megatron), params (DeepSpeed's partition of `layer_params`),
    flops (the partition of the layers' nominal FLOPs, `dynmo.flops`) or explicit boundaries /
    sizes."""
    spec = cfg.parallel.layout.strip().lower()
    if spec in NAMED_LAYOUTS:
        return named_layout(spec, num_layers(cfg), num_stages, layer_params, layer_flops(cfg))
    return explicit_layout(cfg.parallel.layout, cfg, num_stages, "parallel.layout")


def first_layout(cfg: Config, num_stages: int, layer_params: list[int], saved_costs: list[float] | None = None,
                 saved_layout: list[int] | None = None, grown: list[int] | None = None) -> tuple[Layout, bool]:
    """The layout a run starts on, and whether it was re-balanced: `parallel.layout`, except

    - when resuming from the checkpoint of a grow (`grown`: the layout the grow decided, which
      the run was restarted to train on) whose layout has this world's stage count: that one;
    - when resuming on a different number of stages than the checkpoint was saved with (an
      elastic restart on fewer workers) and the layout is not explicit. Then the balancer lays
      the layers out on the costs measured before the save."""
    if grown is not None and len(grown) - 1 == num_stages and cfg.parallel.virtual_stages == 1:
        return Layout(tuple(grown)), False
    explicit = cfg.parallel.layout.strip().lower() not in NAMED_LAYOUTS
    if (not saved_costs or not saved_layout or len(saved_layout) - 1 == num_stages or explicit
            or cfg.parallel.virtual_stages != 1):
        return initial_layout(cfg, num_stages, layer_params), False
    return Layout(tuple(balance(Problem(costs=saved_costs, stages=num_stages), cfg.balance.balancer).boundaries)), True


def parse_relayouts(cfg: Config, num_stages: int) -> dict[int, Layout]:
    """`parallel.relayout` entries "STEP:LAYOUT" -> {step: layout}, for a pipeline launched with
    `num_stages` stages. A layout with fewer stages than the pipeline has at that point is a
    re-pack, and later entries apply to the shrunk pipeline; one with more stages is a grow
    (a checkpoint and a restart on the whole world, `dynmo.trainer`), up to the `num_stages`
    the job was launched with. Steps are 0-based, at most one entry per step, each before a
    step the run trains (0 .. train.steps - 1)."""
    launched = num_stages
    out: dict[int, Layout] = {}
    steps = cfg.train.steps
    for entry in cfg.parallel.relayout:
        if ":" not in entry:
            raise ConfigError(f"parallel.relayout entry {entry!r} must look like STEP:LAYOUT, e.g. 5:0,3,6,10")
        step_s, lay = entry.split(":", 1)
        try:
            step = int(step_s)
        except ValueError:
            raise ConfigError(f"parallel.relayout entry {entry!r}: step {step_s!r} is not an integer") from None
        where = f"parallel.relayout entry {entry!r}"
        if step in out:
            raise ConfigError(f"{where}: step {step} already has a re-layout; give one entry per step")
        if not 0 <= step < steps:
            span = f"steps 0..{steps - 1}" if steps else "no steps"
            raise ConfigError(f"{where}: step {step} is not a step of the run ({span} with train.steps={steps}), "
                              "so it would never apply")
        try:
            layout = Layout.parse(lay, num_layers(cfg))
        except LayoutError as e:
            raise ConfigError(f"{where}: {e}") from None
        if layout.num_stages > launched:
            raise ConfigError(f"{where}: layout {layout} has {layout.num_stages} stages; the pipeline cannot grow "
                              f"beyond the {launched} it is launched with (launch more ranks, or use fewer stages)")
        if layout.num_stages != num_stages:
            if cfg.parallel.virtual_stages != 1:
                raise ConfigError(f"{where}: re-packing onto fewer stages needs one stage per rank "
                                  f"(schedule gpipe or 1f1b), not {cfg.parallel.schedule}")
            num_stages = layout.num_stages
        out[step] = layout
    if list(out) != sorted(out):
        raise ConfigError("parallel.relayout entries must be in step order")
    return out


DTYPES = ("fp32", "bf16")


def recompute_blocks(cfg: Config) -> list[int]:
    """Block numbers (0-based, as in the layer names) whose activations are recomputed in backward,
    from `train.activation_checkpointing`: none | all | numbers and ranges such as "1-4,7"."""
    text, n = cfg.train.activation_checkpointing.strip().lower(), cfg.model.n_layers
    where = f"train.activation_checkpointing={cfg.train.activation_checkpointing!r}"
    if text in ("", "none"):
        return []
    if text == "all":
        return list(range(n))
    blocks: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError(f"{where}: {part.strip()!r} is not a block number or a range like 1-4; "
                              "write none, all, or block numbers such as 1-4,7") from None
        if not 0 <= a <= b < n:
            raise ConfigError(f"{where}: {part.strip()!r} is outside blocks 0..{n - 1} (or a range written high-low)")
        blocks.update(range(a, b + 1))
    return sorted(blocks)
