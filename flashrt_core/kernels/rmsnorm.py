"""Gemma RMSNorm, optionally fused with the residual add that precedes it.

y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w). Gemma stores w around 0 and uses weight_offset = 1;
an engine may fold the 1 into the weights once at load time and pass weight_offset = 0.
With the residual add, x may be `Partials`, the unreduced result of a split-K GEMM
(`skinny_gemm.skinny_linear(defer=True)`): each row's partials are summed in split order in fp32 and rounded
to x's dtype, the value the GEMM's own reduction would have stored. The norm weight is read before the PDL
wait (a weight: no kernel writes it). fp8=True: the result is written for an fp8 GEMM after it (`fp8.FP8Rows`):
each row rounded to x's dtype, then to e4m3 with the row's scale (max |y| / 448), what
`fp8.quantize_rows` of the plain result gives, so that no row-quantization kernel runs between the two.
Reference: `reference.rms_norm_ref`, `reference.add_rms_norm_ref`.
"""
import math

import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import KernelInputError, check, check_out, next_pow2, pdl_launch, row_warps
from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait
from flashrt_core.kernels.fp8 import FP8, FP8Rows, e4m3_row
from flashrt_core.kernels.partials import Partials


@triton.jit
def _rms_norm_kernel(X_ptr, R_ptr, W_ptr, Y_ptr, RES_OUT_ptr, S_ptr, D, eps, weight_offset, part_stride,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, PARTS: tl.constexpr,
                     FP8_OUT: tl.constexpr):
    """PARTS > 0: X holds PARTS fp32 partials of x, part_stride elements apart, summed in order and rounded to
    Y's dtype (x's). FP8_OUT: Y is e4m3 and S gets each row's fp32 scale (the row rounded to x's dtype
    first: x is a tensor here, and the residual of its dtype)."""
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
    y = x * rstd * (w + weight_offset)
    if FP8_OUT:  # (the row as x's dtype would hold it, then its scale and e4m3 values: fp8.quantize_rows)
        y, scale = e4m3_row(y.to(X_ptr.dtype.element_ty).to(tl.float32))
        tl.store(S_ptr + row, scale)
    tl.store(Y_ptr + row * D + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)


def _launch(op, x, residual, weight, eps, weight_offset, out, residual_out, fp8=False):
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
    if fp8:  # (e4m3 values and per-row scales: fresh tensors)
        if out is not None or parts:
            raise KernelInputError(f"{op}: fp8=True takes x as a tensor and writes new FP8Rows (no `out`)")
        if residual is not None and (residual.dtype != dtype or (residual_out is not None
                                                                 and residual_out.dtype != dtype)):
            raise KernelInputError(f"{op}: fp8=True needs the residual in x's dtype ({dtype})")
        out = torch.empty(shape, dtype=FP8, device=data.device)
        scales = torch.empty(math.prod(shape[:-1]), 1, dtype=torch.float32, device=data.device)
    else:
        out = check_out(op, "out", out, shape, data.device) if out is not None else torch.empty(
            shape, dtype=dtype, device=data.device)
        if out.dtype != dtype:
            raise KernelInputError(f"{op}: `out` is {out.dtype}, expected {dtype} like x")
        scales = out
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
            residual_out if residual is not None else out, scales, d, float(eps), float(weight_offset), part_stride,
            HAS_RESIDUAL=residual is not None, BLOCK_D=block, num_warps=row_warps(block), PARTS=parts, FP8_OUT=fp8,
            **pdl_launch(data.device))
    return (FP8Rows(out, scales, dtype) if fp8 else out), residual_out


def rms_norm(x, weight, eps=1e-6, *, weight_offset=1.0, out=None, fp8=False):
    """RMSNorm over the last dim of contiguous x [..., D] with weight [D]; returns x's dtype (fp8=True:
    `FP8Rows` of it)."""
    return _launch("rms_norm", x, None, weight, eps, weight_offset, out, None, fp8)[0]


def add_rms_norm(x, residual, weight, eps=1e-6, *, weight_offset=1.0, out=None, residual_out=None, fp8=False):
    """Returns (residual + x, rms_norm(residual + x)). Pass residual_out=residual to update it in place.
    fp8=True: the norm as `FP8Rows`."""
    out, residual_out = _launch("add_rms_norm", x, residual, weight, eps, weight_offset, out, residual_out, fp8)
    return residual_out, out
