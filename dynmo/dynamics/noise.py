"""Seeded timing noise: what a loaded machine does to a run, reproducibly (`[noise]`, configs/noisy.toml).

The controller (`balance.when = auto`) must not migrate layers because of timing noise, and a
test of that should not depend on how busy the machine running it is. This case makes the
noise itself part of the config: every layer this rank holds (embedding, blocks, head) gets a
forward pre-hook and a forward hook. On a training forward the hook measures the layer's
forward wall time t, draws an extra factor e >= 0 and then does e * 3 * t seconds of real work
(a layer's backward costs about twice its forward, so the extra stands for the whole layer).
The output is returned unchanged, so the losses are bitwise those of the run without noise;
only the time moves, and the profiler books it to the layer's forward.

The factor is a product of three slowdowns, each drawn from `noise.seed` (`Draws`):

    jitter      per layer per microbatch, 1 + U(0, 2 * jitter): the layer's own noise;
    straggler   per process per microbatch, with probability straggler_prob: straggler_factor
                for every layer of that process (a preempted process, a GC pause);
    slow phase  from step 0 every slow_every steps, for slow_steps steps: slow_factor for every
                layer on pipeline rank slow_rank (a neighbour process sharing its cores).

A draw depends only on (seed, step, microbatch, and the global layer index or the process), so
a run is reproducible and a layer's jitter is the same whichever rank holds it; stragglers and
the slow phase belong to a process by nature. The microbatch is the layer's count of training
forwards since the step began. Stragglers are drawn per process (the global rank), so
data-parallel replicas of a pipeline rank straggle independently.

The work is a busy loop of small tensor products until the deadline, never a sleep: a loaded
machine's cores are busy, not idle, and the run must feel that. On CUDA it is
`torch.cuda._sleep` (the GPU spins a number of clock cycles), calibrated once per process
against CUDA events, and t is measured between two device synchronizations; that path cannot
be tested on a CPU machine.

A checkpointed block's recomputation (inside its backward, with step statistics paused) is
neither counted as a microbatch nor slowed again. Evaluation and probe forwards (no grad) are
left alone. Noise is not a model change: the case emits no events.

Injected link delay (`link_delay_ms`, `link_delay_direction`; `LinkDelay`, the one mechanism):
before each activation send (pipeline rank j -> j+1) and each gradient send (j+1 -> j) of a
microbatch, the sending rank waits link_delay_ms[j] milliseconds, once per microbatch and
direction whatever the number of tensors; `link_delay_direction` = forward or backward
delays one kind only. The wait is a sleep -- the rank's thread can neither compute nor post
the send meanwhile, which is what a link the sender must wait for does; unlike wire latency
it cannot overlap the asynchronous schedules' compute. One helper, two users: the
pipeline stage's send path (`dynmo.runtime.stage.TimedPipelineStage`, outside the profiler's
spans, so the balancer sees the delay only as link time), and the start-up link probe
(`dynmo.runtime.probe.measure_links`), which sends through `LINKS.wait` and charges the time
spent in it to the link. Layer migrations (`dynmo.runtime.transfer`) do not go through it:
the delay stands for the activation/gradient traffic the balancer models. A link is a pair of
neighbouring pipeline ranks (|a - b| = 1); an interleaved schedule's wrap-around sends from
the last rank to the first (pp > 2) are not on one and are not delayed. The case installs the
delay in this process when it is built, before the trainer probes the links.
"""

from __future__ import annotations

import math
import random
import time
from statistics import median
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dynmo.config import Config, ConfigError, NoiseConfig
from dynmo.dynamics.case import Case
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.plan import initial_layout, layer_flops, num_layers
from dynmo.record import StepRecord
from dynmo.model import stats

BACKWARD_RATIO = 2.0  # a layer's backward takes about this many times its forward
MAX_JITTER = 10.0
MAX_FACTOR = 100.0
MAX_LINK_DELAY_MS = 10_000.0  # per send; far below parallel.timeout_s's default
DIRECTIONS = ("both", "forward", "backward")


