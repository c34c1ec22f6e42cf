"""Linear layers whose weight runs under a fixed sparsity mask, with one of two kernels.

    dense  masked dense matmul, `F.linear(x, W * mask, b)`: cost independent of density;
           pruned entries get zero gradients because the mask multiplies the weight.
    csr    torch sparse CSR: y = W_csr x (cost ~ nnz), grad x = W^T_csr g, grad W only at the
           nnz positions (`torch.sparse.sampled_addmm`), scattered into the *dense* weight's
           gradient. The optimizer keeps dense values (AdamW cannot step a CSR tensor); the
           CSR view is rebuilt from them in every forward (a gather of nnz values).

Both kernels compute the same function; which one is faster depends on density and machine,
so the caller chooses (`time_kernels` measures both).

`set_mask(parent, "attn.qkv", mask, kernel)` replaces the Linear named "attn.qkv" in `parent` by
a `PrunedLinear` that holds the Linear's own Parameter objects. Parameter names, state_dict
keys, checkpoints and optimizer state keyed by parameter therefore do not change, and the
mask, the kernel and the CSR pattern stay out of the state_dict (whoever moves or restores a
pruned layer carries the mask itself, or rebuilds it from the zeros in the weights).
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

KERNELS = ("dense", "csr")

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")


class Pattern:
    """The CSR structure of a mask (and of its transpose), fixed between mask changes."""

    def __init__(self, mask: torch.Tensor):
        rows, cols = mask.shape
        self.flat = mask.reshape(-1).nonzero().squeeze(1)  # row-major == CSR value order
        r, c = self.flat // cols, self.flat % cols
        self.crow = torch.zeros(rows + 1, dtype=torch.int64, device=mask.device)
        self.crow[1:] = torch.bincount(r, minlength=rows).cumsum(0)
        self.col = c
        self.pattern = torch.sparse_csr_tensor(
            self.crow, self.col, torch.ones(len(c), device=mask.device), (rows, cols), check_invariants=False
        )
        # the input gradient multiplies by W^T, whose CSR values are ordered by (col, row)
        self.t_perm = (c * rows + r).argsort()
        self.t_crow = torch.zeros(cols + 1, dtype=torch.int64, device=mask.device)
        self.t_crow[1:] = torch.bincount(c, minlength=cols).cumsum(0)
        self.t_col = r.index_select(0, self.t_perm)
        self.nnz = len(c)

    def __deepcopy__(self, memo) -> "Pattern":
        # torch cannot deep-copy a sparse CSR tensor; nothing mutates a Pattern, so copies share it
        return self


class _CSRLinear(torch.autograd.Function):
    """y = x W^T + b with W given by its dense tensor and a fixed sparsity pattern.

    Work is proportional to nnz: forward and input-gradient are CSR x dense products, the
    weight gradient is computed only at the pattern (`sampled_addmm`), then scattered into a
    dense gradient so the optimizer keeps stepping dense values.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, pat):
        values = weight.reshape(-1).index_select(0, pat.flat)
        w = torch.sparse_csr_tensor(pat.crow, pat.col, values, weight.shape, check_invariants=False)
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.sparse.mm(w, x2.t()).t()
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2, values)
        ctx.pat, ctx.has_bias, ctx.shape = pat, bias is not None, weight.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, values = ctx.saved_tensors
        pat = ctx.pat
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            wt = torch.sparse_csr_tensor(
                pat.t_crow, pat.t_col, values.index_select(0, pat.t_perm), (ctx.shape[1], ctx.shape[0]), check_invariants=False
            )
            gx = torch.sparse.mm(wt, g2.t()).t().reshape(*grad.shape[:-1], ctx.shape[1])
        if ctx.needs_input_grad[1]:
            sampled = torch.sparse.sampled_addmm(pat.pattern, g2.t().contiguous(), x2, beta=0.0)
            gw = torch.zeros(ctx.shape[0] * ctx.shape[1], dtype=g2.dtype, device=g2.device)
            gw = gw.index_copy_(0, pat.flat, sampled.values()).view(ctx.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None


def csr_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pattern: Pattern) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the entries of `pattern` only, with work ~ nnz.

    Sparse kernels compute in the weight's dtype (float32): PyTorch's CPU CSR products have no
    bf16 kernel, so under bf16 autocast the input is cast up, the product runs outside
    autocast, and the output is cast back to the input's dtype."""
    if x.dtype == weight.dtype:
        return _CSRLinear.apply(x, weight, bias, pattern)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _CSRLinear.apply(x.to(weight.dtype), weight, bias, pattern).to(x.dtype)


