"""Gemma RMSNorm, optionally fused with the residual add that precedes it.

y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w). Gemma stores w around 0 and uses weight_offset = 1;
an engine may fold the 1 into the weights once at load time and pass weight_offset = 0.
Reference: `reference.rms_norm_ref`, `reference.add_rms_norm_ref`.
"""
import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import check, check_out, next_pow2, pdl_launch, row_warps
from flashrt_core.kernels._pdl import pdl_enter


@triton.jit
def _rms_norm_kernel(X_ptr, R_ptr, W_ptr, Y_ptr, RES_OUT_ptr, D, eps, weight_offset,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = x + tl.load(R_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        s_stored = s.to(RES_OUT_ptr.dtype.element_ty)
        tl.store(RES_OUT_ptr + row * D + cols, s_stored, mask=mask)
        # Normalize what was stored, so the next layer's residual and this norm see the same numbers.
        x = s_stored.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y_ptr + row * D + cols, (x * rstd * (w + weight_offset)).to(Y_ptr.dtype.element_ty), mask=mask)


def _launch(op, x, residual, weight, eps, weight_offset, out, residual_out):
    check(op, "x", x, contiguous=True)
    d = x.shape[-1]
    check(op, "weight", weight, ndim=1, shape=(d,), device=x.device)
    out = check_out(op, "out", out, x.shape, x.device) if out is not None else torch.empty_like(x)
    if residual is not None:
        check(op, "residual", residual, shape=tuple(x.shape), contiguous=True, device=x.device)
        residual_out = (check_out(op, "residual_out", residual_out, x.shape, x.device)
                        if residual_out is not None else torch.empty_like(residual))
    rows = x.numel() // d if d else 0
    if rows:
        block = next_pow2(d, 16)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out,
            residual_out if residual is not None else out, d, float(eps), float(weight_offset),
            HAS_RESIDUAL=residual is not None, BLOCK_D=block, num_warps=row_warps(block), **pdl_launch(x.device))
    return out, residual_out


def rms_norm(x, weight, eps=1e-6, *, weight_offset=1.0, out=None):
    """RMSNorm over the last dim of contiguous x [..., D] with weight [D]; returns x's dtype."""
    return _launch("rms_norm", x, None, weight, eps, weight_offset, out, None)[0]


def add_rms_norm(x, residual, weight, eps=1e-6, *, weight_offset=1.0, out=None, residual_out=None):
    """Returns (residual + x, rms_norm(residual + x)). Pass residual_out=residual to update it in place."""
    out, residual_out = _launch("add_rms_norm", x, residual, weight, eps, weight_offset, out, residual_out)
    return residual_out, out