def check_options(n: NoiseConfig, pp: int) -> None:
    """One line naming the field and the fix. `pp` = pipeline ranks of the run."""
    if not 0.0 <= n.jitter <= MAX_JITTER:
        raise ConfigError(f"noise.jitter={n.jitter} must be in [0, {MAX_JITTER:g}] "
                          "(mean extra work as a fraction of a layer's time; 0 = none)")
    if not 0.0 <= n.straggler_prob <= 1.0:
        raise ConfigError(f"noise.straggler_prob={n.straggler_prob} must be in [0, 1] (a probability per microbatch)")
    for name in ("straggler_factor", "slow_factor"):
        v = getattr(n, name)
        if not 1.0 <= v <= MAX_FACTOR:
            raise ConfigError(f"noise.{name}={v} must be in [1, {MAX_FACTOR:g}] "
                              "(how many times its time a slowed layer takes; 1 = no slowdown)")
    if not -1 <= n.slow_rank < pp:
        raise ConfigError(f"noise.slow_rank={n.slow_rank} must be a pipeline rank in 0..{pp - 1}, "
                          "or -1 for no slow phase")
    if n.slow_rank >= 0 and not 1 <= n.slow_steps <= n.slow_every:
        raise ConfigError(f"noise.slow_rank={n.slow_rank} needs a slow phase: set noise.slow_every >= 1 and "
                          f"1 <= noise.slow_steps <= noise.slow_every (got slow_every={n.slow_every}, "
                          f"slow_steps={n.slow_steps})")
    if n.slow_every < 0 or n.slow_steps < 0:
        raise ConfigError(f"noise.slow_every={n.slow_every} and noise.slow_steps={n.slow_steps} must be >= 0")
    if n.link_delay_ms and len(n.link_delay_ms) != pp - 1:
        raise ConfigError(f"noise.link_delay_ms has {len(n.link_delay_ms)} values; give one per link between "
                          f"neighbouring pipeline ranks ({pp - 1} for {pp} ranks), or none")
    for j, v in enumerate(n.link_delay_ms):
        if not (math.isfinite(v) and 0.0 <= v <= MAX_LINK_DELAY_MS):
            raise ConfigError(f"noise.link_delay_ms[{j}]={v} must be a number of milliseconds in "
                              f"[0, {MAX_LINK_DELAY_MS:g}] (the wait before each send on link {j} <-> {j + 1})")
    if n.link_delay_direction not in DIRECTIONS:
        raise ConfigError(f"noise.link_delay_direction={n.link_delay_direction!r} must be one of {', '.join(DIRECTIONS)}")


class LinkDelay:
    """The injected link delay of this process (see the module docstring): what the sender of a
    message from pipeline rank `src` to `dst` waits before posting it. Empty until configured:
    no wait, no clock read."""

    def __init__(self) -> None:
        self.seconds: list[float] = []  # per link j <-> j+1
        self.direction = "both"

    def configure(self, ms: list[float], direction: str = "both") -> None:
        self.seconds = [float(x) / 1000.0 for x in ms]
        self.direction = direction

    def delay_s(self, src: int, dst: int, kind: str) -> float:
        """Seconds a `kind` ("forward": activations, "backward": gradients) send from pipeline
        rank `src` to `dst` waits."""
        if not self.seconds or abs(src - dst) != 1 or self.direction not in ("both", kind):
            return 0.0
        j = min(src, dst)
        return self.seconds[j] if j < len(self.seconds) else 0.0

    def wait(self, src: int, dst: int, kind: str) -> float:
        """Wait before a send; returns the seconds waited, measured (0.0 when nothing is configured)."""
        s = self.delay_s(src, dst, kind)
        if s <= 0:
            return 0.0
        t = time.perf_counter()
        time.sleep(s)
        return time.perf_counter() - t


LINKS = LinkDelay()  # this process's link delay: the Noise case configures it, senders wait on it


