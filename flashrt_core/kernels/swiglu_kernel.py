"""SwiGLU epilogue of a merged gate|up GEMM (Llama / SmolLM2 MLP): silu(gate) * up, one program per row block.

silu(g) = g * sigmoid(g), the sigmoid evaluated on -|g| so the exp never overflows.
Reference and dispatch (backend=): `kernels.swiglu_op` (`swiglu_ref`, `swiglu`).
"""
import triton
import triton.language as tl

from flashrt_core.kernels._common import KernelInputError, check, check_out, pdl_launch
from flashrt_core.kernels._pdl import pdl_enter

_BLOCK = 1024


@triton.jit
def _swiglu_kernel(GU_ptr, Y_ptr, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(GU_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(gate))  # in (0, 1]
    sig = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(Y_ptr + row * F + cols, (gate * sig * up).to(Y_ptr.dtype.element_ty), mask=mask)


def swiglu(gate_up, *, out=None):
    """silu(gate) * up from contiguous gate_up [..., 2F] (gate columns first); returns [..., F]."""
    op = "swiglu"
    check(op, "gate_up", gate_up, contiguous=True)
    if gate_up.shape[-1] % 2:
        raise KernelInputError(f"{op}: `gate_up` last dim {gate_up.shape[-1]} must be even (gate | up)")
    f = gate_up.shape[-1] // 2
    shape = (*gate_up.shape[:-1], f)
    out = check_out(op, "out", out, shape, gate_up.device) if out is not None else gate_up.new_empty(shape)
    if not out.is_contiguous():
        raise KernelInputError(f"{op}: `out` must be contiguous")
    rows = gate_up.numel() // (2 * f) if f else 0
    if rows:
        _swiglu_kernel[(rows, triton.cdiv(f, _BLOCK))](gate_up, out, f, BLOCK=_BLOCK, num_warps=4,
                                                       **pdl_launch(gate_up.device))
    return out
