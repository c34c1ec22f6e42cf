"""Expert parallelism (`parallel.ep` = P > 1): the experts of every MoE layer spread over the P
data-parallel replicas of a pipeline position that form one expert-parallel group (P
consecutive replicas; `dynmo.runtime.dist` makes the groups).

A layer is built whole, as without expert parallelism (same seeds, same weights), and then
keeps only this rank's experts as rows of the stacked expert weights (`localize`). Which rank
holds which expert is the layer's *placement*: an order of the experts read rank by rank and
slot by slot, K = num_experts / P + S slots a rank (S = `parallel.expert_slots`), so rank q
holds experts order[q*K .. (q+1)*K - 1] as its rows 0 .. K-1. With S > 0 some experts sit on
several ranks: *copies* of hot experts, which share that expert's tokens evenly (each source
replica splits its tokens for the expert into equal runs, one per copy, in routing order);
every expert is held somewhere and no rank holds one twice (`dynmo.balance.experts.check_order`).
The start is `dynmo.balance.experts.start_order` (contiguous, the extra slots holding the
experts that follow); `apply_placement` moves experts to another order while training. The
group's handle (`ExpertGroup`, the experts module's `ep` attribute) holds every MoE layer's
order by layer name, the same on every rank; the experts module keeps its own order and each
expert's holders (`order`, `holders`, `copies`), through which the model's MoE forward
(`dynmo.model.moe.dispatch_ep`) routes tokens by all-to-all; the model never imports the
runtime.

Gradients: an expert's gradient on its rank already sums the contributions of the rows it
computed (the all-to-all's backward brought them back); `grads.sync_data_parallel` sums it over
the dp/P replicas that hold the same experts and divides by dp, so the update is the mean over
the replicas, as without expert parallelism; then the copies of an expert sum theirs over the
group (`reduce_copies`: every copy, in every group, then holds the whole expert's gradient,
bitwise the same, so the copies take the same AdamW step and stay equal; the order is why, see
`sync_data_parallel`).
Every other gradient is averaged over the whole data-parallel group as before. The gradient
norm counts each expert once (its first holder's rows, `first_rows`).

Checkpoints store each expert parameter (and its AdamW state) whole, under the whole tensor's
key, with the experts in index order (`whole`: gathered over the group, each expert from its
first holder, whatever the placement), and a load scatters each rank's rows back from it
(`scatter`): a checkpoint resumes under any `parallel.ep` and `parallel.expert_slots`, and
`dynmo export` reads the same keys as without expert parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dynmo.balance.experts import check_order, start_order
from dynmo.runtime.dist import DistContext


def is_expert_param(name: str) -> bool:
    """Whether parameter `name` (of a layer) is one of the stacked expert weights."""
    return ".experts." in f".{name}"


def expert_modules(layer: nn.Module) -> list[nn.Module]:
    """The stacked-experts modules of a layer (none for a layer without experts)."""
    return [m for n, m in layer.named_modules() if n.split(".")[-1] == "experts" and any(True for _ in m.parameters())]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its transpose as the backward: rows `send[q]` go to rank q,
    `recv[q]` come from rank q."""

    @staticmethod
    def forward(ctx, x, send, recv, group, wire):
        ctx.send, ctx.recv, ctx.group, ctx.wire = send, recv, group, wire
        return _exchange(x, send, recv, group, wire)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.recv, ctx.send, ctx.group, ctx.wire), None, None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group, wire: torch.dtype | None) -> torch.Tensor:
    dtype = x.dtype
    if wire is not None and dtype != wire:
        x = x.to(wire)  # gloo's all-to-all takes no bfloat16: float32 carries it losslessly
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out.to(dtype)