class PrunedLinear(nn.Module):
    """A Linear's weight and bias run under a fixed mask with kernel "dense" or "csr".

    Holds the given Parameter objects (not copies), so it has the parameter names, state_dict
    keys and optimizer state of the Linear it stands for. The mask is a plain attribute: it is
    not a parameter, not a buffer and not in the state_dict.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, mask: torch.Tensor, kernel: str):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}; use one of {KERNELS}")
        if tuple(mask.shape) != tuple(weight.shape):
            raise ValueError(f"mask of shape {tuple(mask.shape)} for a weight of shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        if bias is None:
            self.register_parameter("bias", None)  # as nn.Linear: a None entry keeps `self.bias` readable
        else:
            self.bias = bias
        self.mask = mask.to(weight.dtype)  # in the weight's dtype, so `weight * mask` does not promote
        self.kernel = kernel
        self.pattern = Pattern(mask) if kernel == "csr" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "csr":
            return csr_linear(x, self.weight, self.bias, self.pattern)
        return F.linear(x, self.weight * self.mask, self.bias)

    # the names the mask, kernel and pattern had as attributes of a patched nn.Linear
    @property
    def prune_mask(self) -> torch.Tensor:
        return self.mask

    @property
    def prune_kernel(self) -> str:
        return self.kernel

    @property
    def prune_pattern(self) -> Pattern | None:
        return self.pattern

    def extra_repr(self) -> str:
        live = int(self.mask.count_nonzero())
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"kernel={self.kernel}, density={live / self.mask.numel():.3f}"
        )


def set_mask(parent: nn.Module, name: str, mask: torch.Tensor, kernel: str) -> PrunedLinear:
    """Run the Linear (or PrunedLinear) `name` of `parent` (dotted, e.g. "attn.qkv") with `mask`
    under `kernel`: it is replaced by a PrunedLinear over the same Parameters, and its weights
    outside the mask are zeroed (so the stored weights themselves record the mask)."""
    owner_name, _, child = name.rpartition(".")
    owner = parent.get_submodule(owner_name)
    lin = owner.get_submodule(child)
    if not isinstance(lin, (nn.Linear, PrunedLinear)):
        raise TypeError(f"{name} is a {type(lin).__name__}, not a Linear")
    new = PrunedLinear(lin.weight, lin.bias, mask, kernel)  # checks the mask before the weights change
    with torch.no_grad():
        lin.weight.mul_(mask)
    new.train(lin.training)
    setattr(owner, child, new)  # same key in owner._modules: named_parameters keeps its order
    return new


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_kernels(lin: nn.Module, mask: torch.Tensor, rows: int, reps: int = 3,
                 dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Seconds of one forward + backward of `lin` (a Linear or PrunedLinear) under `mask` on
    `rows` random rows, per kernel (min of reps), computing as training does (`dtype`: bf16 =
    under autocast). Works on copies: `lin` is not touched."""
    out = {}
    dev = lin.weight.device
    x = torch.randn(rows, lin.in_features, device=dev).to(dtype)
    w = lin.weight.detach().clone().requires_grad_(True)
    b = None if lin.bias is None else lin.bias.detach().clone().requires_grad_(True)
    m = mask.to(w.dtype)
    pat = Pattern(mask)
    for kernel in KERNELS:
        best = float("inf")
        for _ in range(reps):
            xi = x.clone().requires_grad_(True)
            _sync(dev)
            t = time.perf_counter()
            with torch.autocast(device_type=dev.type, dtype=dtype, enabled=dtype != torch.float32):
                y = F.linear(xi, w * m, b) if kernel == "dense" else csr_linear(xi, w, b, pat)
            y.float().sum().backward()
            _sync(dev)  # CUDA runs the kernels after the call returns: wait for them
            best = min(best, time.perf_counter() - t)
        out[kernel] = best
    return out
