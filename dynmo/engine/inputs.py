"""What the engine takes: per-stage op times (`StageTimes`), checked as they are built
(`SimInputError`), and the ring collectives' times of data parallelism. Pure (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class SimInputError(ValueError):
    """Stage times that do not fit the schedule (wrong lengths, negative times...)."""


@dataclass(frozen=True)
class StageTimes:
    """Per-stage, per-microbatch op times in seconds, as arrays of shape (stages, microbatches).

    `bwd` is the full backward (input + weight gradient). `wgrad` is the part of `bwd` that
    is the weight gradient; zero-bubble schedules run it as a separate W op and the input
    gradient I takes `bwd - wgrad`. `comm_fwd[s]` / `comm_bwd[s]` is the transfer time of
    an activation s -> s+1 / a gradient s+1 -> s (length stages-1). `allreduce[s]` is the
    time of stage s's gradient all-reduce across data-parallel replicas; `allgather[s]` (None:
    none) the time of its parameter all-gather after the optimizer step, when the optimizer
    state is sharded over the replicas.
    """

    fwd: np.ndarray
    bwd: np.ndarray
    wgrad: np.ndarray
    comm_fwd: np.ndarray
    comm_bwd: np.ndarray
    allreduce: np.ndarray
    allgather: np.ndarray | None = None

    @property
    def num_stages(self) -> int:
        return self.fwd.shape[0]

    @property
    def microbatches(self) -> int:
        return self.fwd.shape[1]

    @classmethod
    def build(
        cls,
        fwd,
        bwd,
        microbatches: int | None = None,
        *,
        wgrad=None,
        comm=0.0,
        allreduce=0.0,
        link_delay=None,
        allgather=None,
    ) -> "StageTimes":
        """Normalize user input.

        fwd, bwd, wgrad: one number per stage, or one list per stage with a time per
        microbatch. wgrad defaults to half of bwd (the zero-bubble paper's rough split);
        it only matters for the zero-bubble schedules. comm: a number for every link, a
        list of stages-1 link times, or {"fwd": ..., "bwd": ...} with either of those.
        allreduce: a number or one per stage. link_delay: extra seconds added to every
        transfer on a link, activation and gradient alike (a delay injected on the network
        between stage j and j+1): a number for every link or a list of stages-1; None or 0
        leaves the transfer times exactly as `comm` gives them. allgather: None, a number or
        one per stage: the sharded optimizer's parameter all-gather after the step.
        """
        f = _per_stage_mb(fwd, "fwd", None, microbatches)
        s, m = f.shape
        b = _per_stage_mb(bwd, "bwd", s, m)
        w = 0.5 * b if wgrad is None else _per_stage_mb(wgrad, "wgrad", s, m)
        if np.any(w > b + 1e-12 * np.maximum(1.0, np.abs(b))):
            raise SimInputError("wgrad is the weight-gradient part of bwd, so it must be <= bwd")
        w = np.minimum(w, b)
        if isinstance(comm, dict):
            unknown = set(comm) - {"fwd", "bwd"}
            if unknown:
                raise SimInputError(f"comm accepts keys 'fwd' and 'bwd', got {sorted(unknown)}")
            cf = _per_link(comm.get("fwd", 0.0), "comm.fwd", s)
            cb = _per_link(comm.get("bwd", 0.0), "comm.bwd", s)
        else:
            cf = cb = _per_link(comm, "comm", s)
        if link_delay is not None:
            d = _per_link(link_delay, "link_delay", s)
            if np.any(d > 0):
                cf, cb = cf + d, cb + d
        ar = _per_stage(allreduce, "allreduce", s)
        ag = None if allgather is None else _per_stage(allgather, "allgather", s)
        return cls(f, b, w, cf, cb, ar, ag)

    def balanced(self) -> "StageTimes":
        """Every stage gets the mean stage's times (per microbatch); links stay as they are."""
        s = self.num_stages

        def mean(a: np.ndarray) -> np.ndarray:
            return np.repeat(a.mean(axis=0, keepdims=True), s, axis=0)

        return StageTimes(
            mean(self.fwd), mean(self.bwd), mean(self.wgrad),
            self.comm_fwd, self.comm_bwd, np.full(s, self.allreduce.mean()),
            None if self.allgather is None else np.full(s, self.allgather.mean()),
        )


def _check_times(a: np.ndarray, name: str) -> np.ndarray:
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise SimInputError(f"{name} times must be finite and >= 0")
    return a


def _per_stage_mb(x, name: str, stages: int | None, microbatches: int | None) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=float)
    except (TypeError, ValueError):
        raise SimInputError(
            f"{name} must be a list with one number per stage, or one list of per-microbatch "
            "times per stage (all the same length)"
        ) from None
    if a.ndim == 1:
        if microbatches is None:
            raise SimInputError(
                f"{name} gives one time per stage, so the number of microbatches must be given"
            )
        a = np.repeat(a[:, None], int(microbatches), axis=1)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise SimInputError(f"{name} must be non-empty: one entry per stage")
    if stages is not None and a.shape[0] != stages:
        raise SimInputError(f"{name} has {a.shape[0]} stages but fwd has {stages}")
    if microbatches is not None and a.shape[1] != int(microbatches):
        raise SimInputError(
            f"{name} has {a.shape[1]} per-microbatch times per stage but microbatches={microbatches}"
        )
    return _check_times(a, name)


def _per_link(x, name: str, stages: int) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim == 0:
        a = np.full(max(stages - 1, 0), float(a))
    if a.shape != (max(stages - 1, 0),):
        raise SimInputError(f"{name} needs one time per link between stages: {stages - 1} values")
    return _check_times(a, name)


def _per_stage(x, name: str, stages: int) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim == 0:
        a = np.full(stages, float(a))
    if a.shape != (stages,):
        raise SimInputError(f"{name} needs one value per stage: {stages} values")
    return _check_times(a, name)


def ring_allreduce_time(grad_bytes, dp: int, bandwidth: float, latency: float = 0.0) -> np.ndarray:
    """Ring all-reduce cost per stage: 2 (D-1)/D * bytes / bandwidth + latency; 0 when D = 1."""
    b = np.asarray(grad_bytes, dtype=float)
    if dp <= 1:
        return np.zeros_like(b)
    if bandwidth <= 0:
        raise SimInputError("bandwidth must be > 0 bytes/s")
    return 2.0 * (dp - 1) / dp * b / float(bandwidth) + float(latency)


def ring_allgather_time(param_bytes, dp: int, bandwidth: float, latency: float = 0.0) -> np.ndarray:
    """Ring all-gather cost per stage: (D-1)/D * bytes / bandwidth + latency, where bytes are
    the whole parameters each replica ends up with; 0 when D = 1."""
    b = np.asarray(param_bytes, dtype=float)
    if dp <= 1:
        return np.zeros_like(b)
    if bandwidth <= 0:
        raise SimInputError("bandwidth must be > 0 bytes/s")
    return (dp - 1) / dp * b / float(bandwidth) + float(latency)
