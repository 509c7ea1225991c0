"""MXFP4 weights (OCP microscaling, 4-bit e2m1 values with one power-of-two scale per 32 inputs): the format
Triton's scaled dot (`tl.dot_scaled`) takes, native on Blackwell-class tensor cores (B200, Jetson AGX Thor)
and widened in registers elsewhere; and its torch reference.

A weight [N, K] is stored as e2m1 codes (sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte along
K (input 2j in the low nibble, 2j + 1 in the high one), and one e8m0 scale per 32 consecutive inputs (a byte
e: the scale 2^(e - 127)), stored [N, K / 32]. The scale of a block is the smallest power of two that brings
its largest |w| to at most 6 (no value clips), each entry then rounds to the nearest e2m1 value. Bytes per
weight: 0.5 + 1/32. The skinny GEMM multiplies activations in MX e4m3 by it (each row's 32-input block scaled by
the smallest power of two that brings it to at most 448, then rounded to e4m3: `mx_rows_ref`): both operands
block-scaled, so Blackwell's tensor cores take the product natively (`tcgen05.mma ... kind::mxf8f6f4
.block_scale`, checked in test_kernels_ptx); a Hopper GPU has no such instruction (Triton widens both operands
there, slower than bf16). Reference: `mx_rows_ref(x) @ MX4Weight.dequantize().T`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt_core.kernels._common import KernelInputError

BLOCK = 32  # inputs per scale (fixed by the format)
K_TILE = 2 * BLOCK  # a GEMM's K tiles are multiples of this (whole pairs of scale blocks: the scaled dot's least K)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude per code 0..7; code + 8: the same, negative


@dataclass(frozen=True)
class MX4Weight:
    """A [N, K] weight in MXFP4 (module docstring): `packed` uint8 [N, K / 2], `scales` uint8 [N, K / 32] (e8m0),
    `dtype` the dtype the GEMM writes (its activations are multiplied in MX e4m3: `mx_rows_ref`)."""

    packed: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()

    def clone(self) -> "MX4Weight":
        return MX4Weight(self.packed.clone(), self.scales.clone(), self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [N, K] weight the GEMM multiplies by, in `dtype` (default: the weight's; exact in bf16)."""
        p = self.packed.to(torch.int32)
        codes = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)  # [N, K], inputs in order
        # e2m1 by its bits (no host table: this runs inside CUDA graph captures): exponent e, mantissa m; e = 0
        # is subnormal (m / 2), else 2^(e - 1) (1 + m / 2); bit 3 the sign
        e, m = ((codes >> 1) & 3).float(), (codes & 1).float()
        mag = torch.where(e == 0, m * 0.5, torch.exp2(e - 1) * (1 + m * 0.5))
        value = torch.where(codes >= 8, -mag, mag)
        scale = torch.exp2(self.scales.float() - 127.0).repeat_interleave(BLOCK, dim=1)
        return (value * scale).to(dtype or self.dtype)


def mx_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) in MX e4m3, as fp32 values: each row's 32-input block divided by the
    smallest power of two 2^e that brings its largest |x| to at most 448, rounded to e4m3, times 2^e again."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 448.0)).clamp_(-127, 127)
    q = (xb / torch.exp2(e)).to(torch.float8_e4m3fn).float()
    return (q * torch.exp2(e)).reshape(shape)


def quantize_mx4(w: torch.Tensor, dtype: torch.dtype | None = None) -> MX4Weight:
    """w [N, K] (K a multiple of 32) -> MX4Weight (module docstring); dtype: the GEMM's output dtype (default w's)."""
    if w.ndim != 2 or not w.is_floating_point():
        raise KernelInputError(f"quantize_mx4: a float [N, K] weight, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    if k % BLOCK:
        raise KernelInputError(f"quantize_mx4: K = {k} must be a multiple of {BLOCK}")
    g = w.float().reshape(n, k // BLOCK, BLOCK)
    amax = g.abs().amax(dim=-1).clamp_min(2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp_(-127, 127)
    v = g / torch.exp2(e)[..., None]  # |v| <= 6
    mags = torch.tensor(E2M1, device=w.device)
    code = (v.abs()[..., None] - mags).abs().argmin(dim=-1)  # nearest magnitude (ties: the smaller)
    code = (code + 8 * (v < 0)).reshape(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).contiguous()
    return MX4Weight(packed, (e + 127).to(torch.uint8).contiguous(), dtype or w.dtype)
