"""Readable eager pi0.5 in plain torch, numerically following LeRobot 0.6.1 (`PI05Pytorch.sample_actions`).

Two stages, so a runtime can run them at different rates:
  encode_prefix: images + prompt -> SigLIP -> Gemma prefix tower -> per-layer K/V (`PrefixCache`; the
                 shared PaliGemma prefix, `flashrt_core.models.paligemma.reference`)
  denoise:       noise + cached prefix K/V -> `num_steps` Euler steps of the action expert -> action chunk
The prefix always has the fixed length `slots * num_patches + prompt_len`; padding (missing cameras,
prompt padding) is masked instead of removed, so every buffer keeps a static shape.
"""
from __future__ import annotations

import torch

from flashrt_core.models.paligemma.reference import (PrefixCache, apply_rope, attention, encode_prefix, gelu_tanh,
                                                     linear, rms_normalize, rope_cos_sin, split_heads)
from flashrt_core.models.paligemma.inputs import check_model_inputs, check_noise, check_prefix
from flashrt_core.models.pi05.weights import Pi05Weights
from flashrt_core.models.precision import parse_precision, quantize
from flashrt_core.models.rtc import RTCInputs, guided_step


# ---- action expert ---------------------------------------------------------------------------------
def ada_norm(x: torch.Tensor, mod: torch.Tensor, eps: float) -> torch.Tensor:
    """AdaRMS with a precomputed modulation row mod [2 or 3, width]: rms(x) * (1 + scale) + shift."""
    return rms_normalize(x, eps) * (1 + mod[0]) + mod[1]


def velocity(w: Pi05Weights, prefix: PrefixCache, x_t: torch.Tensor, step: int) -> torch.Tensor:
    """The flow's velocity at Euler step `step` (time `w.step_times[step]`) for actions x_t [B, chunk, dim]."""
    e, eps = w.config.expert, w.config.rms_eps
    b, chunk, _ = x_t.shape
    act = w.action_in_w.dtype
    x = linear(x_t, w.action_in_w, w.action_in_b)
    # Action tokens see every valid prefix token and each other; their positions follow the prefix.
    n_prefix = prefix.pad_mask.shape[1]
    allowed = torch.cat([prefix.pad_mask[:, None, :].expand(b, chunk, n_prefix),
                         torch.ones(b, chunk, chunk, dtype=torch.bool, device=x.device)], dim=2)
    positions = prefix.n_valid[:, None] + torch.arange(chunk, device=x.device)
    cos, sin = rope_cos_sin(positions, w.rope_inv_freq, act)
    for i, L in enumerate(w.expert_layers):
        mod = w.ada_attn[step, i]
        h = ada_norm(x, mod, eps).to(act)
        q, k, v = split_heads(linear(h, L.qkv_w), e.heads, e.kv_heads, e.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = torch.cat([prefix.k[i].to(k.dtype), k], dim=2)
        v = torch.cat([prefix.v[i].to(v.dtype), v], dim=2)
        x = x + linear(attention(q, k, v, allowed), L.o_w) * mod[2].to(act)
        mod = w.ada_mlp[step, i]
        h = ada_norm(x, mod, eps).to(act)
        gate, up = linear(h, L.gate_up_w).chunk(2, dim=-1)
        x = x + linear(gelu_tanh(gate) * up, L.down_w) * mod[2].to(act)
    x = ada_norm(x, w.ada_final[step], eps).to(act)
    return linear(x, w.action_out_w, w.action_out_b).float()


def denoise(w: Pi05Weights, prefix: PrefixCache, noise: torch.Tensor, rtc: RTCInputs | None = None) -> torch.Tensor:
    """Euler-integrate the flow from t=1 (noise [B, chunk, dim]) to t=0 -> actions [B, chunk, dim] fp32; with
    `rtc`, every step guided towards the previous chunk (`flashrt_core.models.rtc`, LeRobot's RTC)."""
    x_t = noise.float()
    for step in range(w.config.num_steps):
        v = velocity(w, prefix, x_t, step)
        x_t = x_t + w.dt * v if rtc is None else guided_step(x_t, v, rtc, 1.0 + step * w.dt, w.dt)
    return x_t


def sample_actions(w: Pi05Weights, images, image_masks, lang_tokens, lang_mask, noise) -> torch.Tensor:
    return denoise(w, encode_prefix(w, images, image_masks, lang_tokens, lang_mask), noise)


class ReferenceEngine:
    """The eager reference behind the engine interface that `Pi05Policy` drives (same as a fused engine:
    `make_engine(weights)` -> object with `encode_prefix(...)` and `denoise(prefix, noise)`)."""

    name = "reference"

    def __init__(self, weights: Pi05Weights):
        self.weights = weights

    @torch.no_grad()
    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask) -> PrefixCache:
        check_model_inputs(self.weights.config, images, image_masks, lang_tokens, lang_mask)
        return encode_prefix(self.weights, images, image_masks, lang_tokens, lang_mask)

    @torch.no_grad()
    def denoise(self, prefix: PrefixCache, noise: torch.Tensor, rtc: RTCInputs | None = None) -> torch.Tensor:
        check_noise(self.weights.config, noise, check_prefix(self.weights.config, prefix))
        return denoise(self.weights, prefix, noise, rtc)


def make_engine(weights: Pi05Weights, precision=None) -> ReferenceEngine:
    """The eager engine; a quantized `precision` multiplies by the quantized weights, dequantized."""
    return ReferenceEngine(quantize(weights, parse_precision(precision), packed=False))
