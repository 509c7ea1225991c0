"""Fused Triton kernels for the glue between GEMMs, each with a plain-torch reference (`reference.py`).

Every public op picks its backend per call:
  * backend=None / "auto": the compiled Triton kernel for CUDA tensors, the torch reference otherwise, so
    the CPU path is plain torch (the interpreter is a testing tool, orders of magnitude slower than torch,
    and a stray TRITON_INTERPRET must not slow the CPU engine down);
  * backend="triton": the Triton kernel, or KernelUnavailableError where it cannot run (`available`);
    on CPU tensors that needs TRITON_INTERPRET=1 set *before* the first kernel module is imported, since
    Triton reads it when the @triton.jit decorators run;
  * backend="torch": the reference.
Kernel modules are imported lazily, on the first Triton call. Import ops from this package, not from the
kernel modules, so that importing the engine never freezes Triton's interpreter setting early.
"""
import importlib

import torch

from flashrt_core.kernels import reference
from flashrt_core.kernels._common import (KernelInputError, KernelUnavailableError, interpreting,
                                         new_semaphore_workspace, pdl_scope, semaphore_workspace)
from flashrt_core.kernels.partials import Partials
from flashrt_core.kernels.reference import resized_hw, rope_cos_sin

__all__ = [
    "available", "KernelInputError", "KernelUnavailableError", "rope_cos_sin", "resized_hw",
    "new_semaphore_workspace", "semaphore_workspace", "pdl_scope", "Partials",
    "rms_norm", "add_rms_norm", "ada_rms_norm", "gated_residual", "gated_residual_ada_rms_norm",
    "geglu", "bias_gelu", "layer_norm", "add_layer_norm", "qkv_rope_cache", "attention", "preprocess_images",
]

BACKENDS = (None, "auto", "triton", "torch")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device=None) -> bool:
    """Whether the Triton kernels can run on `device` (default: anywhere): CUDA with Triton installed, or
    any device with TRITON_INTERPRET=1 (the CPU interpreter)."""
    if not _triton_importable():
        return False
    if interpreting():
        return True
    if not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


def _use_triton(op: str, backend, device) -> bool:
    if backend not in BACKENDS:
        raise KernelInputError(f"{op}: `backend` must be one of None, 'auto', 'triton', 'torch', got {backend!r}")
    if backend == "torch":
        return False
    if backend == "triton":
        if not available(device):
            raise KernelUnavailableError(
                f"{op}: backend='triton' but Triton kernels cannot run on {device} "
                f"(needs CUDA, or TRITON_INTERPRET=1 set before importing the kernels)")
        return True
    return torch.device(device).type == "cuda" and not interpreting() and available(device)


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(f"flashrt_core.kernels.{module}"), name)


def _fp8_rows(y, out):
    """The references' fp8=True: `fp8.FP8Rows` of y (fresh tensors: no `out`)."""
    if out is not None:
        raise KernelInputError("fp8=True writes new FP8Rows, not into `out`")
    return _kernel("fp8", "rows_ref")(y)


def _into(out, result):
    """The reference returns fresh tensors; copy into a caller's static buffer when one was given."""
    if out is None:
        return result
    out.copy_(result)
    return out


def rms_norm(x, weight, eps=1e-6, *, weight_offset=1.0, out=None, fp8=False, backend=None):
    """fp8 (here, in add_rms_norm and in geglu): the result as `fp8.FP8Rows` for an fp8 GEMM after it (each row
    rounded to the result's dtype, then to e4m3 with its own scale: `fp8.quantize_rows` of the plain result)."""
    if _use_triton("rms_norm", backend, x.device):
        return _kernel("rmsnorm", "rms_norm")(x, weight, eps, weight_offset=weight_offset, out=out, fp8=fp8)
    y = reference.rms_norm_ref(x, weight, eps, weight_offset=weight_offset)
    return _fp8_rows(y, out) if fp8 else _into(out, y)


def add_rms_norm(x, residual, weight, eps=1e-6, *, weight_offset=1.0, out=None, residual_out=None, fp8=False,
                 backend=None):
    """Returns (residual + x, rms_norm(residual + x)). x may be `Partials` (a split-K GEMM's unreduced result):
    they are summed in split order and rounded to x's dtype first, as the GEMM would have stored it."""
    if _use_triton("add_rms_norm", backend, x.device):
        return _kernel("rmsnorm", "add_rms_norm")(x, residual, weight, eps, weight_offset=weight_offset,
                                                   out=out, residual_out=residual_out, fp8=fp8)
    new_residual, y = reference.add_rms_norm_ref(x, residual, weight, eps, weight_offset=weight_offset)
    return _into(residual_out, new_residual), (_fp8_rows(y, out) if fp8 else _into(out, y))