class Draws:
    """The noise of a config as pure functions of their keys (no state, no torch), so a run is
    reproducible and a test can check the distribution without running a model.

    Each draw seeds its own `random.Random` from a string of its keys (string seeds hash with
    SHA-512, the same in every process whatever PYTHONHASHSEED is)."""

    def __init__(self, opts: NoiseConfig):
        self.opts = opts

    def _uniform(self, *keys: Any) -> float:
        return random.Random(":".join(["dynmo-noise", str(self.opts.seed), *map(str, keys)])).random()

    def jitter(self, step: int, layer: int, microbatch: int) -> float:
        """Extra work of global layer `layer` on a microbatch, in units of its time: U(0, 2 * jitter)."""
        if self.opts.jitter <= 0:
            return 0.0
        return 2.0 * self.opts.jitter * self._uniform("jitter", step, layer, microbatch)

    def straggler(self, step: int, process: int, microbatch: int) -> bool:
        """Whether this microbatch is a straggler on process `process` (a global rank)."""
        p = self.opts.straggler_prob
        return p > 0 and self._uniform("straggler", step, process, microbatch) < p

    def slow(self, step: int, pp_rank: int) -> bool:
        """Whether pipeline rank `pp_rank` is in a slow phase at `step` (no randomness)."""
        o = self.opts
        return o.slow_rank >= 0 and pp_rank == o.slow_rank and o.slow_every > 0 and step % o.slow_every < o.slow_steps

    def factor(self, step: int, layer: int, microbatch: int, process: int, pp_rank: int) -> float:
        """How many times its time the layer takes on this microbatch (>= 1): the slowdowns multiply."""
        o = self.opts
        f = 1.0 + self.jitter(step, layer, microbatch)
        if self.straggler(step, process, microbatch):
            f *= o.straggler_factor
        if self.slow(step, pp_rank):
            f *= o.slow_factor
        return f

    def extra(self, step: int, layer: int, microbatch: int, process: int, pp_rank: int) -> float:
        """e = factor - 1 >= 0: the extra work in units of the layer's own time."""
        return self.factor(step, layer, microbatch, process, pp_rank) - 1.0


def recorded_costs(draws: Draws, step: int, costs: list[float], ranks: list[int], microbatches: int) -> list[float]:
    """What the profiler records at `step` for layers of per-microbatch `costs` (seconds) under
    this noise: per layer, the median over the step's microbatches of its cost times its
    factor on pipeline rank `ranks[i]` (that rank's process too: a run of one replica). The
    extra work, booked to the forward, is e x (forward + backward), so a layer's whole cost
    scales by its factor. Runs that record injected costs (`dynmo.runtime.faults`) record
    these, so what the controller decides under noise does not depend on the machine."""
    return [c * median(draws.factor(step, i, mb, r, r) for mb in range(max(1, microbatches)))
            for i, (c, r) in enumerate(zip(costs, ranks))]


def decisions_under_noise(cfg: Config, costs: list[float], steps: int) -> list[tuple[int, tuple[int, ...]]]:
    """(step, new layout) of every decision the DynMo loop of `cfg` (its [balance], [noise],
    layout and schedule) makes over `steps` steps on per-layer `costs` (seconds per microbatch)
    read through the noise's own draws (`recorded_costs`): what a run of `cfg` with those costs
    injected (DYNMO_COSTS) decides, without running a model or reading this machine's timing."""
    draws, m = Draws(cfg.noise), cfg.train.microbatches
    text, stages = cfg.parallel.layout, cfg.parallel.pp or 2
    if any(ch.isdigit() for ch in text):
        layout = Layout.parse(text, len(costs))
    else:  # a named layout, as the run lays it out before step 0 (params: the costs' own layers are alike)
        layout = initial_layout(cfg, stages, [1] * len(costs)) if len(costs) == num_layers(cfg) \
            else Layout.uniform(len(costs), stages)
    flops = layer_flops(cfg) if len(costs) == num_layers(cfg) else None
    loop = DynmoLoop(cfg.balance, microbatches=m, schedule=cfg.parallel.schedule, layer_params=[1] * len(costs),
                     layer_flops=flops)
    moves = []
    for step in range(steps):
        d = loop.decide(step, layout, steps - step)
        if d is not None:
            moves.append((step, d.layout.boundaries))
            layout = d.layout
            loop.applied(m)
        seen = recorded_costs(draws, step, costs, list(layout.owner()), m)
        loop.observe(StepRecord(step=step, layout=list(layout.boundaries), layer_cost_s=seen, microbatches=m))
    return moves


