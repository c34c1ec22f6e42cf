"""What FSDP2 (`fully_shard`) and its neighbours do on CPU/gloo in the installed torch.

    python benchmarks/probe_fsdp2.py                    # spawns 4 CPU ranks itself
    torchrun --nproc-per-node 4 benchmarks/probe_fsdp2.py

Groundwork for `parallel.shard = "none" | "optimizer" | "full"` in a dp x pp run where each
stage's blocks are sharded over the stage's data-parallel group and blocks still migrate
between stages. 4 ranks on a (dp=2, pp=2) DeviceMesh, dynmo's order: rank r is replica r // 2,
stage r % 2, so stage 0's dp group is ranks {0, 2} and stage 1's is {1, 3}. One line per check,
PASS only if every rank passed; a FAIL carries the first line of the first failing rank's
exception. Models are tiny (Linear layers whose first dimension does not divide by 2, so the
dim-0 shards are uneven and FSDP2's padding is exercised). Findings: docs/sharding-probe.md.

  a   fully_shard per Linear then the root on the "dp" sub-mesh; 3 AdamW steps against an
      unsharded replica whose gradients are all-reduced and averaged by hand
  a2  the same with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
  b   AdamW state of the sharded model: DTensor shards, to_local(), full_tensor()
  c   a sharded module's shard moved point to point (params + AdamW state) to the rank of the
      same dp index in the other stage; rebuilt there meta -> fully_shard -> to_empty, the shard
      written in three ways (to_local().copy_, load_state_dict / set_model_state_dict of
      DTensor.from_local); one more step on both sides must agree
  d   fully_shard'ed stage modules under torch.distributed.pipelining, 2 microbatches, 2 steps
      against an unsharded 4-block reference: GPipe, 1F1B, Interleaved1F1B,
      InterleavedZeroBubble, ZBVZeroBubble (4 one-block stages); reshard_after_forward True /
      False; blocks only, without a sharded Stage root; a no-FSDP control. Counts FSDP's
      all-gathers and reduce-scatters per step.
  d2  migration: a block that ran under one sharded root put under a new one (re-rooting);
      block b1 moving from stage 0 to stage 1 as shards with new Stage roots and a new schedule,
      the staying blocks re-sharded from their own local shards; the same without Stage roots,
      blocks reused as they are. One more step against the reference.
  e   DCP save of the sharded model + AdamW (get_state_dict) and load into an unsharded model
      (set_state_dict): per stage on one rank without a process group and on both dp ranks;
      and one checkpoint of all 4 ranks loaded unsharded on one rank
  f   ZeroRedundancyOptimizer (ZeRO-1) on the dp group; add_param_group for an arriving layer

PROBE_ONLY=a,d2 runs only the checks whose names start so (later ones use a's and d's state);
PROBE_TRACE=1 prints the tracebacks; PROBE_TIMEOUT (s, default 300) bounds a self-spawned run.
"""

from __future__ import annotations

import ast
import os
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

WORLD = 4
DP, PP = 2, 2
LR = 1e-2
D, H = 6, 9  # Linear(D, H).weight is (9, 6): shards of 5 and 4 rows


