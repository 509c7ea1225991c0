"""Readable eager PaliGemma prefix in plain torch (SigLIP + projector + Gemma over images and prompt), as LeRobot
0.6.1 computes it for pi0.5 and pi0 alike, and the building blocks their action experts share.

encode_prefix: images + prompt -> SigLIP -> Gemma prefix tower -> per-layer K/V (`PrefixCache`). The prefix
always has the fixed length `slots * num_patches + prompt_len`; padding (missing cameras, prompt padding) is
masked instead of removed, so every buffer keeps a static shape. `w` is any weights object with the prefix
fields (`pi05.Pi05Weights`, `pi0.Pi0Weights`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# LeRobot's additive mask value (openpi): large and finite, so fully masked rows stay NaN-free.
MASK_VALUE = -2.3819763e38


@dataclass
class PrefixCache:
    """What `denoise` needs from an observation: prefix K/V of every Gemma layer and the padding mask."""

    k: torch.Tensor  # [depth, B, kv_heads, prefix_len, head_dim], RoPE applied
    v: torch.Tensor  # [depth, B, kv_heads, prefix_len, head_dim]
    pad_mask: torch.Tensor  # [B, prefix_len] bool: True where the token is real
    n_valid: torch.Tensor  # [B] long: real prefix tokens; the action tokens' RoPE positions start here


# ---- building blocks --------------------------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.to(w.dtype), w, b)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), with the statistics in fp32 (the result is fp32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """Rotary tables for integer positions [B, T] -> cos, sin [B, 1, T, head_dim] (halves duplicated)."""
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, Tq, D], k/v [B, KV, Tk, D] (KV divides H), allowed [B, Tq, Tk] bool -> [B, Tq, H*D].

    softmax(q k^T / sqrt(D) + mask) v, every query head of a group reading its shared K/V head. The mask is
    additive with LeRobot's large negative value (so a padded query row that sees nothing stays finite, as
    in LeRobot); torch's fused SDPA computes it, matching the explicit matmul-softmax-matmul to ~1e-7 in
    fp32 while being several times faster on the CPU, where the tiny model runs at control rates."""
    b, h, tq, _ = q.shape
    mask = None
    if allowed is not None:
        mask = torch.where(allowed[:, None], 0.0, MASK_VALUE).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         enable_gqa=h != k.shape[1])
    return out.transpose(1, 2).reshape(b, tq, -1)


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """[B, T, (H + 2 KV) * D] -> q [B, H, T, D], k, v [B, KV, T, D]."""
    b, t, _ = qkv.shape
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(b, t, heads, head_dim).transpose(1, 2), k.view(b, t, kv_heads, head_dim).transpose(1, 2),
            v.view(b, t, kv_heads, head_dim).transpose(1, 2))


# ---- SigLIP + projector ---------------------------------------------------------------------------
def siglip(w, pixels: torch.Tensor) -> torch.Tensor:
    """pixels [N, 3, H, W] in [-1, 1] -> projected image tokens [N, num_patches, vlm.width]."""
    vc, eps = w.config.vision, w.config.ln_eps
    x = F.conv2d(pixels.to(w.patch_w.dtype), w.patch_w, w.patch_b, stride=vc.patch)
    x = x.flatten(2).transpose(1, 2) + w.pos_emb
    for L in w.vision_layers:
        h = F.layer_norm(x, (vc.hidden,), L.ln1_w, L.ln1_b, eps)
        q, k, v = split_heads(linear(h, L.qkv_w, L.qkv_b), vc.heads, vc.heads, vc.head_dim)
        x = x + linear(attention(q, k, v, None), L.out_w, L.out_b)
        h = F.layer_norm(x, (vc.hidden,), L.ln2_w, L.ln2_b, eps)
        x = x + linear(gelu_tanh(linear(h, L.fc1_w, L.fc1_b)), L.fc2_w, L.fc2_b)
    x = F.layer_norm(x, (vc.hidden,), w.post_ln_w, w.post_ln_b, eps)
    return linear(x, w.proj_w, w.proj_b)


# ---- prefix ----------------------------------------------------------------------------------------
def embed_prefix(w, images, image_masks, lang_tokens, lang_mask):
    """-> embeddings [B, S*P + L, width] and pad mask [B, S*P + L] (images first, then the prompt)."""
    b, s = images.shape[:2]
    act = w.embed.dtype
    # A missing camera (mask False) is a -1 image, as LeRobot builds it: what the slot held never matters.
    images = images.masked_fill(~image_masks.bool()[:, :, None, None, None], -1.0)
    img = siglip(w, images.flatten(0, 1)).to(act)
    n_patch = img.shape[1]
    img = img.view(b, s * n_patch, -1)
    img_pad = image_masks.bool()[:, :, None].expand(b, s, n_patch).reshape(b, s * n_patch)
    # Gemma scales its token embeddings by sqrt(width), with the scale rounded to the table's dtype.
    # A Python float (not a tensor) keeps this free of host->device copies inside CUDA graph capture.
    scale = float(torch.tensor(w.config.vlm.width ** 0.5, dtype=torch.float32).to(act))
    lang = F.embedding(lang_tokens, w.embed) * scale
    return torch.cat([img, lang], dim=1), torch.cat([img_pad, lang_mask.bool()], dim=1)


def encode_prefix(w, images: torch.Tensor, image_masks: torch.Tensor,
                  lang_tokens: torch.Tensor, lang_mask: torch.Tensor) -> PrefixCache:
    """images [B, S, 3, 224, 224] in [-1, 1], image_masks [B, S] bool, lang_tokens/lang_mask [B, L]."""
    g, eps = w.config.vlm, w.config.rms_eps
    x, pad = embed_prefix(w, images, image_masks, lang_tokens, lang_mask)
    # Valid prefix tokens see each other both ways; padding neither sees nor is seen (its rows are junk
    # that nothing reads). Positions count valid tokens only, so padding does not shift the prompt.
    allowed = pad[:, None, :] & pad[:, :, None]
    positions = torch.cumsum(pad.long(), dim=1) - 1
    cos, sin = rope_cos_sin(positions, w.rope_inv_freq, x.dtype)
    ks, vs = [], []
    for i, L in enumerate(w.vlm_layers):
        h = (rms_normalize(x, eps) * L.attn_norm).to(x.dtype)
        q, k, v = split_heads(linear(h, L.qkv_w), g.heads, g.kv_heads, g.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ks.append(k)
        vs.append(v)
        if i == len(w.vlm_layers) - 1:
            break  # the last layer's attention output and MLP only feed the unused prefix logits
        x = x + linear(attention(q, k, v, allowed), L.o_w).to(x.dtype)
        h = (rms_normalize(x, eps) * L.mlp_norm).to(x.dtype)
        gate, up = linear(h, L.gate_up_w).chunk(2, dim=-1)
        x = x + linear(gelu_tanh(gate) * up, L.down_w).to(x.dtype)
    return PrefixCache(k=torch.stack(ks), v=torch.stack(vs), pad_mask=pad, n_valid=pad.sum(dim=1))
