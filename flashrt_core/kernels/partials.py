"""A GEMM result handed on as its split-K partial sums, for the kernel that reads it to add up.

A split-K GEMM normally reduces in-kernel: each program stores an fp32 partial, takes a ticket, and the last
program of a tile reads every partial back and stores the sum. On the action expert's chain that tail (an
atomic round trip and a dependent read) sits between the GEMM's last product and the next kernel's start.
When the next kernel reads each result row whole anyway (the gated residual + AdaRMS after the expert's o and
down projections), the GEMM can leave the partials (`engine_gemm.skinny_linear(defer=True)`) and that kernel
sums them in split order, in fp32 from zero, and rounds to `dtype`: exactly the value the GEMM's own
reduction would have stored, so the results do not change, bit for bit.
"""
from __future__ import annotations

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

    def check(self, op: str, like: torch.Tensor) -> None:
        """Raise KernelInputError unless these partials hold a result shaped like `like` in its dtype."""
        rows = like.numel() // like.shape[-1] if like.dim() else 0
        d = self.data
        if (d.dim() != 3 or d.dtype != torch.float32 or not d.is_contiguous() or d.shape[0] < 1
                or tuple(d.shape[1:]) != (rows, like.shape[-1]) or d.device != like.device
                or tuple(self.shape) != tuple(like.shape) or self.dtype != like.dtype):
            raise KernelInputError(
                f"{op}: partials must be contiguous fp32 [S >= 1, {rows}, {like.shape[-1]}] on {like.device} "
                f"for a {like.dtype} result of shape {tuple(like.shape)}, got {tuple(d.shape)} {d.dtype} on "
                f"{d.device} for a {self.dtype} result of shape {tuple(self.shape)}")


def dense(h):
    """h itself, or the result its partials add up to (reference paths)."""
    return h.total() if isinstance(h, Partials) else h
