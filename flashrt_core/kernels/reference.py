"""Plain-torch references of every kernel: the CPU path, and the ground truth for kernel tests.

Each `<op>_ref` takes the same arguments as the fused op, computes in fp32 and returns in the input dtype,
following the formulas LeRobot 0.6.1 / transformers Gemma and SigLIP use (see docs/pi05-facts.md).
"""
import math

import torch
import torch.nn.functional as F

from flashrt_core.kernels.partials import dense


# ---------------------------------------------------------------- RMSNorm (Gemma)
def rms_norm_ref(x, weight, eps=1e-6, *, weight_offset=1.0):
    """Gemma RMSNorm y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w); weight_offset=0 for pre-folded w."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (weight_offset + weight.float())).to(x.dtype)


def add_rms_norm_ref(x, residual, weight, eps=1e-6, *, weight_offset=1.0):
    """(new_residual, normed): new_residual = residual + x (rounded to residual's dtype), normed = rms(it). x may
    be `Partials`."""
    x = dense(x)
    new_residual = (residual.float() + x.float()).to(residual.dtype)
    return new_residual, rms_norm_ref(new_residual, weight, eps, weight_offset=weight_offset).to(x.dtype)


# ---------------------------------------------------------------- AdaRMS (pi0.5 action expert)
def _per_row(mod, x):
    """Broadcast a [D] or [B, D] modulation vector over x [B, ..., D]."""
    mod = mod.float()
    if mod.dim() == 1:
        return mod
    return mod.reshape(mod.shape[0], *([1] * (x.dim() - 2)), mod.shape[-1])


def ada_rms_norm_ref(x, scale, shift, eps=1e-6):
    """AdaRMS: rms(x) * (1 + scale) + shift, with scale/shift of shape [D] or [B, D]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + _per_row(scale, x)) + _per_row(shift, x)).to(x.dtype)


def gated_residual_ref(x, h, gate):
    """x + h * gate (gate [D] or [B, D]), rounded to x's dtype. h may be `Partials`."""
    return (x.float() + dense(h).float() * _per_row(gate, x)).to(x.dtype)


def gated_residual_ada_rms_norm_ref(x, h, gate, scale, shift, eps=1e-6):
    """(new_x, normed): new_x = x + h * gate, normed = AdaRMS(new_x, scale, shift). h may be `Partials`."""
    new_x = gated_residual_ref(x, h, gate)
    return new_x, ada_rms_norm_ref(new_x, scale, shift, eps)