class Burner:
    """Real work for a given number of seconds on a device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._cycles_per_s: float | None = None
        self._a = torch.full((32, 32), 1.0 / 32)  # a @ a == a: the values never grow
        self._out = torch.empty(32, 32)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def burn(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with torch.no_grad(), _no_autocast(self.device):
            if self.cuda:
                torch.cuda._sleep(max(1, int(seconds * self._calibrate())))
                return
            a, out = self._a, self._out
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                torch.mm(a, a, out=out)

    def _calibrate(self) -> float:
        """GPU clock cycles per second that `torch.cuda._sleep` spins, measured once."""
        if self._cycles_per_s is None:
            cycles = 10_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)  # warm-up
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_s = cycles / max(start.elapsed_time(end) / 1000.0, 1e-9)
        return self._cycles_per_s


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False) if device.type in ("cpu", "cuda") else nullcontext()


def _recomputing() -> bool:
    """Inside a checkpointed block's recomputation: the runtime pauses step statistics there
    (`dynmo.runtime.stage`), and a recomputation is not a new microbatch."""
    return stats.is_paused()


class Noise(Case):
    name = "noise"
    section = "noise"

    def __init__(self, host):
        super().__init__(host)
        LINKS.configure(self.opts.link_delay_ms, self.opts.link_delay_direction)
        self.draws = Draws(self.opts)
        self.burner = Burner(host.device)
        self.hooked: dict[int, tuple[nn.Module, list]] = {}  # layer -> (the module, its hook handles)
        self.step = 0
        self.process = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.pp_rank = 0
        self.forwards: dict[int, int] = {}  # training forwards of each layer this step
        self.extra_s: dict[int, float] = {}  # seconds of work added to each layer this step
        self._start: dict[int, float] = {}

    def before_step(self, step: int) -> list[dict]:
        self.step = step
        self.pp_rank = self._pipeline_rank()
        self.forwards, self.extra_s, self._start = {}, {}, {}
        layers = self.host.layers()
        for i, (module, handles) in list(self.hooked.items()):
            if layers.get(i) is not module:  # the layer left, or a migration rebuilt it
                for h in handles:
                    h.remove()
                del self.hooked[i]
        for i, module in layers.items():
            if i not in self.hooked:
                self.hooked[i] = (module, [module.register_forward_pre_hook(self._pre_hook(i)),
                                           module.register_forward_hook(self._hook(i))])
        return []  # timing noise is not a change of the model: no dynamism events

    def _pipeline_rank(self) -> int:
        group = self.host.model_group
        if group is None or not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(group=group)

    def _pre_hook(self, i: int):
        def pre(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled() and not _recomputing():
                self.burner.sync()
                self._start[i] = time.perf_counter()

        return pre

    def _hook(self, i: int):
        def post(module: nn.Module, args: tuple, out: Any) -> None:
            start = self._start.pop(i, None)
            if start is None:
                return None
            self.burner.sync()
            t = time.perf_counter() - start
            mb = self.forwards.get(i, 0)
            self.forwards[i] = mb + 1
            seconds = self.burn_seconds(i, mb, t)
            self.extra_s[i] = self.extra_s.get(i, 0.0) + seconds
            self.burner.burn(seconds)
            return None  # the output as the layer computed it

        return post

    def burn_seconds(self, layer: int, microbatch: int, forward_s: float) -> float:
        """The work added after a forward of `forward_s` seconds: e x (forward + backward)."""
        e = self.draws.extra(self.step, layer, microbatch, self.process, self.pp_rank)
        return e * (1.0 + BACKWARD_RATIO) * forward_s

    def layer_stats(self) -> dict[str, dict[int, Any]]:
        return {"noise_extra_s": {i: self.extra_s.get(i, 0.0) for i in self.hooked}}
