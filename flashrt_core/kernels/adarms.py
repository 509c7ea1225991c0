"""AdaRMS of the pi0.5 action expert, and the gated residual that precedes each such norm.

Every expert sublayer ends with `x = x + h * gate` and the next thing that reads x is an AdaRMS norm
(the next sublayer's, or the final norm), so the fused op does both in one pass over the row:
    new_x = x + h * gate;  y = rms(new_x) * (1 + scale) + shift.
scale / shift / gate are [D] or [B, D] (one vector per batch element) and may be strided views into a
precomputed modulation table, as long as their last dim is contiguous. `constant_mod=True` declares them
weights that no kernel writes (the expert's precomputed table): they are then requested before the kernel
waits for the previous one (PDL), off the critical path after it.
h may also be `Partials`, the unreduced result of a split-K GEMM (`skinny_gemm.skinny_linear(defer=True)`):
each row's S partials are summed in split order in fp32 and rounded to h's dtype before use, the value the
GEMM's in-kernel reduction would have stored.
Reference: `reference.ada_rms_norm_ref`, `gated_residual_ref`, `gated_residual_ada_rms_norm_ref`.
"""
import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import KernelInputError, check, check_out, next_pow2, pdl_launch, row_warps
from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait
from flashrt_core.kernels.partials import Partials


@triton.jit
def _ada_rms_norm_kernel(X_ptr, H_ptr, G_ptr, SC_ptr, SH_ptr, Y_ptr, XO_ptr,
                         g_stride, sc_stride, sh_stride, rows_per_batch, D, eps, part_stride,
                         HAS_GATED: tl.constexpr, DO_NORM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                         EARLY_MOD: tl.constexpr, PARTS: tl.constexpr):
    """EARLY_MOD: gate / scale / shift are weights (never written by a kernel), loaded before the PDL wait.
    PARTS > 0: H holds PARTS fp32 partials of h, part_stride elements apart, summed in order and rounded to
    XO's dtype (h's: checked on the host)."""
    pdl_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // rows_per_batch
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if EARLY_MOD:
        if HAS_GATED:
            g = tl.load(G_ptr + b * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if DO_NORM:
            sc = tl.load(SC_ptr + b * sc_stride + cols, mask=mask, other=0.0).to(tl.float32)
            sh = tl.load(SH_ptr + b * sh_stride + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(X_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATED:
        if PARTS > 0:
            h = tl.zeros([BLOCK_D], dtype=tl.float32)
            for s in tl.static_range(PARTS):  # fixed order, from zero: as the GEMM's own reduction adds them
                h += tl.load(H_ptr + s * part_stride + row * D + cols, mask=mask, other=0.0)
            h = h.to(XO_ptr.dtype.element_ty).to(tl.float32)
        else:
            h = tl.load(H_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if not EARLY_MOD:
            g = tl.load(G_ptr + b * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x_stored = (x + h * g).to(XO_ptr.dtype.element_ty)
        tl.store(XO_ptr + row * D + cols, x_stored, mask=mask)
        x = x_stored.to(tl.float32)
    if DO_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        if not EARLY_MOD:
            sc = tl.load(SC_ptr + b * sc_stride + cols, mask=mask, other=0.0).to(tl.float32)
            sh = tl.load(SH_ptr + b * sh_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y_ptr + row * D + cols, (x * rstd * (1.0 + sc) + sh).to(Y_ptr.dtype.element_ty), mask=mask)


def _mod(op, name, t, x):
    """Check a [D] or [B, D] modulation vector against x [B, ..., D]; return its batch stride."""
    d = x.shape[-1]
    check(op, name, t, ndim=(1, 2), device=x.device)
    if t.shape[-1] != d:
        raise KernelInputError(f"{op}: `{name}` has shape {tuple(t.shape)}, expected last dim {d}")
    if t.dim() == 1:
        return 0
    if x.dim() < 2 or t.shape[0] != x.shape[0]:
        raise KernelInputError(
            f"{op}: `{name}` has shape {tuple(t.shape)}, but x {tuple(x.shape)} has batch {x.shape[0]}")
    return t.stride(0)


def _launch(op, x, h, gate, scale, shift, eps, out, x_out, constant_mod=False):
    check(op, "x", x, contiguous=True)
    d = x.shape[-1]
    has_gated, do_norm = h is not None, scale is not None
    g_stride = sc_stride = sh_stride = parts = part_stride = 0
    if isinstance(h, Partials):
        h.check(op, tuple(x.shape), x.dtype, x.device)
        parts, part_stride, h = h.splits, h.data.stride(0), h.data
    elif has_gated:
        check(op, "h", h, shape=tuple(x.shape), contiguous=True, device=x.device)
    if has_gated:
        g_stride = _mod(op, "gate", gate, x)
        x_out = check_out(op, "x_out", x_out, x.shape, x.device) if x_out is not None else torch.empty_like(x)
    if do_norm:
        sc_stride, sh_stride = _mod(op, "scale", scale, x), _mod(op, "shift", shift, x)
        out = check_out(op, "out", out, x.shape, x.device) if out is not None else torch.empty_like(x)
    rows = x.numel() // d if d else 0
    batch = x.shape[0] if x.dim() >= 2 else 1
    if rows:
        block = next_pow2(d, 16)
        _ada_rms_norm_kernel[(rows,)](
            x, h if has_gated else x, gate if has_gated else x, scale if do_norm else x,
            shift if do_norm else x, out if do_norm else x, x_out if has_gated else x,
            g_stride, sc_stride, sh_stride, rows // batch, d, float(eps), part_stride=part_stride,
            HAS_GATED=has_gated, DO_NORM=do_norm, BLOCK_D=block, num_warps=row_warps(block),
            EARLY_MOD=bool(constant_mod), PARTS=parts, **pdl_launch(x.device))
    return out, x_out


def ada_rms_norm(x, scale, shift, eps=1e-6, *, out=None, constant_mod=False):
    """rms(x) * (1 + scale) + shift over contiguous x [B, ..., D]; scale/shift [D] or [B, D].
    constant_mod: scale / shift are weights no kernel writes (read before the PDL wait)."""
    return _launch("ada_rms_norm", x, None, None, scale, shift, eps, out, None, constant_mod)[0]


def gated_residual(x, h, gate, *, out=None):
    """x + h * gate; gate [D] or [B, D]. Pass out=x to update the residual stream in place."""
    return _launch("gated_residual", x, h, gate, None, None, 0.0, None, out)[1]


def gated_residual_ada_rms_norm(x, h, gate, scale, shift, eps=1e-6, *, out=None, x_out=None, constant_mod=False):
    """Returns (x + h * gate, AdaRMS of it). Pass x_out=x to update the residual stream in place.
    constant_mod: as in `ada_rms_norm` (it covers the gate too)."""
    out, x_out = _launch("gated_residual_ada_rms_norm", x, h, gate, scale, shift, eps, out, x_out, constant_mod)
    return x_out, out