class ExpertGroup:
    """What the MoE forward needs of the expert-parallel group: its size, this rank's index,
    every rank's per-expert counts, and an autograd all-to-all."""

    def __init__(self, size: int, rank: int, group: dist.ProcessGroup, backend: str,
                 orders: dict[str, tuple[int, ...]] | None = None, slots: int = 0):
        self.size, self.rank, self.group = size, rank, group
        self.slots = slots  # parallel.expert_slots: slots a rank has beyond num_experts / size
        self.wire = torch.float32 if backend == "gloo" else None
        # every MoE layer's placement by layer name (absent: its start, `start`), the same on all ranks
        self.orders: dict[str, tuple[int, ...]] = dict(orders or {})

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[size, E]: every rank's `counts` [E] (an all-gather; no gradient)."""
        parts = [torch.empty_like(counts) for _ in range(self.size)]
        dist.all_gather(parts, counts.contiguous(), group=self.group)
        return torch.stack(parts).cpu()

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return _AllToAll.apply(x, send, recv, self.group, self.wire)

    def start(self, num_experts: int) -> tuple[int, ...]:
        """The placement a layer starts from (`dynmo.balance.experts.start_order`)."""
        return start_order(num_experts, self.size, self.slots)

    def order(self, name: str, num_experts: int) -> tuple[int, ...]:
        """Layer `name`'s placement now."""
        return self.orders.get(name) or self.start(num_experts)


def group_of(ctx: DistContext, orders: dict[str, tuple[int, ...]] | None = None, slots: int = 0) -> ExpertGroup | None:
    """This rank's expert-parallel handle (holding the placements `orders`; `slots` extra slots a
    rank), or None without expert parallelism."""
    if ctx.ep <= 1:
        return None
    return ExpertGroup(ctx.ep, ctx.ep_rank, ctx.ep_group, ctx.backend, orders, slots)


def set_order(mod: nn.Module, order: tuple[int, ...]) -> None:
    """Record an experts module's placement (its rows must be, or be about to become, those of
    its rank under it): per expert, the positions (rank * K + slot) of its copies in order
    (`holders`, padded with -1) and how many (`copies`)."""
    mod.order = tuple(order)
    n = len(set(order))
    where: list[list[int]] = [[] for _ in range(n)]
    for p, e in enumerate(order):
        where[e].append(p)
    most = max(len(w) for w in where)
    mod.holders = torch.tensor([w + [-1] * (most - len(w)) for w in where], dtype=torch.long)
    mod.copies = torch.tensor([len(w) for w in where], dtype=torch.long)
    mod.copied = tuple(e for e, w in enumerate(where) if len(w) > 1)  # the experts with copies, by index


def num_experts(mod: nn.Module) -> int:
    """The experts of a localized experts module's layer (all ranks together)."""
    return int(mod.copies.numel())


def local_experts(mod: nn.Module) -> list[int]:
    """The experts a localized experts module holds, row by row."""
    K = len(mod.order) // mod.ep.size
    return list(mod.order[mod.ep.rank * K : (mod.ep.rank + 1) * K])


def first_rows(mod: nn.Module) -> tuple[list[int], list[int]]:
    """(rows, experts): this rank's rows that hold their expert's first copy, and those experts
    (so that a sum over the group counts every expert once)."""
    K = len(mod.order) // mod.ep.size
    base = mod.ep.rank * K
    rows = [j for j in range(K) if int(mod.holders[mod.order[base + j], 0]) == base + j]
    return rows, [mod.order[base + j] for j in rows]


def localize(layer: nn.Module, ep: ExpertGroup | None, name: str | None = None) -> nn.Module:
    """Keep only this rank's experts of every MoE module of `layer` (rows of each stacked expert
    weight), in place, under the placement the group's handle holds for layer `name` (the
    start if none), and hand the experts modules the handle. No-op when `ep` is None."""
    if ep is None:
        return layer
    for mod in expert_modules(layer):
        if getattr(mod, "ep", None) is not None:
            continue  # already this rank's experts
        order = None
        for sub in mod.modules():
            for pname, p in list(sub.named_parameters(recurse=False)):
                n = p.shape[0]
                if n % ep.size:
                    raise ValueError(f"{n} experts do not divide over parallel.ep={ep.size} ranks")
                order = ep.order(name, n) if order is None else order
                k = len(order) // ep.size
                keep = torch.tensor(order[ep.rank * k : (ep.rank + 1) * k], device=p.device)
                rows = p.detach().index_select(0, keep).clone()
                setattr(sub, pname, nn.Parameter(rows, requires_grad=p.requires_grad))
        mod.ep = ep
        set_order(mod, order)
    return layer


