"""The model families and their block variants, by name: what `model.family` and `model.block`
may say. No torch, so the launcher checks a config without importing it;
`dynmo.model.layers.FAMILIES` maps the same names to the classes."""

from __future__ import annotations

FAMILY_BLOCKS: dict[str, tuple[str, ...]] = {
    "gpt": ("dense", "moe", "hashattn", "mod"),
    "llama": ("dense", "mod", "hashattn"),
    "mixtral": ("moe",),
}


def check_block(family: str, block: str) -> None:
    """Raise ValueError unless `family` exists and has the block variant `block`."""
    if family not in FAMILY_BLOCKS:
        raise ValueError(f"unknown model.family {family!r}; known: {', '.join(FAMILY_BLOCKS)}")
    if block not in FAMILY_BLOCKS[family]:
        raise ValueError(f"model.block {block!r} is not a block of model.family {family!r}; "
                         f"its blocks: {', '.join(FAMILY_BLOCKS[family])}")
