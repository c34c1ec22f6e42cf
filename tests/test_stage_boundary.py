"""What crosses a stage boundary (`dynmo.runtime.stage`): floating tensors only, every one
differentiable and every one given a gradient back, so torch.distributed.pipelining hands it
over on every torch release the project admits (2.7 on), not only on 2.13.

torch before 2.13 makes each receive buffer of a non-first stage require a gradient
(`buffer.requires_grad_(True)`: an error on a bool tensor), sends a gradient back for every
received tensor (an error where there is none), and its zero-bubble schedules differentiate
every output of a stage (`torch.autograd.grad(outputs, inputs)`: an error on an output outside
the graph or an input the stage does not use). `older_torch_split` does the same to two
StageModules on one process, so these tests run on whichever torch is installed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dynmo.config import EarlyExitConfig, load_config
from dynmo.dynamics.earlyexit import install_gate
from dynmo.model.gpt import loss_fn
from dynmo.model.layers import build_layer, half_carry, layer_specs
from dynmo.runtime.stage import StageModule, TimedPipelineStage, boundary_bools, example_io

MB, T, D, V = 2, 16, 32, 64


def tiny(block: str, unit: str, early_exit: bool = False):
    cfg = load_config(None, [
        "--model.block", block, "--model.n_layers", "2", "--model.d_model", str(D), "--model.n_heads", "2",
        "--model.seq_len", str(T), "--model.vocab_size", str(V), "--model.mod.capacity", "0.5",
        "--parallel.unit", unit, "--early_exit.enabled", str(early_exit).lower(),
    ])
    specs = layer_specs(cfg.model, unit)
    layers = [build_layer(s, cfg.model, 7) for s in specs]
    if early_exit:  # what the early-exit case installs: active tokens only, the block input handed on
        for s, layer in zip(specs, layers):
            if s.letter in "tam":
                install_gate(layer, EarlyExitConfig(), can_exit=False)
    return cfg, specs, layers


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, V, (MB, T + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def module(layers, idx, dtype, **kw):
    return StageModule([f"l{i}" for i in idx], [layers[i] for i in idx], idx, dtype=dtype, **kw)


def whole_model(layers, dtype):
    """Loss and parameter gradients of the model as one stage (no boundary)."""
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x, y = batch()
    loss = loss_fn(module(layers, list(range(len(layers))), dtype)(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for layer in layers for p in layer.parameters() if p.grad is not None]


def older_torch_split(layers, cut: int, carry: tuple[str, ...], dtype):
    """The model as two stages split before layer `cut`, handed over as torch 2.7 to 2.12 do."""
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    n = len(layers)
    first = module(layers, list(range(cut)), dtype, sends=True)
    second = module(layers, list(range(cut, n)), dtype, received=boundary_bools(carry))
    x, y = batch()
    out = first(x)
    sent = out if isinstance(out, tuple) else (out,)
    ins, outs = example_io(False, False, MB, T, D, V, torch.device("cpu"), dtype, carry_in=carry, carry_out=carry)
    assert [(t.shape, t.dtype) for t in sent] == [(t.shape, t.dtype) for t in outs]  # what the stage declares
    # receive buffers: every one requires a gradient
    bufs = [torch.empty(t.shape, dtype=t.dtype).copy_(s.detach()).requires_grad_(True) for t, s in zip(ins, sent)]
    loss = loss_fn(second(*bufs), y)
    params = [p for i in range(cut, n) for p in layers[i].parameters() if p.requires_grad]
    # zero-bubble input backward: a gradient for every received tensor, none left unused
    grads = torch.autograd.grad(loss, bufs, retain_graph=True)
    assert all(g is not None and g.shape == b.shape and g.dtype == b.dtype for g, b in zip(grads, bufs))
    loss.backward(inputs=params)
    # the previous stage takes the gradients of all its outputs (the zero-bubble way: autograd.grad
    # over every output, which fails on one outside the graph), then its weights' gradients
    first_params = [p for i in range(cut) for p in layers[i].parameters() if p.requires_grad]
    assert all(t.grad_fn is not None for t in sent)
    torch.autograd.backward(sent, grads, inputs=first_params)
    return loss.detach(), [p.grad.clone() for layer in layers for p in layer.parameters() if p.grad is not None]


CASES = [  # (block, unit, early exit, where the boundary falls)
    ("dense", "block", False, 2),  # hidden state and mask
    ("mod", "sublayer", False, 2),  # between a Mixture-of-Depths block's halves: route and chosen too
    ("dense", "sublayer", True, 2),  # between a block's halves under early exit: the block input too
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,unit,early_exit,cut", CASES)
def test_boundary_crosses_as_older_torch_hands_it_over_with_the_same_results(block, unit, early_exit, cut, dtype):
    cfg, specs, layers = tiny(block, unit, early_exit)
    carry = half_carry(cfg) if specs[cut - 1].part == "attn" else ()
    assert (len(carry) > 0) == (unit == "sublayer")
    loss, grads = older_torch_split(layers, cut, carry, dtype)
    ref_loss, ref_grads = whole_model(layers, dtype)
    assert torch.equal(loss, ref_loss)  # bitwise: the boundary moves no rounding
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


def test_every_boundary_example_is_floating_and_requires_a_gradient():
    for carry in [(), ("route", "chosen"), ("block_input",), ("route", "chosen", "block_input")]:
        ins, outs = example_io(False, False, MB, T, D, V, torch.device("cpu"), torch.bfloat16,
                               carry_in=carry, carry_out=carry)
        for t in ins + outs:
            assert t.dtype == torch.bfloat16 and t.requires_grad
            t.detach().requires_grad_(True)  # what torch before 2.13 does to a receive buffer
        assert boundary_bools(carry)[:2] == (False, True)
        assert len(boundary_bools(carry)) == len(ins)


def test_stages_on_one_rank_open_no_link_to_themselves():
    """torch 2.9 to 2.11 open the links to the neighbouring stages before the first step, a send
    to itself where the neighbour is on the same rank: gloo cannot make one."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    if not hasattr(TimedPipelineStage.__mro__[1], "_get_init_p2p_neighbors_ops"):
        pytest.skip("this torch has no such warm-up")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg, specs, layers = tiny("dense", "block")
        stages = []
        for s, idx in enumerate([[0, 1], [2, 3]]):
            ins, outs = example_io(s == 0, s == 1, MB, T, D, V, torch.device("cpu"))
            stages.append(TimedPipelineStage(module(layers, idx, torch.float32), s, 2, torch.device("cpu"),
                                             input_args=ins, output_args=outs))
        for st in stages:
            st.stage_index_to_group_rank = {0: 0, 1: 0}
            assert st._get_init_p2p_neighbors_ops() == []
    finally:
        dist.destroy_process_group()
