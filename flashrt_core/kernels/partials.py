"""A GEMM result handed on as its split-K partial sums, for the kernel that reads it to add up.

A split-K GEMM normally reduces in-kernel: each program stores an fp32 partial, takes a ticket, and the last
program of a tile reads every partial back and stores the sum. On the action expert's chain that tail (an
atomic round trip and a dependent read) sits between the GEMM's last product and the next kernel's start.
When the next kernel reads each result row whole anyway (the gated residual + AdaRMS after the expert's o and
down projections), the GEMM can leave the partials (`skinny_gemm.skinny_linear(defer=True)`) and that kernel
sums them in split order, in fp32 from zero, and rounds to `dtype`: exactly the value the GEMM's own
reduction would have stored, so the results do not change, bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashrt_core.kernels._common import KernelInputError


@dataclass(frozen=True)
class Partials:
    """data: [S, M, N] fp32 contiguous, S >= 1 partial products of an [..., N] result with M rows; dtype: what
    the result is rounded to (the GEMM's weight dtype); shape: the result's shape (its rows flattened are M)."""

    data: torch.Tensor
    dtype: torch.dtype
    shape: tuple

    @property
    def splits(self) -> int:
        return self.data.shape[0]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def total(self) -> torch.Tensor:
        """The result (plain torch, the reference of every reader): partials summed in split order in fp32,
        from zero, then rounded to `dtype`."""
        acc = torch.zeros_like(self.data[0])
        for s in range(self.splits):
            acc = acc + self.data[s]
        return acc.to(self.dtype).view(self.shape)

    def check(self, op: str, shape=None, dtype=None, device=None) -> None:
        """Raise KernelInputError unless the partials are consistent (contiguous fp32 [S >= 1, rows, N] for a
        result of `self.shape`) and, where given, hold a result of that shape, dtype and device."""
        d, want = self.data, tuple(self.shape)
        rows = math.prod(want[:-1])
        if (d.dim() != 3 or d.dtype != torch.float32 or not d.is_contiguous() or d.shape[0] < 1 or not want
                or tuple(d.shape[1:]) != (rows, want[-1])):
            width = want[-1] if want else "N"
            raise KernelInputError(f"{op}: partials must be contiguous fp32 [S >= 1, {rows}, {width}] for a result "
                                   f"of shape {want}, got {tuple(d.shape)} {d.dtype}")
        for name, got, expected in (("shape", want, None if shape is None else tuple(shape)),
                                    ("dtype", self.dtype, dtype), ("device", d.device, device)):
            if expected is not None and got != expected:
                raise KernelInputError(f"{op}: partials of a result with {name} {got}, expected {expected}")


def dense(h):
    """h itself, or the result its partials add up to (reference paths)."""
    return h.total() if isinstance(h, Partials) else h
