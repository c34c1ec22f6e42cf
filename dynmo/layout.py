"""Layouts: contiguous ranges of layers, one range per pipeline stage.

Pure Python (no torch): shared by the balancers, the simulator and the runtime.

A layout over `n` layers and `p` stages is written by its boundaries
`[0, b1, ..., b_{p-1}, n]`: stage j holds layers `range(b[j], b[j+1])`.
Every stage must be non-empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


class LayoutError(ValueError):
    """A layout that is not a valid contiguous partition."""


@dataclass(frozen=True)
class Move:
    """Layer `layer` moves from stage `src` to stage `dst`."""

    layer: int
    src: int
    dst: int

    def as_dict(self) -> dict:
        return {"layer": self.layer, "from": self.src, "to": self.dst}


@dataclass(frozen=True)
class Layout:
    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        b = tuple(int(x) for x in self.boundaries)
        object.__setattr__(self, "boundaries", b)
        if len(b) < 2:
            raise LayoutError(f"a layout needs at least one stage, got boundaries {list(b)}")
        if b[0] != 0:
            raise LayoutError(f"layout boundaries must start at 0, got {list(b)}")
        for j in range(len(b) - 1):
            if b[j + 1] <= b[j]:
                raise LayoutError(
                    f"stage {j} of layout {list(b)} is empty or reversed; "
                    "boundaries must be strictly increasing (every stage holds >= 1 layer)"
                )

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def from_sizes(cls, sizes: Iterable[int]) -> "Layout":
        b = [0]
        for s in sizes:
            b.append(b[-1] + int(s))
        return cls(tuple(b))

    @classmethod
    def uniform(cls, num_layers: int, num_stages: int) -> "Layout":
        """Equal layers per stage; the first `num_layers % num_stages` stages get one more."""
        check_shape(num_layers, num_stages)
        q, r = divmod(num_layers, num_stages)
        return cls.from_sizes(q + (1 if j < r else 0) for j in range(num_stages))

    @classmethod
    def parse(cls, text: str, num_layers: int | None = None) -> "Layout":
        """Parse `"0,4,8,11"`, `"[0, 4, 8, 11]"` (boundaries) or `"4+4+3"` (stage sizes)."""
        t = text.strip().strip("[]").replace(" ", "")
        try:
            if "+" in t:
                layout = cls.from_sizes(int(x) for x in t.split("+"))
            else:
                layout = cls(tuple(int(x) for x in t.split(",") if x != ""))
        except ValueError as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(
                f"cannot parse layout {text!r}: give boundaries like 0,4,8,11 or sizes like 4+4+3"
            ) from None
        if num_layers is not None and layout.num_layers != num_layers:
            raise LayoutError(
                f"layout {text!r} covers {layout.num_layers} layers but the model has "
                f"{num_layers}; the last boundary must equal the number of layers"
            )
        return layout

    # ---- queries ------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        return self.boundaries[-1]

    @property
    def sizes(self) -> list[int]:
        b = self.boundaries
        return [b[j + 1] - b[j] for j in range(self.num_stages)]

    def layers(self, stage: int) -> range:
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_of(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        # boundaries are short (one per stage); bisect keeps it O(log p)
        import bisect

        return bisect.bisect_right(self.boundaries, layer) - 1

    def owner(self) -> list[int]:
        """Stage of every layer, as a list indexed by layer."""
        out: list[int] = []
        for j, s in enumerate(self.sizes):
            out.extend([j] * s)
        return out

    def stage_loads(self, costs: Sequence[float], speeds: Sequence[float] | None = None) -> list[float]:
        if len(costs) != self.num_layers:
            raise LayoutError(f"{len(costs)} costs for a layout of {self.num_layers} layers")
        loads = [float(sum(costs[i] for i in self.layers(j))) for j in range(self.num_stages)]
        if speeds is not None:
            loads = [l / float(s) for l, s in zip(loads, speeds)]
        return loads

    def moves_to(self, other: "Layout") -> list[Move]:
        """The layers whose stage differs between `self` and `other` (same layers)."""
        if other.num_layers != self.num_layers:
            raise LayoutError(
                f"cannot move between layouts of {self.num_layers} and {other.num_layers} layers"
            )
        a, b = self.owner(), other.owner()
        return [Move(i, a[i], b[i]) for i in range(self.num_layers) if a[i] != b[i]]

    def format(self, kinds: Sequence[str] | None = None) -> str:
        """`E t t | t t L` given per-layer kind letters, else `[0, 3, 6]`."""
        if kinds is None:
            return str(list(self.boundaries))
        return " | ".join(" ".join(kinds[i] for i in self.layers(j)) for j in range(self.num_stages))

    def __str__(self) -> str:
        return self.format()


def check_shape(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise LayoutError(f"need at least 1 stage, got {num_stages}")
    if num_layers < num_stages:
        raise LayoutError(
            f"cannot split {num_layers} layers into {num_stages} non-empty stages; "
            "use fewer stages or a deeper model"
        )


def imbalance(loads: Sequence[float]) -> float:
    """(max - min) / mean of stage loads: the paper's imbalance ΔL. 0 for one stage."""
    if not loads:
        return 0.0
    mean = sum(loads) / len(loads)
    return 0.0 if mean <= 0 else (max(loads) - min(loads)) / mean
