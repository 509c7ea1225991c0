"""SigLIP LayerNorm with bias, optionally fused with the residual add that precedes it.
Reference: `reference.layer_norm_ref`, `reference.add_layer_norm_ref`.
"""
import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import KernelInputError, check, check_out, next_pow2, pdl_launch, row_warps
from flashrt_core.kernels._pdl import pdl_enter


@triton.jit
def _layer_norm_kernel(X_ptr, R_ptr, W_ptr, B_ptr, Y_ptr, RES_OUT_ptr, D, R_ROWS, eps,
                       HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """R_ROWS: rows of the residual, which repeats over x's rows (broadcast over x's leading dims)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = x + tl.load(R_ptr + (row % R_ROWS) * D + cols, mask=mask, other=0.0).to(tl.float32)
        s_stored = s.to(RES_OUT_ptr.dtype.element_ty)
        tl.store(RES_OUT_ptr + row * D + cols, s_stored, mask=mask)
        x = s_stored.to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask, x - mean, 0.0)  # two-pass variance: no cancellation for rows with a large mean
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / D + eps)
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y_ptr + row * D + cols, (xc * rstd * w + b).to(Y_ptr.dtype.element_ty), mask=mask)


def _launch(op, x, residual, weight, bias, eps, out, residual_out):
    check(op, "x", x, contiguous=True)
    d = x.shape[-1]
    check(op, "weight", weight, ndim=1, shape=(d,), device=x.device)
    check(op, "bias", bias, ndim=1, shape=(d,), device=x.device)
    out = check_out(op, "out", out, x.shape, x.device) if out is not None else torch.empty_like(x)
    r_rows = 1
    if residual is not None:  # x's shape, or a trailing part of it that repeats over x's leading dims
        check(op, "residual", residual, contiguous=True, device=x.device)
        trailing = tuple(x.shape[x.ndim - residual.ndim:]) if 0 < residual.ndim <= x.ndim else None
        if tuple(residual.shape) != trailing:
            raise KernelInputError(f"{op}: `residual` {tuple(residual.shape)} is neither x's shape {tuple(x.shape)} "
                                   "nor a trailing part of it")
        r_rows = residual.numel() // d if d else 1  # (0 only where x has no rows either: no launch)
        residual_out = (check_out(op, "residual_out", residual_out, x.shape, x.device)
                        if residual_out is not None else torch.empty(x.shape, dtype=residual.dtype, device=x.device))
    rows = x.numel() // d if d else 0
    if rows:
        block = next_pow2(d, 16)
        _layer_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, bias, out,
            residual_out if residual is not None else out, d, r_rows, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_D=block, num_warps=row_warps(block), **pdl_launch(x.device))
    return out, residual_out


def layer_norm(x, weight, bias, eps=1e-6, *, out=None):
    """LayerNorm over the last dim of contiguous x [..., D] with weight and bias [D]."""
    return _launch("layer_norm", x, None, weight, bias, eps, out, None)[0]


def add_layer_norm(x, residual, weight, bias, eps=1e-6, *, out=None, residual_out=None):
    """Returns (residual + x, layer_norm(residual + x)), both x's shape (a residual of x's trailing shape
    repeats over its leading dims, e.g. a position table). Pass residual_out=residual to update it in place."""
    out, residual_out = _launch("add_layer_norm", x, residual, weight, bias, eps, out, residual_out)
    return residual_out, out
