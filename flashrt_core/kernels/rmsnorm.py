"""Gemma RMSNorm, optionally fused with the residual add that precedes it.

y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w). Gemma stores w around 0 and uses weight_offset = 1;
an engine may fold the 1 into the weights once at load time and pass weight_offset = 0.
With the residual add, x may be `Partials`, the unreduced result of a split-K GEMM
(`skinny_gemm.skinny_linear(defer=True)`): each row's partials are summed in split order in fp32 and rounded
to x's dtype, the value the GEMM's own reduction would have stored. The norm weight is read before the PDL
wait (a weight: no kernel writes it).
Reference: `reference.rms_norm_ref`, `reference.add_rms_norm_ref`.
"""
import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import KernelInputError, check, check_out, next_pow2, pdl_launch, row_warps
from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait
from flashrt_core.kernels.partials import Partials


@triton.jit
def _rms_norm_kernel(X_ptr, R_ptr, W_ptr, Y_ptr, RES_OUT_ptr, D, eps, weight_offset, part_stride,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, PARTS: tl.constexpr):
    """PARTS > 0: X holds PARTS fp32 partials of x, part_stride elements apart, summed in order and rounded to
    Y's dtype (x's)."""
    pdl_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    if PARTS > 0:
        x = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in tl.static_range(PARTS):  # fixed order, from zero: as the GEMM's own reduction adds them
            x += tl.load(X_ptr + s * part_stride + row * D + cols, mask=mask, other=0.0)
        x = x.to(Y_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(X_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = x + tl.load(R_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        s_stored = s.to(RES_OUT_ptr.dtype.element_ty)
        tl.store(RES_OUT_ptr + row * D + cols, s_stored, mask=mask)
        # Normalize what was stored, so the next layer's residual and this norm see the same numbers.
        x = s_stored.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(Y_ptr + row * D + cols, (x * rstd * (w + weight_offset)).to(Y_ptr.dtype.element_ty), mask=mask)


def _launch(op, x, residual, weight, eps, weight_offset, out, residual_out):
    parts = part_stride = 0
    if isinstance(x, Partials):
        x.check(op, device=residual.device if residual is not None else None)
        parts, part_stride = x.splits, x.data.stride(0)
        shape, dtype, data = tuple(x.shape), x.dtype, x.data
    else:
        check(op, "x", x, contiguous=True)
        shape, dtype, data = tuple(x.shape), x.dtype, x
    d = shape[-1]
    check(op, "weight", weight, ndim=1, shape=(d,), device=data.device)
    out = check_out(op, "out", out, shape, data.device) if out is not None else torch.empty(
        shape, dtype=dtype, device=data.device)
    if out.dtype != dtype:
        raise KernelInputError(f"{op}: `out` is {out.dtype}, expected {dtype} like x")
    if residual is not None:
        check(op, "residual", residual, shape=shape, contiguous=True, device=data.device)
        residual_out = (check_out(op, "residual_out", residual_out, shape, data.device)
                        if residual_out is not None else torch.empty_like(residual))
    elif parts:
        raise KernelInputError(f"{op}: partials are summed by the residual add (add_rms_norm) only")
    rows = out.numel() // d if d else 0
    if rows:
        block = next_pow2(d, 16)
        _rms_norm_kernel[(rows,)](
            data, residual if residual is not None else data, weight, out,
            residual_out if residual is not None else out, d, float(eps), float(weight_offset), part_stride,
            HAS_RESIDUAL=residual is not None, BLOCK_D=block, num_warps=row_warps(block), PARTS=parts,
            **pdl_launch(data.device))
    return out, residual_out


def rms_norm(x, weight, eps=1e-6, *, weight_offset=1.0, out=None):
    """RMSNorm over the last dim of contiguous x [..., D] with weight [D]; returns x's dtype."""
    return _launch("rms_norm", x, None, weight, eps, weight_offset, out, None)[0]


def add_rms_norm(x, residual, weight, eps=1e-6, *, weight_offset=1.0, out=None, residual_out=None):
    """Returns (residual + x, rms_norm(residual + x)). Pass residual_out=residual to update it in place."""
    out, residual_out = _launch("add_rms_norm", x, residual, weight, eps, weight_offset, out, residual_out)
    return residual_out, out