# ---- small models and data ----------------------------------------------------------------
def block(seed: int = 0) -> nn.Sequential:
    """Linear, Tanh, Linear: fully_shard'ed per Linear (a and b) or as a whole (the pipeline)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))


class Stage(nn.Module):
    """Like dynmo's StageModule: no parameters of its own, named blocks in a ModuleDict."""

    def __init__(self, blocks: dict[str, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict(blocks)

    def forward(self, x):
        for b in self.layers.values():
            x = b(x)
        return x


def batch(step: int, dp_rank: int, n: int = 4, salt: int = 0):
    g = torch.Generator().manual_seed(1000 * step + dp_rank + 100 * salt)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False)


# ---- context -------------------------------------------------------------------------------
class Ctx:
    def __init__(self):
        from torch.distributed.device_mesh import init_device_mesh

        self.rank = dist.get_rank()
        self.mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
        self.dp_mesh = self.mesh["dp"]
        self.dp_group = self.mesh.get_group("dp")
        self.pp_group = self.mesh.get_group("pp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.pp_rank = self.mesh.get_local_rank("pp")
        # the rank of the same dp index in the other stage
        self.peer = self.dp_rank * PP + (1 - self.pp_rank)
        self.keep: dict = {}


def first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"[:300]


def maxdiff(pairs) -> float:
    return max((float((a.detach().float() - b.detach().float()).abs().max()) for a, b in pairs), default=0.0)


# ---- a: fully_shard vs a hand-made DDP reference ------------------------------------------------
def check_a(ctx: Ctx, mp_policy=None, key="a"):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    kw = {"mesh": ctx.dp_mesh}
    if mp_policy is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(**mp_policy)
    ref, model = block(0), block(0)
    fully_shard(model[0], **kw)
    fully_shard(model[2], **kw)
    fully_shard(model, **kw)
    opt, ropt = adamw(model.parameters()), adamw(ref.parameters())
    loss_d, placements, local_shapes = 0.0, set(), []
    for step in range(3):  # the two stages' models see different data (e-world tells them apart)
        x, y = batch(step, ctx.dp_rank, salt=ctx.pp_rank)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        rloss = F.mse_loss(ref(x), y)
        rloss.backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad, group=ctx.dp_group)
            p.grad /= DP
        for p in model.parameters():
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), type(p.grad)
            placements.add(tuple(p.grad.placements))
            if step == 0:
                local_shapes.append(tuple(p.grad.to_local().shape))
        loss_d = max(loss_d, abs(loss.item() - rloss.item()))
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    pd = maxdiff((p.full_tensor(), r) for p, r in zip(model.parameters(), ref.parameters()))
    tol = 1e-5 if mp_policy is None else 5e-2
    ok = placements == {(Shard(0),)} and pd <= tol and loss_d <= tol
    if key == "a":
        ctx.keep["a"] = (model, opt, ref, ropt)
    return ok, (f"grad placements {sorted(map(str, placements))}, local grad shapes {local_shapes}, "
                f"max|loss diff| {loss_d:.2e}, max|param diff| after 3 steps {pd:.2e}")


def check_a2(ctx: Ctx):
    return check_a(ctx, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, key="a2")


# ---- b: optimizer state of the sharded model --------------------------------------------------
def check_b(ctx: Ctx):
    from torch.distributed.tensor import DTensor

    model, opt, ref, ropt = ctx.keep["a"]
    kinds, local_shapes, pairs = set(), [], []
    for p, r in zip(model.parameters(), ref.parameters()):
        st, rst = opt.state[p], ropt.state[r]
        for k in ("exp_avg", "exp_avg_sq"):
            v = st[k]
            kinds.add(f"{k}:{type(v).__name__}{tuple(v.placements) if isinstance(v, DTensor) else ''}")
            local_shapes.append(tuple(v.to_local().shape))
            pairs.append((v.full_tensor(), rst[k]))
        kinds.add(f"step:{type(st['step']).__name__}")
    d = maxdiff(pairs)
    ok = all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in model.parameters()) and d <= 1e-6
    return ok, f"{sorted(kinds)}; local shapes {local_shapes[:4]}...; max|full_tensor - reference state| {d:.2e}"


# ---- c: moving a shard point to point ----------------------------------------------------------
def local_of(t):
    return t.to_local() if hasattr(t, "to_local") else t


def send_shards(module, opt, dst):
    for p in module.parameters():
        dist.send(local_of(p.data).contiguous(), dst)
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            dist.send(local_of(st[k]).contiguous(), dst)
        dist.send(st["step"].reshape(1).float(), dst)


