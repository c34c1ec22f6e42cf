"""`train.compile`: every placement unit (embedding, block or half block, head) compiled on its
own, as torchtitan compiles per block.

What is compiled is the unit's `forward`, not its whole call: the module hooks that dynmo's
techniques and the noise injector attach (early exit's gate, freezing's probes, injected
delays) stay eager around it, and the stage's per-layer marks stay outside, so the profiler
times each compiled unit as it times an eager one. The unit stays the same module with the same
parameters and state dict, so checkpoints, migrations and optimizer state see no difference.

- `fullgraph=True` for every block kind: a graph break is an error, not a silent slowdown.
  The one exception is an expert-parallel MoE layer: its all-to-all exchanges row counts read
  on the host (`all_to_all_single`'s split sizes are Python ints), which no graph can hold,
  so it compiles with graph breaks around the exchange.
- `dynamic=False`: the shapes inside a unit are fixed by the config (fixed-capacity routing,
  fixed microbatch), so each unit compiles once. Units of one class share their compiled code
  where their settings agree; a unit that arrives on a rank by migration (built fresh, then
  compiled here) reuses it instead of compiling again (`tests/test_compile.py` counts).
- The compile cache of one class holds one entry per distinct setting (a Mixture-of-Depths
  capacity, a frozen block's `requires_grad`), so its limit is raised to `CACHE_LIMIT`.
- What a module needs settled before its graph is traced, it does in `before_compile(dtype)`,
  called here on every submodule that has one: the grouped expert matmul's capability probe
  (`dynmo.model.grouped`; a probe cannot run inside a graph), a Mixture-of-Depths block's
  capacity (a number in the graph, so blocks of one capacity share it), and a block that computes only
  its active tokens (early exit), which reads how many rows to gather in a forward pre-hook,
  outside the graph, rounds them up to a multiple of seq_len / `SkipsInactive.WIDTH_BUCKETS`:
  the graph sees a Python int and compiles once per width, at most WIDTH_BUCKETS + 1 of them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

CACHE_LIMIT = 64


def _raise_cache_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name since torch 2.6, and before
        if hasattr(cfg, name) and getattr(cfg, name) < CACHE_LIMIT:
            setattr(cfg, name, CACHE_LIMIT)


def is_compiled(unit: nn.Module) -> bool:
    return "forward" in vars(unit)


def compile_unit(unit: nn.Module, dtype: torch.dtype, backend: str = "inductor",
                 split_backward: bool = False, cuda_graphs: bool = False) -> nn.Module:
    """Compile `unit`'s forward in place (a no-op if it already is) and return the unit.
    `split_backward`: the schedule runs each backward in two passes, input gradient then weight
    gradient (the zero-bubble ones), the first with retain_graph=True, which a compiled backward
    that donates its saved buffers refuses ("compiled with non-empty donated buffers"): donation
    is turned off for the process (its one schedule). `cuda_graphs` (`train.cuda_graphs`): the
    unit's forward and backward kernels are recorded once and replayed as CUDA graphs
    (`mode="reduce-overhead"`, Inductor's CUDA graph trees: inputs copied into static buffers,
    one graph per call site of a step, so each microbatch in flight has its own); the step
    marks its start (`mark_step`)."""
    if split_backward and hasattr(torch._functorch.config, "donated_buffer"):
        torch._functorch.config.donated_buffer = False
    if is_compiled(unit):
        return unit
    _raise_cache_limit()
    for m in unit.modules():
        prepare = getattr(m, "before_compile", None)
        if prepare is not None:
            prepare(dtype)
    expert_parallel = any(getattr(m, "ep", None) is not None for m in unit.modules())
    mode = "reduce-overhead" if cuda_graphs else None
    unit.forward = torch.compile(unit.forward, fullgraph=not expert_parallel, dynamic=False, backend=backend, mode=mode)
    return unit


def mark_step() -> None:
    """A training step begins: CUDA graph trees may reuse the buffers of the last step's replays
    (`train.cuda_graphs`), whose outputs are no longer read."""
    torch.compiler.cudagraph_mark_step_begin()


def eager(unit: nn.Module) -> nn.Module:
    """Undo `compile_unit` (the unit's class forward again)."""
    vars(unit).pop("forward", None)
    vars(unit).pop("width_buckets", None)  # what `before_compile` set on a skipping block
    return unit
