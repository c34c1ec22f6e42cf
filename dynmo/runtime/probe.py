"""Start-up probes of the workers and links, for the stage cost (stage load divided by worker
speed, plus the activation transfer to the next stage).

speeds     every rank times the same fixed matmul workload; speed = reference time / own time,
           the reference being pipeline position 0 (averaged over data-parallel replicas).
           A probe, not a model: a worker slowed later (thermal, a noisy neighbour) is not seen.
transfer   each pipeline link j -> j+1 measures its bandwidth with a large ping-pong; a
           microbatch's boundary bytes cross the link twice per step (the activation
           forward, its gradient backward), so t_j = 2 x bytes / bandwidth. Latency is left
           out: the schedules send asynchronously, so it overlaps compute. A sender's wait
           before a send (the injected link delay, `noise.link_delay_ms`) is not latency: the
           sender cannot compute meanwhile. The probe's sends go through the same wait as the
           pipeline's, its time is measured on each side and added in full:
           t_j = 2 x bytes / bandwidth + wait forward + wait backward.
           The bytes are those of a cut between blocks (hidden state and token mask); a cut
           between a block's two halves also ships the block's carry (`boundary_bytes`, per
           cut, which the controller turns into each cut's factor on its link's time).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dynmo.config import BalanceConfig, Config
from dynmo.dynamics.noise import LINKS
from dynmo.model.layers import CARRIES, half_carry, layer_specs
from dynmo.runtime.dist import DistContext


def edge_bytes(microbatch: int, seq_len: int, d_model: int, elem_bytes: int) -> int:
    """Bytes of one microbatch crossing a boundary between blocks: the hidden state
    [mb, seq, d_model] and the token mask [mb, seq], both in the compute dtype
    (`dynmo.runtime.stage.example_io`)."""
    return microbatch * seq_len * (d_model + 1) * elem_bytes


def boundary_bytes(cfg: Config, microbatch: int, elem_bytes: int) -> list[int]:
    """Per cut after unit i (i = 0 .. units - 2): the bytes of one microbatch crossing it. Every
    boundary ships the hidden state and the mask (`edge_bytes`); one after a block's attention
    half (`parallel.unit = "sublayer"`) also ships the block's carry (`half_carry`: Mixture of
    Depths' route and chosen, [mb, seq] each, early exit's block input, [mb, seq, d_model]),
    each in the compute dtype, as the stage examples send them (the bool ones cast, like the
    mask). The gradients sent back have the same shapes, so one count serves both directions."""
    m = cfg.model
    base = edge_bytes(microbatch, m.seq_len, m.d_model, elem_bytes)
    carry = sum(microbatch * m.seq_len * (m.d_model if CARRIES[name].per_feature else 1) * elem_bytes
                for name in half_carry(cfg))
    specs = layer_specs(m, cfg.parallel.unit)
    return [base + (carry if spec.part == "attn" else 0) for spec in specs[:-1]]


def _matmul_seconds(device: torch.device, n: int = 256, reps: int = 8, rounds: int = 5) -> float:
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            a = torch.tanh(a @ b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])  # the first round warms up


def measure_speeds(ctx: DistContext) -> list[float]:
    """Relative speed of each pipeline position (1.0 = position 0), same on every rank."""
    # gathered on the rank's device (NCCL takes no CPU tensor)
    mine = torch.tensor([_matmul_seconds(ctx.device)], dtype=torch.float64, device=ctx.device)
    parts = [torch.zeros_like(mine) for _ in range(ctx.active_world)]
    dist.all_gather(parts, mine, group=ctx.active_group)
    parts = [p.cpu() for p in parts]
    per_pos = [statistics.fmean(float(parts[r * ctx.pp + j]) for r in range(ctx.dp)) for j in range(ctx.pp)]
    return [per_pos[0] / t for t in per_pos]


def measure_links(ctx: DistContext, microbatch: int, seq_len: int, d_model: int, rounds: int = 5,
                  probe_bytes: int = 8 << 20, elem_bytes: int = 4) -> tuple[list[float], list[float]]:
    """Seconds per microbatch on each link j -> j+1 of this replica's pipeline, averaged over
    replicas, split by direction: (forward, the sender j's activation send; backward, the
    sender j+1's gradient send). The same lists on every rank.

    Bandwidth, not latency: schedules send activations asynchronously, so a message's latency
    overlaps compute, while the bytes occupy the link. Each link ping-pongs a buffer of at
    least `probe_bytes` (to amortise latency) and the cost of a microbatch is its boundary
    bytes (hidden state and token mask, `elem_bytes` per value: `dynmo.runtime.stage.example_io`)
    at that bandwidth, each way: a cut between blocks (`edge_bytes`; a cut between a block's
    halves ships more, `boundary_bytes`).
    Each send first waits the injected link delay (`LINKS.wait`, as the pipeline's sends do);
    the sender's measured wait is taken out of the round trip before the bandwidth is
    computed and added in full to its direction."""
    pp, me = ctx.pp, ctx.pp_rank
    act_bytes = edge_bytes(microbatch, seq_len, d_model, elem_bytes)
    buf = torch.zeros(max(probe_bytes, act_bytes) // 4, device=ctx.device)
    # per link: [round trip (rank j), rank j's wait before its send, rank j+1's wait before its send]
    mine = torch.zeros(3, max(pp - 1, 1), dtype=torch.float64)
    for j in range(pp - 1):  # every rank walks the links in order; only the two ends act
        if me not in (j, j + 1):
            continue
        peer = j + 1 if me == j else j
        trips, waits = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            if me == j:
                waits.append(LINKS.wait(me, peer, "forward"))
                dist.send(buf, group=ctx.pp_group, group_dst=peer)
                dist.recv(buf, group=ctx.pp_group, group_src=peer)
            else:
                dist.recv(buf, group=ctx.pp_group, group_src=peer)
                waits.append(LINKS.wait(me, peer, "backward"))
                dist.send(buf, group=ctx.pp_group, group_dst=peer)
            trips.append(time.perf_counter() - t)
        # the first round warms up
        if me == j:
            mine[0, j] = statistics.median(trips[1:])
            mine[1, j] = statistics.median(waits[1:])
        else:
            mine[2, j] = statistics.median(waits[1:])
    mine = mine.to(ctx.device)  # gathered on the rank's device (NCCL takes no CPU tensor)
    parts = [torch.zeros_like(mine) for _ in range(ctx.active_world)]
    dist.all_gather(parts, mine, group=ctx.active_group)
    parts = [p.cpu() for p in parts]
    if pp < 2:
        return [], []
    fwd, back = [], []
    for j in range(pp - 1):
        per_replica = []
        for r in range(ctx.dp):
            sender, receiver = parts[r * pp + j], parts[r * pp + j + 1]
            trip, wait_fwd, wait_bwd = float(sender[0, j]), float(sender[1, j]), float(receiver[2, j])
            wire = max(trip - wait_fwd - wait_bwd, 1e-9)
            bandwidth = 2 * buf.numel() * 4 / wire  # bytes/s
            per_replica.append((act_bytes / bandwidth + wait_fwd, act_bytes / bandwidth + wait_bwd))
        fwd.append(statistics.fmean(f for f, _ in per_replica))
        back.append(statistics.fmean(b for _, b in per_replica))
    return fwd, back


def measure_workers(b: BalanceConfig, ctx: DistContext, microbatch: int, seq_len: int, d_model: int,
                    elem_bytes: int = 4) -> tuple[list[float], list[float] | None, list[float] | None]:
    """Worker speeds and per-link transfer seconds per microbatch (forward, backward), as
    `[balance]` asks: `speeds` given, or `workers = "measure"` (within 10% of the reference
    is noise, not a slower worker), else equal; links measured unless `links = "free"`."""
    speeds = [1.0] * ctx.pp
    if b.workers == "measure":
        speeds = [1.0 if abs(x - 1.0) < 0.1 else x for x in measure_speeds(ctx)]
    if b.speeds:
        speeds = list(b.speeds)
    fwd = back = None
    if b.links == "measure" and ctx.pp > 1:
        fwd, back = measure_links(ctx, microbatch, seq_len, d_model, elem_bytes=elem_bytes)
    return speeds, fwd, back
