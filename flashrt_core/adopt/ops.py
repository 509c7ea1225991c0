"""The fused math behind every replacement: the project's Triton kernels where they can run, else a fused
torch formulation (fewer, larger ops than the module it replaces) so the gates still judge real numbers.

Only the public ops of `flashrt_core.kernels` are used, each with backend="triton" and only on CUDA devices
where `kernels.available(device)` says Triton runs (never the CPU interpreter: it is a correctness tool,
not a speed path, and adoption must not depend on whether some test set TRITON_INTERPRET); an op the
kernels package lacks falls back to torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _triton_op(name: str, device: torch.device):
    """The kernels package's op `name` when compiled Triton can run on `device` (CUDA), else None."""
    try:
        from flashrt_core import kernels
    except ImportError:
        return None
    op = getattr(kernels, name, None)
    if op is None or device.type != "cuda" or not kernels.available(device):
        return None
    return op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, folded_weight: torch.Tensor, eps: float, offset: float):
    """x * rsqrt(mean(x^2) + eps) * (offset + w), computed in fp32, returned in x's dtype.

    `folded_weight` is offset + w precomputed in fp32, so the torch path is one rms_norm call."""
    op = _triton_op("rms_norm", x.device)
    if op is not None:
        return op(x.contiguous(), weight, eps, weight_offset=offset, backend="triton")
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), folded_weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), folded_weight, eps).to(x.dtype)


def ada_rms_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float):
    """rms(x) * (1 + scale) + shift with scale/shift [B, D] (one row per batch element) or [D]."""
    op = _triton_op("ada_rms_norm", x.device)
    if op is not None:
        return op(x.contiguous(), scale, shift, eps, backend="triton")
    if scale.dim() == 2 and x.dim() > 2:
        view = (scale.shape[0],) + (1,) * (x.dim() - 2) + (scale.shape[-1],)
        scale, shift = scale.reshape(view), shift.reshape(view)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return torch.addcmul(shift.float(), normed, scale.float() + 1.0).to(x.dtype)


def layer_norm(x: torch.Tensor, weight, bias, eps: float):
    op = _triton_op("layer_norm", x.device)
    if op is not None and weight is not None and bias is not None:
        return op(x.contiguous(), weight, bias, eps, backend="triton")
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor, approximate: str, bias=None):
    """gelu(x + bias); the Triton epilogue exists for the tanh form only."""
    if approximate == "tanh":
        op = _triton_op("bias_gelu", x.device)
        if op is not None:
            return op(x.contiguous(), bias, backend="triton")
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate=approximate)


def gated_act(gate_up: torch.Tensor, activation: str):
    """act(gate) * up from one merged [..., 2F] GEMM output, gate columns first."""
    if activation == "gelu_tanh":
        op = _triton_op("geglu", gate_up.device)
        if op is not None:
            return op(gate_up.contiguous(), backend="triton")
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """softmax(q k^T * scale) v for q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh]; returns [B, T, Hq, Dh]."""
    op = _triton_op("attention", q.device)
    if op is not None and not causal:
        return op(q, k.transpose(1, 2), v.transpose(1, 2), scale=scale, backend="triton")
    hq, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hq != hkv:
        kt, vt = kt.repeat_interleave(hq // hkv, dim=1), vt.repeat_interleave(hq // hkv, dim=1)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
    return out.transpose(1, 2)