def recv_shards(module, dst_opt, src, how: str):
    """Fill a freshly fully_shard'ed module (and AdamW state) with the shards rank `src` sends."""
    from torch.distributed.tensor import DTensor

    sd = {}
    for name, p in module.named_parameters():
        local = torch.empty_like(p.to_local())
        dist.recv(local, src)
        if how == "copy_local":  # write into the sharded parameter's local tensor
            with torch.no_grad():
                p.to_local().copy_(local)
        else:
            sd[name] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
        st = {}
        for k in ("exp_avg", "exp_avg_sq"):
            buf = torch.empty_like(p.to_local())
            dist.recv(buf, src)
            st[k] = DTensor.from_local(buf, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
        step = torch.empty(1)
        dist.recv(step, src)
        st["step"] = step.reshape(())
        dst_opt.state[p] = st
    if how == "load_state_dict":
        module.load_state_dict(sd, strict=True)
    elif how == "set_model_state_dict":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, sd, options=StateDictOptions(strict=True))


def check_c(ctx: Ctx, how: str = "copy_local"):
    from torch.distributed.fsdp import fully_shard

    if ctx.pp_rank == 0:  # stage 0 (check a's trained model) sends its shards
        model, opt, _, _ = ctx.keep["a"]
        send_shards(model, opt, ctx.peer)
        for _ in range(2):  # full tensors (a collective over {0, 2}) as loaded, then after a step
            for t in [p.full_tensor() for p in model.parameters()]:
                dist.send(t.contiguous(), ctx.peer)
            x, y = batch(3, ctx.dp_rank)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return True, "sent"
    with torch.device("meta"):
        model = block(0)
    fully_shard(model[0], mesh=ctx.dp_mesh)
    fully_shard(model[2], mesh=ctx.dp_mesh)
    fully_shard(model, mesh=ctx.dp_mesh)
    model.to_empty(device="cpu")
    opt = adamw(model.parameters())
    recv_shards(model, opt, ctx.peer, how)
    diffs = []
    for _ in range(2):
        mine = [p.full_tensor() for p in model.parameters()]  # collective over {1, 3}
        theirs = [torch.empty_like(t) for t in mine]
        for t in theirs:
            dist.recv(t, ctx.peer)
        diffs.append(maxdiff(zip(mine, theirs)))
        x, y = batch(3, ctx.dp_rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return max(diffs) <= 1e-6, (f"[{how}] max|receiver full_tensor - sender's| as loaded {diffs[0]:.2e}, "
                                f"after one more step on both {diffs[1]:.2e}")


def check_c_load_state_dict(ctx):
    return check_c(ctx, "load_state_dict")


def check_c_set_model_state_dict(ctx):
    return check_c(ctx, "set_model_state_dict")


# ---- d: FSDP under torch.distributed.pipelining --------------------------------------------------
SEEDS = [11, 12, 13, 14]  # the 4 blocks of the pipeline model
MB = 2  # microbatches (of 2 samples each)
COMMS = {"all_gather": 0, "reduce_scatter": 0}


def count_comms() -> None:
    """Count FSDP2's collectives: it calls dist.all_gather_single / reduce_scatter_single."""
    for name, key in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter")):
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def wrapped(*a, _orig=orig, _key=key, **k):
            COMMS[_key] += 1
            return _orig(*a, **k)

        setattr(dist, name, wrapped)


class Reference:
    """The 4-block model unsharded, trained locally on every rank on both replicas' data."""

    def __init__(self):
        self.blocks = nn.ModuleList(block(s) for s in SEEDS)
        self.opt = adamw(self.blocks.parameters())

    def step(self, step: int) -> float:
        total = 0.0
        for dp in range(DP):
            x, y = batch(step, dp)
            for xm, ym in zip(x.chunk(MB), y.chunk(MB)):
                h = xm
                for b in self.blocks:
                    h = b(h)
                loss = F.mse_loss(h, ym)
                (loss / (DP * MB)).backward()
                if dp == dist.get_rank() // PP:
                    total += loss.item()
        self.opt.step()
        self.opt.zero_grad()
        return total


def build_stages(ctx: Ctx, stage_blocks: dict[int, dict[str, nn.Module]], raf: bool | None, root: bool,
                 schedule: str, num_stages: int):
    """One Stage per entry (stage index -> its blocks); every block not yet an FSDPModule gets
    fully_shard on the dp sub-mesh, then the Stage itself if `root`. raf None: no FSDP at all."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)

    mods, stages = {}, []
    for s, blocks in stage_blocks.items():
        mod = Stage(blocks)
        if raf is not None:
            for b in blocks.values():
                if not isinstance(b, FSDPModule):
                    fully_shard(b, mesh=ctx.dp_mesh, reshard_after_forward=raf)
            if root:
                fully_shard(mod, mesh=ctx.dp_mesh, reshard_after_forward=raf)
        # static examples, as dynmo gives them: a later stage's input must say requires_grad=True,
        # else the stage computes no input gradient and the earlier stage's backward gets None
        x_ex = torch.empty(2, D, requires_grad=s > 0)
        stages.append(PipelineStage(mod, s, num_stages, torch.device("cpu"), input_args=(x_ex,),
                                    output_args=(torch.empty(2, D, requires_grad=True),), group=ctx.pp_group))
        mods[s] = mod
    # scale_grads (default True): gradients / microbatches
    multi = {"interleaved1f1b": ScheduleInterleaved1F1B, "interleavedzb": ScheduleInterleavedZeroBubble,
             "zbv": ScheduleZBVZeroBubble}
    if schedule in multi:
        sched = multi[schedule](stages, n_microbatches=MB, loss_fn=F.mse_loss)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = cls(stages[0], n_microbatches=MB, loss_fn=F.mse_loss)
    return mods, sched


def pipe_step(ctx, sched, step, stages, last):
    """One schedule step; `stages`: the stage indices this rank holds, `last` the last one's."""
    x, y = batch(step, ctx.dp_rank)
    losses = []
    args = (x,) if 0 in stages else ()
    kw = {"target": y, "losses": losses} if last in stages else {}
    sched.step(*args, **kw)
    return sum(l.item() for l in losses)


def compare_stages(mods: dict[int, Stage], ref: Reference) -> float:
    pairs = []
    for s in sorted(mods):  # same order on both ranks of the dp group: full_tensor is a collective
        for name, b in mods[s].layers.items():
            for p, r in zip(b.parameters(), ref.blocks[int(name[1:])].parameters()):
                pairs.append((p.full_tensor() if hasattr(p, "full_tensor") else p, r))
    return maxdiff(pairs)


def dp_average(mods, group):
    for m in mods.values():
        for p in m.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= DP


def run_pipe(ctx: Ctx, schedule: str, raf: bool | None, root: bool = True, keep: str | None = None):
    r = ctx.pp_rank
    if schedule in ("interleaved1f1b", "interleavedzb"):  # 4 stages of one block, stage s on rank s % 2
        layout = {r: [f"b{r}"], r + PP: [f"b{r + PP}"]}
    elif schedule == "zbv":  # 4 stages of one block in a V: rank 0 holds stages 0 and 3
        layout = {r: [f"b{r}"], 2 * PP - 1 - r: [f"b{2 * PP - 1 - r}"]}
    else:  # 2 stages of two blocks
        layout = {r: [f"b{2 * r}", f"b{2 * r + 1}"]}
    num_stages = len(SEEDS) // (2 if len(layout) == 1 else 1)
    stage_blocks = {s: {n: block(SEEDS[int(n[1:])]) for n in names} for s, names in layout.items()}
    mods, sched = build_stages(ctx, stage_blocks, raf, root, schedule, num_stages)
    opt = adamw([p for m in mods.values() for p in m.parameters()])
    ref = Reference()
    ld = 0.0
    COMMS.update(all_gather=0, reduce_scatter=0)
    for step in range(2):
        loss = pipe_step(ctx, sched, step, tuple(layout), num_stages - 1)
        if raf is None:  # no FSDP: average over dp by hand
            dp_average(mods, ctx.dp_group)
        opt.step()
        opt.zero_grad()
        rloss = ref.step(step)
        if num_stages - 1 in layout:
            ld = max(ld, abs(loss - rloss))
    nb = sum(len(m.layers) for m in mods.values())
    comms = (f"per rank and step ({nb} blocks, {MB} microbatches): {COMMS['all_gather'] / 2:g} all-gathers, "
             f"{COMMS['reduce_scatter'] / 2:g} reduce-scatters")
    pd = compare_stages(mods, ref)
    if keep:
        ctx.keep[keep] = (mods, opt, ref, raf, root, schedule)
    fsdp = "no FSDP" if raf is None else f"reshard_after_forward={raf}, sharded Stage root={root}"
    return pd <= 1e-5 and ld <= 1e-5, (f"[{schedule}, {fsdp}] max|loss diff| {ld:.2e}, max|param diff| "
                                       f"after 2 steps {pd:.2e}; {comms}")


def check_d_plain(ctx):  # the control: the same pipeline without FSDP
    return run_pipe(ctx, "gpipe", raf=None)


def check_d_gpipe(ctx):
    return run_pipe(ctx, "gpipe", raf=True)


def check_d_gpipe_noreshard(ctx):
    return run_pipe(ctx, "gpipe", raf=False, keep="pipe")


def check_d_1f1b(ctx):
    return run_pipe(ctx, "1f1b", raf=True)


def check_d_1f1b_noreshard(ctx):
    return run_pipe(ctx, "1f1b", raf=False)


def check_d_interleaved(ctx):
    return run_pipe(ctx, "interleaved1f1b", raf=False)


def check_d_interleavedzb(ctx):
    return run_pipe(ctx, "interleavedzb", raf=False)


def check_d_zbv(ctx):
    return run_pipe(ctx, "zbv", raf=False)


def check_d_blocks_only(ctx):
    return run_pipe(ctx, "1f1b", raf=False, root=False, keep="pipe-blocks")


def check_d_blocks_only_reshard(ctx):
    return run_pipe(ctx, "1f1b", raf=True, root=False)


# ---- d2: migration of FSDP blocks ---------------------------------------------------------------
def check_d2_reroot(ctx: Ctx):
    """A block that ran under one sharded root, put under a new sharded root (no pipeline)."""
    from torch.distributed.fsdp import fully_shard

    b0, b1 = block(SEEDS[0]), block(SEEDS[1])
    for b in (b0, b1):
        fully_shard(b, mesh=ctx.dp_mesh)
    old = Stage({"b0": b0, "b1": b1})
    fully_shard(old, mesh=ctx.dp_mesh)
    x, y = batch(0, ctx.dp_rank)
    F.mse_loss(old(x), y).backward()
    new = Stage({"b0": b0})
    fully_shard(new, mesh=ctx.dp_mesh)
    F.mse_loss(new(x), y).backward()  # lazy init of the new root checks its children
    return True, "a block that already ran under a sharded root runs under a new sharded root"


def migrate(ctx: Ctx, key: str, rebuild: bool):
    """Block b1 moves from stage 0 to stage 1: each dp rank sends its own shard (params + AdamW
    state) to the rank of the same dp index in stage 1, which builds the block meta ->
    fully_shard -> to_empty and copies the shard in. `rebuild`: the staying blocks get a new FSDP
    state too (same sharding, a local copy of this rank's shards), so the new Stage root finds
    no child that another root initialized."""
    from torch.distributed.fsdp import fully_shard

    mods, opt, ref, raf, root, schedule = ctx.keep[key]
    mod = mods[ctx.pp_rank]
    state_of = {}

    def fresh(old):
        with torch.device("meta"):
            nb = block(0)
        fully_shard(nb, mesh=ctx.dp_mesh, reshard_after_forward=raf)
        nb.to_empty(device="cpu")
        with torch.no_grad():
            for p, q in zip(nb.parameters(), old.parameters()):
                p.to_local().copy_(q.to_local())
                if opt.state.get(q):
                    state_of[p] = opt.state[q]
        return nb

    def as_is(old):
        for q in old.parameters():
            if opt.state.get(q):
                state_of[q] = opt.state[q]
        return old

    reuse = fresh if rebuild else as_is
    if ctx.pp_rank == 0:
        send_shards(mod.layers["b1"], opt, ctx.peer)
        blocks = {"b0": reuse(mod.layers["b0"])}
    else:
        with torch.device("meta"):
            arriving = block(0)
        fully_shard(arriving, mesh=ctx.dp_mesh, reshard_after_forward=raf)
        arriving.to_empty(device="cpu")
        tmp = adamw(arriving.parameters())
        recv_shards(arriving, tmp, ctx.peer, "copy_local")
        state_of.update((p, tmp.state[p]) for p in arriving.parameters())
        blocks = {"b1": arriving, "b2": reuse(mod.layers["b2"]), "b3": reuse(mod.layers["b3"])}
    new_mods, sched = build_stages(ctx, {ctx.pp_rank: blocks}, raf, root, schedule, PP)
    new_opt = adamw(new_mods[ctx.pp_rank].parameters())
    for p in new_mods[ctx.pp_rank].parameters():
        new_opt.state[p] = state_of[p]
    loss = pipe_step(ctx, sched, 2, (ctx.pp_rank,), PP - 1)
    new_opt.step()
    new_opt.zero_grad()
    rloss = ref.step(2)
    ld = abs(loss - rloss) if ctx.pp_rank == PP - 1 else 0.0
    pd = compare_stages(new_mods, ref)
    how = "staying blocks re-sharded from their local shards" if rebuild else "staying blocks reused as they are"
    return pd <= 1e-5 and ld <= 1e-5, (f"[{how}, sharded Stage root={root}] stage {ctx.pp_rank} now holds "
                                       f"{list(blocks)}: max|loss diff| {ld:.2e}, max|param diff| after "
                                       f"the next step {pd:.2e}")


def check_d2_rebuild(ctx):
    return migrate(ctx, "pipe", rebuild=True)


def check_d2_blocks_only(ctx):
    return migrate(ctx, "pipe-blocks", rebuild=False)


# ---- e: DCP save sharded, load unsharded ----------------------------------------------------------
def check_e(ctx: Ctx, both: bool = False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, _, _ = ctx.keep["a"]
    path = os.path.join(ctx.keep["tmp"], f"ckpt-pp{ctx.pp_rank}")
    if not both:  # save once (per stage, over the stage's dp group)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=ctx.dp_group)
    want_p = [p.full_tensor() for p in model.parameters()]
    want_s = [opt.state[p][k].full_tensor() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    loaders = (0, 1) if both else (0,)
    d = 0.0
    if ctx.dp_rank in loaders:
        plain = block(123)  # different init: the load must overwrite it
        popt = adamw(plain.parameters())
        msd, osd = get_state_dict(plain, popt)  # initializes AdamW state to fill in
        sd = {"model": msd, "optim": osd}
        if both:
            dcp.load(sd, checkpoint_id=path, process_group=ctx.dp_group)
        else:
            dcp.load(sd, checkpoint_id=path, no_dist=True)
        set_state_dict(plain, popt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got_p = list(plain.parameters())
        got_s = [popt.state[p][k] for p in plain.parameters() for k in ("exp_avg", "exp_avg_sq")]
        d = maxdiff(list(zip(got_p, want_p)) + list(zip(got_s, want_s)))
    dist.barrier(group=ctx.dp_group)
    how = "dcp.load on both dp ranks (process_group=dp)" if both else "dcp.load(no_dist=True) on dp rank 0 alone"
    return d <= 1e-7, f"[{how}] max|unsharded - full_tensor| over params and AdamW state {d:.2e}"


def check_e_both(ctx):
    return check_e(ctx, both=True)


def check_e_world(ctx: Ctx):
    """One checkpoint for the whole dp x pp job: every rank saves its stage's shards under
    stage-prefixed keys over the default group; rank 0 alone loads both stages unsharded."""
    import torch.distributed.checkpoint as dcp

    model, opt, _, _ = ctx.keep["a"]

    def flat(params_of):
        out = {}
        for n, p in params_of:
            out[f"stage{ctx.pp_rank}.{n}"] = p
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"stage{ctx.pp_rank}.{n}.{k}"] = opt.state[p][k]
        return out

    sd = flat(model.named_parameters())
    path = os.path.join(ctx.keep["tmp"], "ckpt-world")
    dcp.save(sd, checkpoint_id=path)
    full = {k: v.full_tensor() for k, v in sd.items()}  # collective over the stage's dp group
    d = 0.0
    if ctx.rank == 0:
        want = dict(full)
        n_other = len(full)
        for k in sorted(full):  # the other stage's full tensors, same names but stage1.
            other = k.replace("stage0.", "stage1.")
            want[other] = torch.empty_like(full[k])
            dist.recv(want[other], 1)
        assert len(want) == 2 * n_other
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, checkpoint_id=path, no_dist=True)
        d = maxdiff((got[k], want[k]) for k in want)
    elif ctx.rank == 1:
        for k in sorted(full):
            dist.send(full[k].contiguous(), 0)
    dist.barrier()
    return d <= 1e-7, (f"dcp.save over the world (4 ranks, 2 stages x 2 shards), dcp.load(no_dist=True) on "
                       f"rank 0 into plain tensors of both stages: max|loaded - full_tensor| {d:.2e}")


# ---- f: ZeroRedundancyOptimizer -------------------------------------------------------------------
def check_f(ctx: Ctx):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model, ref = block(0), block(0)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                   process_group=ctx.dp_group, lr=LR, weight_decay=0.01, foreach=False)
    ropt = adamw(ref.parameters())
    def owners():  # the shapes of the whole parameters each dp rank updates
        return [[tuple(p.shape) for g in groups for p in g["params"]] for groups in zero._partition_parameters()]

    owners_before = owners()

    def step(s, m, o, extra=None):
        x, y = batch(s, ctx.dp_rank)
        h = m(x)
        if extra is not None:
            h = extra(h)
        F.mse_loss(h, y).backward()
        for p in list(m.parameters()) + (list(extra.parameters()) if extra is not None else []):
            dist.all_reduce(p.grad, group=ctx.dp_group)
            p.grad /= DP
        o.step()
        o.zero_grad()

    for s in range(3):
        step(s, model, zero), step(s, ref, ropt)
    d1 = maxdiff(zip(model.parameters(), ref.parameters()))
    # a layer arrives (migration in): add_param_group re-partitions
    new, rnew = nn.Linear(D, D), nn.Linear(D, D)
    rnew.load_state_dict(new.state_dict())
    dist.broadcast(new.weight.data, group=ctx.dp_group, group_src=0)
    dist.broadcast(new.bias.data, group=ctx.dp_group, group_src=0)
    rnew.load_state_dict(new.state_dict())
    zero.add_param_group({"params": list(new.parameters())})
    ropt.add_param_group({"params": list(rnew.parameters())})
    owners_after = owners()
    step(3, model, zero, new), step(3, ref, ropt, rnew)
    d2 = maxdiff(list(zip(model.parameters(), ref.parameters())) + list(zip(new.parameters(), rnew.parameters())))
    local_state = sum(1 for st in zero.optim.state.values() if st)
    return d1 <= 1e-6 and d2 <= 1e-6, (
        f"3 steps max|param diff| {d1:.2e}; after add_param_group + 1 step {d2:.2e}; "
        f"whole parameters per rank before {owners_before}, after {owners_after}; "
        f"this rank keeps AdamW state for {local_state} params")


def skipped(ctx):
    return True, "skipped (PROBE_ONLY)"


CHECKS = [
    ("a", check_a),
    ("a2", check_a2),
    ("b", check_b),
    ("c", check_c),
    ("c-load_state_dict", check_c_load_state_dict),
    ("c-set_model_state_dict", check_c_set_model_state_dict),
    ("d-plain", check_d_plain),
    ("d-gpipe", check_d_gpipe),
    ("d-gpipe-noreshard", check_d_gpipe_noreshard),
    ("d-1f1b", check_d_1f1b),
    ("d-1f1b-noreshard", check_d_1f1b_noreshard),
    ("d-interleaved1f1b", check_d_interleaved),
    ("d-interleavedzb", check_d_interleavedzb),
    ("d-zbv", check_d_zbv),
    ("d-blocks-only", check_d_blocks_only),
    ("d-blocks-only-reshard", check_d_blocks_only_reshard),
    ("d2-reroot", check_d2_reroot),
    ("d2-rebuild", check_d2_rebuild),
    ("d2-blocks-only", check_d2_blocks_only),
    ("e", check_e),
    ("e-both", check_e_both),
    ("e-world", check_e_world),
    ("f", check_f),
]


def worker(rank: int, world: int, port: int, tmp: str, out: str | None):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp.load(no_dist=True)
    if out is not None:  # self-spawned
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    count_comms()
    ctx = Ctx()
    ctx.keep["tmp"] = tmp
    results = []
    only = [x for x in os.environ.get("PROBE_ONLY", "").split(",") if x]
    for name, fn in CHECKS:
        if only and not any(name.startswith(x) for x in only):
            fn = skipped
        t0 = time.perf_counter()
        try:
            ok, detail = fn(ctx)
        except Exception as e:  # noqa: BLE001 - the probe reports, never stops
            ok, detail = False, first_line(e)
            if os.environ.get("PROBE_TRACE"):
                traceback.print_exc()
        results.append((name, bool(ok), detail, time.perf_counter() - t0))
        if out is not None:
            with open(os.path.join(out, f"rank{rank}.txt"), "a") as f:
                f.write(repr(results[-1]) + "\n")
        dist.barrier()
    if out is None:
        everyone = [None] * world
        dist.all_gather_object(everyone, results)
        if rank == 0:
            report(everyone)
    dist.destroy_process_group()


def report(per_rank: list[list[tuple] | None]) -> None:
    print(f"torch {torch.__version__}, gloo, {WORLD} CPU ranks, mesh (dp={DP}, pp={PP})")
    for i, (name, _) in enumerate(CHECKS):
        rows = [(r, res[i]) for r, res in enumerate(per_rank) if res is not None and i < len(res)]
        if len(rows) < WORLD:
            print(f"FAIL {name}: no result from ranks {sorted(set(range(WORLD)) - {r for r, _ in rows})} "
                  f"(hung or died)")
            continue
        bad = [(r, row) for r, row in rows if not row[1]]
        secs = max(row[3] for _, row in rows)
        if bad:
            r, row = bad[0]
            print(f"FAIL {name} (rank {r}, {secs:.1f}s): {row[2]}")
        elif any(row[2].startswith("skipped") for _, row in rows):
            continue
        else:  # the first rank's detail on the line, other ranks' below where they differ
            seen = {}
            for r, row in rows:
                if row[2] != "sent":
                    seen.setdefault(row[2], r)
            details = list(seen.items())
            print(f"PASS {name} ({secs:.1f}s): {details[0][0]}")
            for d, r in details[1:]:
                print(f"       rank {r}: {d}")


def main():
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        assert int(os.environ["WORLD_SIZE"]) == WORLD, f"needs {WORLD} ranks"
        # every rank must name the same checkpoint folder
        tmp = os.environ.get("PROBE_TMP") or os.path.join(tempfile.gettempdir(),
                                                          f"probe_fsdp2-{os.environ.get('MASTER_PORT', '0')}")
        worker(int(os.environ["RANK"]), WORLD, 0, tmp, None)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results")
        os.makedirs(out)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, WORLD, port, tmp, out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.time() + float(os.environ.get("PROBE_TIMEOUT", 300))
        for p in procs:
            p.join(max(1.0, deadline - time.time()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
        per_rank = []
        for r in range(WORLD):
            f = os.path.join(out, f"rank{r}.txt")
            per_rank.append([ast.literal_eval(line) for line in open(f)] if os.path.exists(f) else [])
        report(per_rank)
        sys.exit(0 if all(len(x) == len(CHECKS) for x in per_rank) else 1)


if __name__ == "__main__":
    main()
