"""4-bit weights (W4A16): the storage format the skinny GEMM reads, and its torch reference.

A weight [N, K] is stored as signed 4-bit integers in groups of `group` consecutive inputs (K), each group with
its own scale in the activations' dtype (bf16): w = scale[k // group, n] * q[n, k], q in -8..7, scale =
max |w| of the group / 7 (symmetric; -8 is never produced). Two inputs share one byte: the low nibble holds
input 2j, the high nibble input 2j + 1, each as q + 8; the GEMM dequantizes a tile in registers (q * scale,
rounded once to bf16, as `W4Weight.dequantize`) and multiplies the even and the odd inputs of x by the two
halves. Scales are stored group-major [K / group, N], so a GEMM tile loads its groups' scales of its output
columns contiguously. The weight bytes a
GEMM streams are 1/4 of bf16's (plus one scale per group: 1/64 more at group 128). group: a power of two of
at least 32 (a GEMM's K tiles hold whole groups, each at least one 16-deep tensor-core product per nibble).
Reference: `W4Weight.dequantize` then `F.linear`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt_core.kernels._common import KernelInputError
from flashrt_core.kernels.fp8 import FP8Weight
from flashrt_core.kernels.mx4 import MX4Weight

GROUP = 128  # inputs per scale


@dataclass(frozen=True)
class W4Weight:
    """A [N, K] weight in 4 bits (module docstring): `packed` uint8 [N, K / 2], `scales` [K / group, N]."""

    packed: torch.Tensor
    scales: torch.Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the GEMM computes and writes in (the scales')."""
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * self.scales.element_size()

    def clone(self) -> "W4Weight":
        return W4Weight(self.packed.clone(), self.scales.clone(), self.group)

    def to(self, device=None) -> "W4Weight":
        return W4Weight(self.packed.to(device), self.scales.to(device), self.group)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [N, K] weight the GEMM multiplies by, in `dtype` (default: the scales')."""
        p = self.packed.to(torch.int16)
        q = torch.stack(((p & 15) - 8, (p >> 4) - 8), dim=-1).flatten(-2).float()  # [N, K], inputs in order
        s = self.scales.float().t().repeat_interleave(self.group, dim=1)
        return (q * s).to(dtype or self.dtype)


def group_for(kdim: int, group: int = GROUP) -> int | None:
    """The group size used for inner dimension `kdim`: the largest power of two from `group` down to 32 that
    divides it (the tiny models' layers take smaller groups); None: not quantizable to 4 bits."""
    while group >= 32:
        if kdim % group == 0:
            return group
        group //= 2
    return None


def quantize_w4(w: torch.Tensor, group: int = GROUP, dtype: torch.dtype | None = None) -> W4Weight:
    """w [N, K] (any float dtype) -> W4Weight with scales in `dtype` (default: w's; an fp32 weight gets fp32
    scales). Each entry is rounded to the nearest multiple of its group's scale as stored (rounded to
    `dtype`); the GEMM, like `dequantize`, rounds q * scale to `dtype` once."""
    if w.ndim != 2 or not w.is_floating_point():
        raise KernelInputError(f"quantize_w4: a float [N, K] weight, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    if group < 32 or group & (group - 1) or k % group:
        raise KernelInputError(f"quantize_w4: the group size {group} must be a power of two of at least 32 and "
                               f"divide K = {k}")
    dtype = dtype or w.dtype
    g = w.float().reshape(n, k // group, group)
    scale = (g.abs().amax(dim=-1) / 7.0).clamp_min(torch.finfo(torch.float32).tiny).to(dtype)
    q = torch.round(g / scale.float()[..., None]).clamp_(-8, 7).to(torch.int16).reshape(n, k) + 8
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()
    return W4Weight(packed, scale.t().contiguous(), group)


def as_dense(w) -> torch.Tensor:
    """A weight as a dense tensor: a quantized one (W4Weight, kernels.fp8.FP8Weight, kernels.mx4.MX4Weight)
    dequantized, any other tensor as it is."""
    return w.dequantize() if isinstance(w, (W4Weight, FP8Weight, MX4Weight)) else w


def weight_bytes(w) -> int:
    """The bytes a GEMM streams for weight `w` (a quantized one's data and scales)."""
    return w.nbytes if isinstance(w, (W4Weight, FP8Weight, MX4Weight)) else w.numel() * w.element_size()
