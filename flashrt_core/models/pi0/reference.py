"""Readable eager pi0 in plain torch, numerically following LeRobot 0.6.1 (`PI0Pytorch.sample_actions`).

The prefix stage is pi0.5's (same SigLIP, projector and Gemma prefix: `paligemma.reference.encode_prefix`
runs on `Pi0Weights` unchanged). The act stage reads the robot state: every Euler step runs the expert over a
suffix of 1 + chunk tokens, [state token, action tokens], with pi0's block-causal mask: the state token sees
the valid prefix and itself, the action tokens see the valid prefix, the state and each other, and the
prefix never sees the suffix. Suffix positions continue after the valid prefix tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt_core.errors import InputError
from flashrt_core.models.pi0.weights import Pi0Weights
from flashrt_core.models.precision import parse_precision, quantize
from flashrt_core.models.rtc import RTCInputs, guided_step
from flashrt_core.models.paligemma.inputs import check_model_inputs, check_noise, check_prefix
from flashrt_core.models.paligemma.reference import (PrefixCache, apply_rope, attention, encode_prefix, gelu_tanh,
                                                     linear, rms_normalize, rope_cos_sin, split_heads)


def padded_state(w: Pi0Weights, state: torch.Tensor) -> torch.Tensor:
    """state [B, n <= max_state_dim] -> [B, max_state_dim] fp32, zero padded (as LeRobot's pi0 pads it)."""
    if state.ndim != 2:
        raise InputError(f"state: expected [B, state_dim], got shape {tuple(state.shape)}")
    n, width = state.shape[1], w.config.state_dim
    if n > width:
        raise InputError(f"state: {n} values but the model takes at most {width} (max_state_dim)")
    return F.pad(state.float(), (0, width - n))


def suffix_mask(prefix: PrefixCache, chunk: int) -> torch.Tensor:
    """allowed [B, 1 + chunk, prefix_len + 1 + chunk]: the block-causal mask of pi0's suffix."""
    b, n_prefix = prefix.pad_mask.shape
    n = 1 + chunk
    block = torch.ones(n, n, dtype=torch.bool, device=prefix.pad_mask.device)
    block[0, 1:] = False  # the state token does not see the actions
    return torch.cat([prefix.pad_mask[:, None, :].expand(b, n, n_prefix), block.expand(b, n, n)], dim=2)


def velocity(w: Pi0Weights, prefix: PrefixCache, state_token: torch.Tensor, x_t: torch.Tensor,
             step: int) -> torch.Tensor:
    """The flow's velocity at Euler step `step` for actions x_t [B, chunk, dim]; state_token [B, 1, width]."""
    e, eps = w.config.expert, w.config.rms_eps
    b, chunk, _ = x_t.shape
    act = w.action_in_w.dtype
    a = linear(x_t, w.action_in_w, w.action_in_b)
    t = w.time_emb[step].to(a.dtype).expand(b, chunk, -1)
    h = F.silu(linear(torch.cat([a, t], dim=-1), w.action_time_in_w, w.action_time_in_b))
    x = torch.cat([state_token.to(act), linear(h, w.action_time_out_w, w.action_time_out_b)], dim=1)
    allowed = suffix_mask(prefix, chunk)
    positions = prefix.n_valid[:, None] + torch.arange(1 + chunk, device=x.device)
    cos, sin = rope_cos_sin(positions, w.rope_inv_freq, act)
    for i, L in enumerate(w.expert_layers):
        hn = (rms_normalize(x, eps) * L.attn_norm).to(act)
        q, k, v = split_heads(linear(hn, L.qkv_w), e.heads, e.kv_heads, e.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = torch.cat([prefix.k[i].to(k.dtype), k], dim=2)
        v = torch.cat([prefix.v[i].to(v.dtype), v], dim=2)
        x = x + linear(attention(q, k, v, allowed), L.o_w).to(act)
        hn = (rms_normalize(x, eps) * L.mlp_norm).to(act)
        gate, up = linear(hn, L.gate_up_w).chunk(2, dim=-1)
        x = x + linear(gelu_tanh(gate) * up, L.down_w).to(act)
    x = (rms_normalize(x, eps) * w.final_norm).to(act)
    return linear(x[:, 1:].float(), w.action_out_w.float(), w.action_out_b.float())


def denoise(w: Pi0Weights, prefix: PrefixCache, state: torch.Tensor, noise: torch.Tensor,
            rtc: RTCInputs | None = None) -> torch.Tensor:
    """Euler-integrate from t=1 (noise [B, chunk, dim]) to t=0 with the robot state [B, <= max_state_dim];
    with `rtc`, every step guided towards the previous chunk (`flashrt_core.models.rtc`, LeRobot's RTC)."""
    token = linear(padded_state(w, state), w.state_w, w.state_b)[:, None]
    x_t = noise.float()
    for step in range(w.config.num_steps):
        v = velocity(w, prefix, token, x_t, step)
        x_t = x_t + w.dt * v if rtc is None else guided_step(x_t, v, rtc, 1.0 + step * w.dt, w.dt)
    return x_t


def sample_actions(w: Pi0Weights, images, image_masks, lang_tokens, lang_mask, state, noise) -> torch.Tensor:
    return denoise(w, encode_prefix(w, images, image_masks, lang_tokens, lang_mask), state, noise)


class ReferenceEngine:
    """The eager reference behind pi0's engine interface: `encode_prefix(...)` and `denoise(prefix, state,
    noise)` (the act stage takes the state: pi0's point of a fast act over a slow prefix)."""

    name = "reference"

    def __init__(self, weights: Pi0Weights):
        self.weights = weights

    @torch.no_grad()
    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask) -> PrefixCache:
        check_model_inputs(self.weights.config, images, image_masks, lang_tokens, lang_mask)
        return encode_prefix(self.weights, images, image_masks, lang_tokens, lang_mask)

    @torch.no_grad()
    def denoise(self, prefix: PrefixCache, state: torch.Tensor, noise: torch.Tensor,
                rtc: RTCInputs | None = None) -> torch.Tensor:
        batch = check_prefix(self.weights.config, prefix)
        check_noise(self.weights.config, noise, batch)
        if state.shape[0] != batch:
            raise InputError(f"state: batch {state.shape[0]}, the prefix has {batch}")
        return denoise(self.weights, prefix, state, noise, rtc)


def make_engine(weights: Pi0Weights, precision=None) -> ReferenceEngine:
    """The eager engine; a quantized `precision` multiplies by the quantized weights, dequantized."""
    return ReferenceEngine(quantize(weights, parse_precision(precision), packed=False))