def ada_rms_norm(x, scale, shift, eps=1e-6, *, out=None, constant_mod=False, backend=None):
    """constant_mod (here and below): the modulation vectors are weights that no kernel writes, so the Triton
    kernel reads them before it waits for the previous kernel (PDL); same results."""
    if _use_triton("ada_rms_norm", backend, x.device):
        return _kernel("adarms", "ada_rms_norm")(x, scale, shift, eps, out=out, constant_mod=constant_mod)
    return _into(out, reference.ada_rms_norm_ref(x, scale, shift, eps))


def gated_residual(x, h, gate, *, out=None, backend=None):
    if _use_triton("gated_residual", backend, x.device):
        return _kernel("adarms", "gated_residual")(x, h, gate, out=out)
    return _into(out, reference.gated_residual_ref(x, h, gate))


def gated_residual_ada_rms_norm(x, h, gate, scale, shift, eps=1e-6, *, out=None, x_out=None, constant_mod=False,
                                backend=None):
    """Returns (x + h * gate, AdaRMS(x + h * gate)). h may be `Partials` (a split-K GEMM's unreduced result):
    they are summed in split order and rounded to h's dtype first, as the GEMM would have stored it."""
    if _use_triton("gated_residual_ada_rms_norm", backend, x.device):
        return _kernel("adarms", "gated_residual_ada_rms_norm")(x, h, gate, scale, shift, eps, out=out,
                                                                      x_out=x_out, constant_mod=constant_mod)
    new_x, y = reference.gated_residual_ada_rms_norm_ref(x, h, gate, scale, shift, eps)
    return _into(x_out, new_x), _into(out, y)


def geglu(gate_up, *, out=None, fp8=False, backend=None):
    if _use_triton("geglu", backend, gate_up.device):
        return _kernel("gelu", "geglu")(gate_up, out=out, fp8=fp8)
    y = reference.geglu_ref(gate_up)
    return _fp8_rows(y, out) if fp8 else _into(out, y)


def bias_gelu(x, bias=None, *, out=None, backend=None):
    if _use_triton("bias_gelu", backend, x.device):
        return _kernel("gelu", "bias_gelu")(x, bias, out=out)
    return _into(out, reference.bias_gelu_ref(x, bias))


def layer_norm(x, weight, bias, eps=1e-6, *, out=None, backend=None):
    if _use_triton("layer_norm", backend, x.device):
        return _kernel("layernorm", "layer_norm")(x, weight, bias, eps, out=out)
    return _into(out, reference.layer_norm_ref(x, weight, bias, eps))


def add_layer_norm(x, residual, weight, bias, eps=1e-6, *, out=None, residual_out=None, backend=None):
    """Returns (residual + x, layer_norm(residual + x))."""
    if _use_triton("add_layer_norm", backend, x.device):
        return _kernel("layernorm", "add_layer_norm")(x, residual, weight, bias, eps, out=out,
                                                       residual_out=residual_out)
    new_residual, y = reference.add_layer_norm_ref(x, residual, weight, bias, eps)
    return _into(residual_out, new_residual), _into(out, y)


def qkv_rope_cache(qkv, positions, cos, sin, k_cache, v_cache, cache_offset, *, num_q_heads, num_kv_heads,
                   q_out=None, constant_positions=False, backend=None):
    """Split fused QKV, RoPE q and k, write k/v into the caches; returns q [B, T, Hq, Dh]."""
    if _use_triton("qkv_rope_cache", backend, qkv.device):
        return _kernel("qkv_rope", "qkv_rope_cache")(qkv, positions, cos, sin, k_cache, v_cache, cache_offset,
                                                     num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                                     q_out=q_out, constant_positions=constant_positions)
    q = reference.qkv_rope_cache_ref(qkv, positions, cos, sin, k_cache, v_cache, cache_offset,
                                     num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    return _into(q_out, q)


def attention(q, k, v, key_mask=None, k2=None, v2=None, *, scale=None, out=None, constant_kv=False, backend=None):
    if _use_triton("attention", backend, q.device):
        return _kernel("flash_attention", "attention")(q, k, v, key_mask, k2, v2, scale=scale, out=out,
                                                       constant_kv=constant_kv)
    return _into(out, reference.attention_ref(q, k, v, key_mask, k2, v2, scale=scale))


def preprocess_images(images, size=224, *, dtype=torch.float32, out=None, backend=None):
    if _use_triton("preprocess_images", backend, images.device):
        return _kernel("image", "preprocess_images")(images, size, dtype=dtype, out=out)
    return _into(out, reference.preprocess_images_ref(images, size, dtype=dtype))
from flashrt_core.kernels.swiglu_op import swiglu, swiglu_ref  # noqa: E402,F401  (Llama / SmolVLA MLP)
