"""fp8 (e4m3) GEMMs for the compute-bound prefix: weights with one scale per output channel, activations with one
dynamic scale per token (row), the product in fp32 with both scales applied, written in the model dtype.

`FP8Weight` is the weight format; `scaled_linear(x, w, b)` quantizes x's rows (one Triton kernel on CUDA: the
row's max |x|, the scale max / 448, the rounded fp8 values) and runs cuBLAS's scaled fp8 GEMM
(`torch._scaled_mm`, row-wise scales); on a CPU it computes the same product in fp32 (the reference).
x may arrive quantized already (`FP8Rows`): the kernel that produced it (the RMSNorm before a GEMM, the GeGLU
before the down projection: `kernels.rms_norm(..., fp8=True)`, `kernels.geglu(..., fp8=True)`) wrote its rows in
e4m3 with their scales, the values `quantize_rows` of its plain output gives, and no row-quantization kernel runs.
Reference: `quantize_rows_ref` and `scaled_linear_ref`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt_core.kernels._common import KernelInputError, launch, pdl_launch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
_TINY = 1e-12  # the smallest scale (an all-zero row or channel)

try:  # Triton is optional on CPU-only installs: scaled_linear then runs its reference
    import triton
    import triton.language as tl

    from flashrt_core.kernels._pdl import pdl_enter
except ImportError:  # pragma: no cover
    triton = None


@dataclass(frozen=True)
class FP8Weight:
    """A [N, K] weight in e4m3 (`data`) with one scale per output channel: `scales32` fp32 [N] (what the GEMM
    applies) and the model dtype they are rounded from (`dtype`, the output's)."""

    data: torch.Tensor
    scales32: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales32.numel() * 4

    def clone(self) -> "FP8Weight":
        return FP8Weight(self.data.clone(), self.scales32.clone(), self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.data.float() * self.scales32[:, None]).to(dtype or self.dtype)


@dataclass(frozen=True)
class FP8Rows:
    """Activations [..., K] as `quantize_rows` makes them: e4m3 values `q` and one fp32 scale per row `scale`
    [rows, 1], standing for rows of dtype `dtype` (what a GEMM on them writes)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def numel(self) -> int:
        return self.q.numel()

    def dequantize(self) -> torch.Tensor:
        k = self.q.shape[-1]
        return (self.q.reshape(-1, k).float() * self.scale).to(self.dtype).view(self.q.shape)


def rows_ref(y: torch.Tensor) -> FP8Rows:
    """`FP8Rows` of y (any shape [..., K], rounded to its dtype already): `quantize_rows_ref` of its rows."""
    q, s = quantize_rows_ref(y.reshape(-1, y.shape[-1]))
    return FP8Rows(q.view(y.shape), s, y.dtype)


def quantize_fp8(w: torch.Tensor, dtype: torch.dtype | None = None) -> FP8Weight:
    """w [N, K] -> FP8Weight: each output channel scaled so that its largest |w| is 448, rounded to e4m3."""
    if w.ndim != 2 or not w.is_floating_point():
        raise KernelInputError(f"quantize_fp8: a float [N, K] weight, got {tuple(w.shape)} {w.dtype}")
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)
    data = (w.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return FP8Weight(data.contiguous(), scale.contiguous(), dtype or w.dtype)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): each row scaled so that its largest |x| is 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_linear_ref(x, w: FP8Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """The fp8 GEMM in fp32 torch: rows quantized (unless x is `FP8Rows`), the product of the two fp8 operands
    with both scales."""
    q, s = _rows(x, quantize_rows_ref)
    y = (q.float() @ w.data.float().t()) * s * w.scales32[None, :]
    if b is not None:
        y = y + b.float()
    return y.to(w.dtype).view(*x.shape[:-1], w.shape[0])


if triton is not None:
    @triton.jit
    def e4m3_row(x):
        """A whole row x (fp32, zeros past its end) -> (its values scaled into e4m3's range, not yet converted;
        the fp32 scale max |x| / 448): `quantize_rows_ref` in a kernel that holds the row (this one, and the norm
        and GeGLU kernels that write fp8 rows)."""
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
        return tl.minimum(tl.maximum(x / scale, -448.0), 448.0), scale

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, K, sxm, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One row per program: its largest |x|, the scale max / 448 (fp32), the row in e4m3."""
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK)
        mask = k < K
        q, scale = e4m3_row(tl.load(X + row * sxm + k, mask=mask, other=0.0).to(tl.float32))
        tl.store(Q + row * K + k, q.to(tl.float8e4nv), mask=mask)
        tl.store(S + row, scale)


def quantize_rows(x: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_ref` of x [M, K]: one Triton kernel on CUDA (backend "triton": also elsewhere, e.g. in the
    interpreter; "torch": the reference)."""
    if triton is None or backend == "torch" or (backend is None and not x.is_cuda):
        return quantize_rows_ref(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=FP8)
    s = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(k)
    launch(_quantize_rows_kernel, (m,), x, q, s, k, x.stride(0), BLOCK=block,
           num_warps=8 if block >= 4096 else 4, **pdl_launch(x.device))
    return q, s


def _rows(x, quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M, 1]) of x: `FP8Rows` as they are, a tensor's rows through `quantize`."""
    if isinstance(x, FP8Rows):
        return x.q.reshape(-1, x.shape[-1]), x.scale
    return quantize(x.reshape(-1, x.shape[-1]))


def scaled_linear(x, w: FP8Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) with x's rows and w in e4m3 (per-token and per-channel scales), out in w.dtype:
    cuBLAS's scaled fp8 GEMM on CUDA, `scaled_linear_ref` elsewhere. x: a tensor, or `FP8Rows` (quantized by
    the kernel that wrote them)."""
    if x.shape[-1] != w.shape[1]:
        raise KernelInputError(f"scaled_linear: x has {x.shape[-1]} inputs, the weight {w.shape[1]}")
    if x.device.type != "cuda":
        return scaled_linear_ref(x, w, b)
    q, s = _rows(x, quantize_rows)
    y = torch._scaled_mm(q, w.data.t(), scale_a=s, scale_b=w.scales32[None, :], out_dtype=w.dtype,
                         bias=None if b is None else b.to(w.dtype))
    return y.view(*x.shape[:-1], w.shape[0])
