"""What a migration costs: seconds = fixed + bytes moved / bandwidth, refitted from every migration measured."""

from __future__ import annotations

from dynmo.layout import Layout

# The prior, before the first migration is measured
MIGRATION_FIXED_S = 0.01  # ~10 ms seen here
MIGRATION_BANDWIDTH = 1e9  # bytes/s


def migration_cost(fixed_s: float, bandwidth: float, layer_bytes: list[int], current: Layout, new: Layout) -> float:
    """Predicted seconds to move from `current` to `new`: nothing if no layer moves."""
    moved = current.moves_to(new)
    return fixed_s + sum(layer_bytes[m.layer] for m in moved) / bandwidth if moved else 0.0


def refit(fixed_s: float, bandwidth: float, nbytes: int, seconds: float) -> tuple[float, float]:
    """(fixed_s, bandwidth) after a measured migration: keep the fixed part, fit the bandwidth to
    what was seen; a migration faster than the fixed part lowers it."""
    if nbytes > 0 and seconds > fixed_s:
        return fixed_s, nbytes / (seconds - fixed_s)
    if seconds > 0:
        return seconds, bandwidth
    return fixed_s, bandwidth
