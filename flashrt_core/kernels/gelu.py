"""GELU (tanh approximation) epilogues: GeGLU of Gemma's MLP and bias + GELU after SigLIP's fc1.

gelu_tanh(g) = 0.5 g (1 + tanh(k (g + 0.044715 g^3))), k = sqrt(2 / pi), which equals g * sigmoid(2 k (...)):
the sigmoid form needs one exp and no tanh; it is evaluated on -|z| so the exp never overflows.
`geglu(..., fp8=True)` writes its result for the fp8 down projection after it (`fp8.FP8Rows`: each row rounded to
gate_up's dtype, then to e4m3 with the row's scale, what `fp8.quantize_rows` of the plain result gives): one
program per row holds the whole row, so no row-quantization kernel reads it back.
Reference: `reference.geglu_ref`, `reference.bias_gelu_ref`.
"""
import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import KernelInputError, check, check_out, next_pow2, pdl_launch
from flashrt_core.kernels._pdl import pdl_enter
from flashrt_core.kernels.fp8 import FP8, FP8Rows, e4m3_row

_BLOCK = 1024


@triton.jit
def _gelu_tanh(g):
    z = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 * sqrt(2 / pi) * (...)
    e = tl.exp(-tl.abs(z))  # in (0, 1]: never overflows
    return g * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _geglu_kernel(GU_ptr, Y_ptr, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(GU_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y_ptr + row * F + cols, (_gelu_tanh(gate) * up).to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _geglu_fp8_kernel(GU_ptr, Q_ptr, S_ptr, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the GeGLU of the whole row, rounded to gate_up's dtype, its scale (max |y| / 448)
    and its e4m3 values."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(GU_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = e4m3_row((_gelu_tanh(gate) * up).to(GU_ptr.dtype.element_ty).to(tl.float32))
    tl.store(Q_ptr + row * F + cols, q.to(Q_ptr.dtype.element_ty), mask=mask)
    tl.store(S_ptr + row, scale)


@triton.jit
def _bias_gelu_kernel(X_ptr, B_ptr, Y_ptr, F, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    x = tl.load(X_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y_ptr + row * F + cols, _gelu_tanh(x).to(Y_ptr.dtype.element_ty), mask=mask)


def geglu(gate_up, *, out=None, fp8=False):
    """gelu_tanh(gate) * up from contiguous gate_up [..., 2F] (gate columns first); returns [..., F] (fp8=True:
    `FP8Rows` of it)."""
    op = "geglu"
    check(op, "gate_up", gate_up, contiguous=True)
    if gate_up.shape[-1] % 2:
        raise KernelInputError(f"{op}: `gate_up` last dim {gate_up.shape[-1]} must be even (gate | up)")
    f = gate_up.shape[-1] // 2
    shape = (*gate_up.shape[:-1], f)
    if fp8:
        if out is not None:
            raise KernelInputError(f"{op}: fp8=True writes new FP8Rows, not into `out`")
        rows = gate_up.numel() // (2 * f) if f else 0
        q = torch.empty(shape, dtype=FP8, device=gate_up.device)
        scales = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
        if rows:
            block = next_pow2(f, 16)
            _geglu_fp8_kernel[(rows,)](gate_up, q, scales, f, BLOCK=block,
                                       num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
                                       **pdl_launch(gate_up.device))
        return FP8Rows(q, scales, gate_up.dtype)
    out = check_out(op, "out", out, shape, gate_up.device) if out is not None else gate_up.new_empty(shape)
    rows = gate_up.numel() // (2 * f) if f else 0
    if rows:
        _geglu_kernel[(rows, triton.cdiv(f, _BLOCK))](gate_up, out, f, BLOCK=_BLOCK, num_warps=4,
                                                      **pdl_launch(gate_up.device))
    return out


def bias_gelu(x, bias=None, *, out=None):
    """gelu_tanh(x + bias) over contiguous x [..., F] with optional bias [F]."""
    op = "bias_gelu"
    check(op, "x", x, contiguous=True)
    f = x.shape[-1]
    if bias is not None:
        check(op, "bias", bias, ndim=1, shape=(f,), device=x.device)
    out = check_out(op, "out", out, x.shape, x.device) if out is not None else torch.empty_like(x)
    rows = x.numel() // f if f else 0
    if rows:
        _bias_gelu_kernel[(rows, triton.cdiv(f, _BLOCK))](
            x, bias if bias is not None else x, out, f, HAS_BIAS=bias is not None, BLOCK=_BLOCK, num_warps=4,
            **pdl_launch(x.device))
    return out
