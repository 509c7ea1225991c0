"""GEMMs of the engine that cuBLAS does whole, in a form that saves the kernels around them (SigLIP).

SigLIP's GEMMs have 512 rows for two views, where cuBLAS beats Triton GEMMs with mid-size tiles (measured:
docs/performance-history.md, `gemm_mid`), so what can go is the work around them: the patch embedding's
convolution (cuDNN converts layouts around its kernel) becomes one GEMM over gathered patches (their rows
padded to 16 bytes), and fc1's bias + tanh GELU becomes cuBLASLt's epilogue instead of a kernel of its own.
References: `F.conv2d`; `kernels.reference.bias_gelu_ref` after `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt_core.kernels._common import KernelInputError


ROW_ALIGN = 8  # elements: a patch row of 16-byte multiples (bf16) lets cuBLAS take its TMA kernels


def patch_matrix(w: torch.Tensor) -> torch.Tensor:
    """A ViT patch-embedding weight [hidden, C, patch, patch] as the GEMM's [hidden, K'] matrix, each row in
    (channel, row, column) order and zero-padded from K = C * patch^2 to a multiple of ROW_ALIGN: SigLIP's
    K = 588 rows are not 16-byte aligned, and cuBLAS then runs an older kernel (H200, 512 x 588 x 1152:
    14.7 us, padded to 592: 5.0 us, benchmarks/results/blas_choice_probe_h200.json)."""
    hidden, k = w.shape[0], w[0].numel()
    mat = w.new_zeros(hidden, -(-k // ROW_ALIGN) * ROW_ALIGN)
    mat[:, :k] = w.reshape(hidden, k)
    return mat


def patch_embed(pixels: torch.Tensor, w: torch.Tensor, b: torch.Tensor, w_mat: torch.Tensor | None = None
                ) -> torch.Tensor:
    """A ViT patch embedding, `conv2d(pixels, w, b, stride=patch)` with w [hidden, C, patch, patch], as one GEMM:
    pixels [N, C, H, W] (H, W multiples of the patch) -> [N, (H / patch) * (W / patch), hidden], patches in
    row-major order as `conv2d(...).flatten(2).transpose(1, 2)` gives them. The patches are gathered by one
    copy into zeroed rows of w_mat's padded width, each flattened in the weight's (channel, row, column) order;
    w_mat = `patch_matrix(w)` (made here when not given: pass it to skip the padding copy)."""
    n, c, hgt, wid = pixels.shape
    p = w.shape[-1]
    if w.shape[1:] != (c, p, p) or hgt % p or wid % p:
        raise KernelInputError(f"patch_embed: pixels {tuple(pixels.shape)} do not tile into the weight's "
                               f"{tuple(w.shape[1:])} patches")
    w_mat = patch_matrix(w) if w_mat is None else w_mat
    gh, gw, k = hgt // p, wid // p, c * p * p
    if w_mat.shape[0] != w.shape[0] or w_mat.shape[1] < k:
        raise KernelInputError(f"patch_embed: w_mat {tuple(w_mat.shape)} is not patch_matrix of w {tuple(w.shape)}")
    rows = pixels.new_zeros(n * gh * gw, w_mat.shape[1])  # (the padding columns stay zero)
    rows[:, :k].view(n, gh, gw, c, p, p).copy_(pixels.reshape(n, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5))
    return F.linear(rows, w_mat, b).view(n, gh * gw, w.shape[0])


def linear_bias_gelu_tanh(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ w^T + b), on CUDA as one cuBLASLt GEMM with a bias + GELU epilogue (`torch._addmm_activation`,
    whose GELU is the tanh form on CUDA; on CPU it would be the erf form, so CPU takes F.linear + gelu here).
    Reference: `kernels.reference.bias_gelu_ref(F.linear(x, w), b)`."""
    if not x.is_cuda:
        return F.gelu(F.linear(x, w, b), approximate="tanh")
    y = torch._addmm_activation(b, x.reshape(-1, x.shape[-1]), w.t(), use_gelu=True)
    return y.view(*x.shape[:-1], w.shape[0])