def rebind(layer: nn.Module, ep: ExpertGroup) -> None:
    """Hand a localized layer's experts modules a new group's handle (after a re-pack)."""
    for mod in expert_modules(layer):
        mod.ep = ep


def params_per_expert(specs, model) -> int:
    """Parameters of one expert of the model's MoE layers (0 without experts), from a block
    built on the meta device."""
    from dynmo.model.layers import layer_class, tag_layer

    with torch.device("meta"):
        for spec in specs:
            if spec.is_block and spec.part != "attn":
                mods = expert_modules(tag_layer(layer_class(spec, model)(model), spec))
                if mods:
                    return sum(p.numel() for m in mods for p in m.parameters()) // model.moe.num_experts
    return 0


def module_of(layer: nn.Module, pname: str) -> nn.Module:
    """The experts module that parameter `pname` of `layer` belongs to."""
    head, _, _ = f".{pname}".rpartition(".experts.")
    return layer.get_submodule((head[1:] + ".experts") if head else "experts")


def whole(layer: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """The whole tensor, experts in index order, of `value` (this rank's rows of expert
    parameter `name` of `layer`, or of its AdamW state): gathered over the expert-parallel group,
    each expert from its first copy. Collective over the group; every rank gets the same
    tensor. Anything that is not an expert parameter's rows comes back as it is."""
    mod = _held(layer, name, value)
    if mod is None:
        return value
    ep = mod.ep
    parts = [torch.empty_like(value) for _ in range(ep.size)]
    dist.all_gather(parts, value.contiguous(), group=ep.group)
    return torch.cat(parts).index_select(0, mod.holders[:, 0].to(value.device))


def whole_shape(layer: nn.Module, name: str, value: torch.Tensor) -> tuple[int, ...]:
    """The shape `whole` gives for `value` (this rank's rows of an expert parameter)."""
    return (num_experts(_held(layer, name, value)), *value.shape[1:])


def scatter(layer: nn.Module, name: str, full: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's rows of the whole tensor `full` (experts in index order) into `value`."""
    mod = _held(layer, name, value)
    with torch.no_grad():
        value.copy_(full.index_select(0, torch.tensor(local_experts(mod), device=full.device)))


def _held(layer: nn.Module, name: str, value: torch.Tensor) -> nn.Module | None:
    """The experts module whose rows `value` (of parameter `name`) is, or None."""
    if value.dim() == 0 or not is_expert_param(name):
        return None
    mod = module_of(layer, name)
    return mod if getattr(mod, "ep", None) is not None else None


def is_held(layer: nn.Module, name: str, value: torch.Tensor) -> bool:
    """Whether `value` is this rank's rows of an expert parameter (stored whole by `whole`)."""
    return _held(layer, name, value) is not None


# ---- moving experts between the ranks of the group ---------------------------------------------

def plan_moves(old, new, ranks: int) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """Which rows go where when a layer's placement changes from `old` to `new` (orders of the
    experts, rank by rank, slot by slot; an expert may have copies): {(source rank, destination
    rank): [(expert, source slot, destination slot), ...]}, each list in destination slot order.
    A destination that already holds the expert keeps its row (source = destination, maybe
    another slot); any other copy comes from the expert's first holder under `old` (copies are
    equal). Pure; the same on every rank."""
    old, new = tuple(old), tuple(new)
    if set(old) != set(new) or len(old) % ranks or len(new) % ranks:
        raise ValueError(f"placements {list(old)} and {list(new)} are not placements of the same experts")
    ko, kn = len(old) // ranks, len(new) // ranks
    if ko != kn:
        raise ValueError(f"placements {list(old)} and {list(new)} give a rank {ko} and {kn} slots")
    held: dict[int, dict[int, int]] = {}  # expert -> {rank: slot} under old
    for p, e in enumerate(old):
        held.setdefault(e, {}).setdefault(p // ko, p % ko)
    out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for p, e in enumerate(new):
        dst, dslot = divmod(p, kn)
        src = dst if dst in held[e] else min(held[e])
        out.setdefault((src, dst), []).append((e, held[e][src], dslot))
    return out


def moved_experts(old, new, ranks: int) -> list[int]:
    """The experts that arrive on a rank that did not hold them between placements `old` and `new`
    (once each, however many ranks they arrive on)."""
    return sorted({e for (a, b), rows in plan_moves(old, new, ranks).items() if a != b for e, _, _ in rows})


def apply_placement(layers: dict[int, nn.Module], names: dict[int, str], optimizer, ep: ExpertGroup,
                    new: dict[str, tuple[int, ...]]) -> int:
    """Move this rank's experts to the placements `new` ({layer name: order}; layers not named
    keep theirs): each expert whose rank changes travels point to point within the group with
    its weights, gradient (if any) and AdamW state (exp_avg, exp_avg_sq; the step count is the
    same for every row of a tensor and is checked to agree); an expert that stays may change
    slot. Rows are rewritten in place, so the parameters, and the optimizer's hold on them, stay
    the same objects. Updates `ep.orders`. Collective over the group (its ranks hold the same
    layers); returns the bytes this rank received."""
    state = optimizer.state if optimizer is not None else {}
    # every tensor with expert rows, in one order on every rank of the group
    jobs = []  # (tensor [L, ...], plan)
    steps = []  # (parameter name, step tensor)
    changed: list[tuple[nn.Module, tuple[int, ...]]] = []
    for i in sorted(layers):
        name = names[i]
        if name not in new:
            continue
        for mod in expert_modules(layers[i]):
            if getattr(mod, "ep", None) is None:
                continue
            order = check_order(new[name], num_experts(mod), ep.size)
            if len(order) != len(mod.order):
                raise ValueError(f"placement {list(order)} of {name} gives a rank {len(order) // ep.size} slots; it has "
                                 f"{len(mod.order) // ep.size} (parallel.expert_slots)")
            plan = plan_moves(mod.order, order, ep.size)
            for pname, p in mod.named_parameters():
                st = state.get(p)
                jobs.append((p.data, plan))
                if p.grad is not None:
                    jobs.append((p.grad, plan))
                if st:
                    jobs += [(st["exp_avg"], plan), (st["exp_avg_sq"], plan)]
                    steps.append((f"{name}.{pname}", st["step"]))
            changed.append((mod, order))
    me = ep.rank
    sends: dict[int, list[torch.Tensor]] = {}
    recv_sizes: dict[int, int] = {}
    for t, plan in jobs:
        row = t[0].numel() * t.element_size()
        for (src, dst), rows in plan.items():
            if src == me and dst != me:
                idx = torch.tensor([s for _, s, _ in rows], device=t.device)
                sends.setdefault(dst, []).append(t.index_select(0, idx).contiguous().view(-1).view(torch.uint8))
            elif dst == me and src != me:
                recv_sizes[src] = recv_sizes.get(src, 0) + row * len(rows)
    dev = jobs[0][0].device if jobs else torch.device("cpu")
    if steps:  # the step counts travel too, after the rows: every row of a tensor stepped as often
        mine = torch.stack([s.detach().float().reshape(()) for _, s in steps]).to(dev)
        for q in sends:
            sends[q].append(mine.contiguous().view(torch.uint8))
        for q in recv_sizes:
            recv_sizes[q] += mine.numel() * mine.element_size()
    ranks = dist.get_process_group_ranks(ep.group)
    bufs = {q: torch.empty(n, dtype=torch.uint8, device=dev) for q, n in recv_sizes.items()}
    ops = [dist.P2POp(dist.isend, torch.cat(parts), ranks[q], ep.group) for q, parts in sorted(sends.items())]
    ops += [dist.P2POp(dist.irecv, bufs[q], ranks[q], ep.group) for q in sorted(bufs)]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    offs = dict.fromkeys(bufs, 0)
    for t, plan in jobs:
        out = torch.empty_like(t)
        row = t[0].numel() * t.element_size()
        for (src, dst), rows in plan.items():
            if dst != me:
                continue
            didx = torch.tensor([d for _, _, d in rows], device=t.device)
            if src == me:
                vals = t.index_select(0, torch.tensor([s for _, s, _ in rows], device=t.device))
            else:
                n = row * len(rows)
                vals = bufs[src][offs[src] : offs[src] + n].view(t.dtype).view(len(rows), *t.shape[1:])
                offs[src] += n
            out.index_copy_(0, didx, vals)
        t.copy_(out)
    for q, buf in bufs.items():  # the sender's step counts must be this rank's
        if not steps:
            continue
        theirs, mine = buf[offs[q]:].view(torch.float32), torch.stack([s.detach().float().reshape(()) for _, s in steps]).to(dev)
        if not torch.equal(theirs, mine):
            bad = [n for (n, _), a, b in zip(steps, theirs.tolist(), mine.tolist()) if a != b]
            raise RuntimeError(f"expert re-placement: the AdamW step counts of {bad[:3]} differ between ranks")
    for mod, order in changed:
        set_order(mod, order)
    ep.orders.update({n: tuple(o) for n, o in new.items()})  # every layer's, held here or not
    return sum(b.numel() for b in bufs.values())


# ---- the copies of an expert share one gradient -----------------------------------------------

def reduce_copies(layers: dict[int, nn.Module]) -> None:
    """Sum the gradients of every copied expert over its copies (one flat all-reduce over the
    expert-parallel group, in one order on every rank: layers, parameters, experts by index), so
    each copy holds the gradient of all the expert's tokens, bitwise the same on every copy. Call
    after the data-parallel reduction (`grads.sync_data_parallel` says why); no-op without
    copies. Collective over the group (its ranks hold the same layers)."""
    jobs = []  # (gradient [K, ...], this rank's rows of copied experts, their index among the copied)
    ep = None
    for i in sorted(layers):
        for mod in expert_modules(layers[i]):
            if getattr(mod, "ep", None) is None or not mod.copied:
                continue
            ep = mod.ep
            copied = mod.copied
            index = {e: k for k, e in enumerate(copied)}
            mine = local_experts(mod)
            rows = [(j, index[e]) for j, e in enumerate(mine) if e in index]
            for p in mod.parameters():
                if p.grad is not None:
                    jobs.append((p.grad, rows, len(copied)))
    if not jobs:
        return
    dev = jobs[0][0].device
    bufs = []
    for g, rows, n in jobs:
        b = g.new_zeros((n, *g.shape[1:]))
        if rows:
            b.index_copy_(0, torch.tensor([k for _, k in rows], device=dev),
                          g.index_select(0, torch.tensor([j for j, _ in rows], device=dev)))
        bufs.append(b.reshape(-1))
    flat = torch.cat(bufs)
    dist.all_reduce(flat, group=ep.group)
    off = 0
    for (g, rows, n), b in zip(jobs, bufs):
        summed = flat[off: off + b.numel()].view(n, *g.shape[1:])
        off += b.numel()
        if rows:
            g.index_copy_(0, torch.tensor([j for j, _ in rows], device=dev),
                          summed.index_select(0, torch.tensor([k for _, k in rows], device=dev)))
