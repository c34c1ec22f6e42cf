"""Expert parallelism (`parallel.ep` = P > 1): the experts of every MoE layer spread over the P
data-parallel replicas of a pipeline position that form one expert-parallel group (P
consecutive replicas; `dynmo.runtime.dist` makes the groups).

A layer is built whole, as without expert parallelism (same seeds, same weights), and then
keeps only this rank's experts as rows of the stacked expert weights (`localize`). Which rank
holds which expert is the layer's *placement*: an order of the num_experts experts, read rank
by rank and slot by slot, so rank q holds experts order[q*L .. (q+1)*L - 1] (L = num_experts /
P) as its rows 0 .. L-1. The start is the contiguous order 0, 1, ..., N-1; `apply_placement`
moves experts to another order while training (every rank keeps L experts; no copies). The
group's handle (`ExpertGroup`, the experts module's `ep` attribute) holds every MoE layer's
order by layer name, the same on every rank; the experts module keeps its own order and each
expert's position (`order`, `position`), through which the model's MoE forward
(`dynmo.model.moe.dispatch_ep`) routes tokens by all-to-all; the model never imports the
runtime.

Gradients: an expert's gradient on its rank already sums the contributions of the P replicas
of its group (the all-to-all's backward brought them back); `grads.sync_data_parallel` sums it
over the dp/P replicas that hold the same experts and divides by dp, so the update is the mean
over the replicas, as without expert parallelism. Every other gradient is averaged over the
whole data-parallel group as before.

Checkpoints store each expert parameter (and its AdamW state) whole, under the whole tensor's
key, with the experts in index order (`whole`: gathered over the group by index, whatever the
placement), and a load scatters each rank's rows back from it (`scatter`): a checkpoint
resumes under any `parallel.ep` and placement, and `dynmo export` reads the same keys as
without expert parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

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
                 orders: dict[str, tuple[int, ...]] | None = None):
        self.size, self.rank, self.group = size, rank, group
        self.wire = torch.float32 if backend == "gloo" else None
        # every MoE layer's placement by layer name (absent: the contiguous one), the same on all ranks
        self.orders: dict[str, tuple[int, ...]] = dict(orders or {})

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[size, E]: every rank's `counts` [E] (an all-gather; no gradient)."""
        parts = [torch.empty_like(counts) for _ in range(self.size)]
        dist.all_gather(parts, counts.contiguous(), group=self.group)
        return torch.stack(parts).cpu()

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return _AllToAll.apply(x, send, recv, self.group, self.wire)


def group_of(ctx: DistContext, orders: dict[str, tuple[int, ...]] | None = None) -> ExpertGroup | None:
    """This rank's expert-parallel handle (holding the placements `orders`), or None without
    expert parallelism."""
    if ctx.ep <= 1:
        return None
    return ExpertGroup(ctx.ep, ctx.ep_rank, ctx.ep_group, ctx.backend, orders)


def contiguous(num_experts: int) -> tuple[int, ...]:
    """The starting placement: rank q holds experts q*L .. (q+1)*L - 1."""
    return tuple(range(num_experts))


def check_order(order, num_experts: int, ranks: int) -> tuple[int, ...]:
    """`order` as a placement of `num_experts` experts over `ranks` ranks, or ValueError."""
    order = tuple(int(e) for e in order)
    if sorted(order) != list(range(num_experts)):
        raise ValueError(f"placement {list(order)} is not an order of the {num_experts} experts 0..{num_experts - 1}")
    if num_experts % ranks:
        raise ValueError(f"{num_experts} experts do not divide over {ranks} ranks")
    return order


def set_order(mod: nn.Module, order: tuple[int, ...]) -> None:
    """Record an experts module's placement (its rows must be, or be about to become, those of
    its rank under it)."""
    mod.order = order
    pos = torch.empty(len(order), dtype=torch.long)
    pos[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    mod.position = pos  # expert -> its position (rank * L + slot) in the group


def local_experts(mod: nn.Module) -> list[int]:
    """The experts a localized experts module holds, row by row."""
    L = len(mod.order) // mod.ep.size
    return list(mod.order[mod.ep.rank * L : (mod.ep.rank + 1) * L])


def localize(layer: nn.Module, ep: ExpertGroup | None, name: str | None = None) -> nn.Module:
    """Keep only this rank's experts of every MoE module of `layer` (rows of each stacked expert
    weight), in place, under the placement the group's handle holds for layer `name` (the
    contiguous one if none), and hand the experts modules the handle. No-op when `ep` is None."""
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
                order = ep.orders.get(name, contiguous(n)) if order is None else order
                k = n // ep.size
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
    parameter `name` of `layer`, or of its AdamW state): gathered over the expert-parallel group
    and put in place by expert index. Collective over the group; every rank gets the same
    tensor. Anything that is not an expert parameter's rows comes back as it is."""
    mod = _held(layer, name, value)
    if mod is None:
        return value
    ep = mod.ep
    parts = [torch.empty_like(value) for _ in range(ep.size)]
    dist.all_gather(parts, value.contiguous(), group=ep.group)
    out = value.new_empty((value.shape[0] * ep.size, *value.shape[1:]))
    out[torch.tensor(mod.order, device=value.device)] = torch.cat(parts)
    return out


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
    experts, rank by rank, slot by slot): {(source rank, destination rank): [(expert, source
    slot, destination slot), ...]}, each list in destination slot order. Pairs with source =
    destination are the experts that stay on their rank (maybe in another slot); every other
    pair's experts travel. Pure; the same on every rank."""
    old, new = tuple(old), tuple(new)
    if sorted(old) != sorted(new) or len(set(old)) != len(old):
        raise ValueError(f"placements {list(old)} and {list(new)} are not orders of the same experts")
    L = len(old) // ranks
    where = {e: divmod(p, L) for p, e in enumerate(old)}
    out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for p, e in enumerate(new):
        dst, dslot = divmod(p, L)
        src, sslot = where[e]
        out.setdefault((src, dst), []).append((e, sslot, dslot))
    return out


def moved_experts(old, new, ranks: int) -> list[int]:
    """The experts whose rank changes between placements `old` and `new`."""
    return sorted(e for (a, b), rows in plan_moves(old, new, ranks).items() if a != b for e, _, _ in rows)


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
            order = check_order(new[name], len(mod.order), ep.size)
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