# ---------------------------------------------------------------- GELU family
def geglu_ref(gate_up):
    """gelu_tanh(gate) * up from a merged [..., 2F] gate|up GEMM output (gate first)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


def bias_gelu_ref(x, bias=None):
    """gelu_tanh(x + bias): the SigLIP fc1 epilogue."""
    xf = x.float() if bias is None else x.float() + bias.float()
    return F.gelu(xf, approximate="tanh").to(x.dtype)


# ---------------------------------------------------------------- LayerNorm (SigLIP)
def layer_norm_ref(x, weight, bias, eps=1e-6):
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def add_layer_norm_ref(x, residual, weight, bias, eps=1e-6):
    new_residual = (residual.float() + x.float()).to(residual.dtype)
    return new_residual, layer_norm_ref(new_residual, weight, bias, eps).to(x.dtype)


# ---------------------------------------------------------------- RoPE + QKV split + K/V cache write
def rope_cos_sin(max_positions, head_dim, theta=10000.0, device=None):
    """fp32 tables [max_positions, head_dim // 2] of cos/sin, computed exactly as HF Gemma's rotary embedding.

    HF concatenates the frequencies twice (rotate-half convention), so half a row holds all the information.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope_ref(x, cos, sin):
    """Rotate-half RoPE on x [..., Dh] with cos/sin [..., Dh // 2] broadcastable to x[..., :Dh // 2]."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qkv_rope_cache_ref(qkv, positions, cos, sin, k_cache, v_cache, cache_offset, *, num_q_heads, num_kv_heads):
    """Split a fused [B, T, (Hq + 2 Hkv) * Dh] QKV, rotate q and k, write k/v into caches [B, Hkv, S, Dh]
    at rows cache_offset + t (an int, or an int tensor [B]); return q as [B, T, Hq, Dh]. A position outside
    the tables leaves its token unrotated (as the kernel does). qkv may be `Partials`."""
    qkv = dense(qkv)
    b, t, width = qkv.shape
    dh = width // (num_q_heads + 2 * num_kv_heads)
    heads = qkv.reshape(b, t, num_q_heads + 2 * num_kv_heads, dh)
    q, k, v = heads.split([num_q_heads, num_kv_heads, num_kv_heads], dim=2)
    pos = positions.long()
    valid = (pos >= 0) & (pos < cos.shape[0])
    ok, idx = valid[:, :, None, None], torch.where(valid, pos, 0)
    c = torch.where(ok, cos[idx][:, :, None, :], 1.0)
    s = torch.where(ok, sin[idx][:, :, None, :], 0.0)
    q = apply_rope_ref(q, c, s).to(qkv.dtype)
    k = apply_rope_ref(k, c, s)
    steps = torch.arange(t, device=qkv.device)
    if isinstance(cache_offset, torch.Tensor):
        rows = cache_offset.long()[:, None] + steps[None, :]
    else:  # no host-to-device copy, so the reference can be captured in a CUDA graph too
        rows = (steps + int(cache_offset))[None, :].expand(b, t)
    batch = torch.arange(b, device=qkv.device)[:, None].expand(b, t)
    k_cache[batch, :, rows] = k.to(k_cache.dtype)
    v_cache[batch, :, rows] = v.to(v_cache.dtype)
    return q


# ---------------------------------------------------------------- attention
def attention_ref(q, k, v, key_mask=None, k2=None, v2=None, *, scale=None):
    """Softmax attention of q [B, T, Hq, Dh] over keys k/v [B, Hkv, S, Dh] (valid where key_mask [B, S] is
    nonzero) followed by the always-valid keys k2/v2 [B, Hkv, S2, Dh]. Hq is a multiple of Hkv (GQA).
    Rows with no valid key give zeros. Returns [B, T, Hq, Dh] in q's dtype."""
    b, t, hq, dh = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    keys, values = k.float(), v.float()
    valid = torch.ones(b, k.shape[2], dtype=torch.bool, device=q.device) if key_mask is None else key_mask != 0
    if k2 is not None:
        keys = torch.cat((keys, k2.float()), dim=2)
        values = torch.cat((values, v2.float()), dim=2)
        valid = torch.cat((valid, torch.ones(b, k2.shape[2], dtype=torch.bool, device=q.device)), dim=1)
    keys = keys.repeat_interleave(hq // hkv, dim=1)
    values = values.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("bthd,bhsd->bhts", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A row with no valid key (softmax over -inf only: NaN) gives zeros; NaN from the data itself stays NaN,
    # as in the kernel (a corrupted cache must not come out looking finite).
    probs = torch.where(valid.any(dim=1)[:, None, None, None], probs, 0.0)
    return torch.einsum("bhts,bhsd->bthd", probs, values).to(q.dtype)


# ---------------------------------------------------------------- image preprocessing
def resized_hw(height, width, size_h, size_w):
    """Target size of the image inside the padded frame, as LeRobot's resize_with_pad_torch computes it."""
    ratio = max(width / size_w, height / size_h)
    return int(height / ratio), int(width / ratio)


def preprocess_images_ref(images, size=224, *, dtype=torch.float32):
    """[B, H, W, C] (or [H, W, C]) uint8, or float in [0, 1] -> [B, C, size, size] in [-1, 1].

    LeRobot 0.6.1 semantics (resize_with_pad_torch + `img * 2 - 1`): bilinear resize with
    align_corners=False keeping the aspect ratio, clamp to [0, 1], centered zero padding (the odd pixel goes
    to the bottom/right), so padding ends up at -1.
    """
    if images.dim() == 3:
        images = images[None]
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    x = x.permute(0, 3, 1, 2)
    h, w = x.shape[-2:]
    rh, rw = resized_hw(h, w, size, size)
    if (h, w) != (size, size):
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    pad_t, pad_l = (size - rh) // 2, (size - rw) // 2
    x = F.pad(x, (pad_l, size - rw - pad_l, pad_t, size - rh - pad_t), value=0.0)
    return (x * 2.0 - 1.0).to(dtype)
