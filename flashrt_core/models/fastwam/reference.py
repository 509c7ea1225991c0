"""Readable eager FastWAM in plain torch (fp32), numerically following LeRobot 0.6.1 (`FastWAM.infer_action`).

Two stages, as the project's other models:
  prefill: the first frame's VAE latents + the prompt's UMT5 embedding + the state -> the video DiT at flow time 0
           (`MoT.prefill_video_cache`) -> per layer, the video tokens' RoPE'd K and V (`VideoCache`). The action
           DiT's cross-attention K/V of the context depend on the observation only: made here too, once.
  denoise: noise + cache -> `num_steps` Euler steps of the action DiT (`forward_action_with_video_cache` inside
           infer_action's loop) -> action chunk.
The state enters through the context (one proprio token after the prompt) that *both* DiTs cross-attend to, so
it is an input of `prefill`, not of `denoise`.

What LeRobot does that this mirrors:
- context = [UMT5 embedding (padding rows zeroed, mask all true) | proprio_encoder(state)]; each DiT embeds it
  with its own text_embedding MLP and cross-attends to all of it (mask [B, L], true = attend);
- modulation: block.modulation + t_mod -> shift/scale/gate of attention and FFN; norm1 / norm2 are LayerNorms
  without affine, norm3 (before cross-attention) has one; the FFN is gelu-tanh; every norm runs in fp32;
- q/k RMSNorm over all heads together (Wan's qk_norm), before RoPE; attention is SDPA with boolean masks;
- RoPE as complex products in float64: the video DiT's is 3-axis (head_dim / 2 pairs split frame | row | column
  as c - 2 (c // 3), c // 3, c // 3, positions from the patch grid), the action DiT's 1-axis (action index);
- masks: video tokens see each other except that the first frame does not see later frames (first_frame_causal);
  an action token sees the first frame's video tokens and every action token (`_build_mot_attention_mask`);
- time: sincos(t * 1000) in float64 -> fp32 -> time MLP; the video prefill is at t = 0, the action DiT at the
  shifted schedule (weights.py folds both into tables); Euler: x += velocity * (sigma_next - sigma).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core.errors import InputError
from flashrt_core.models.fastwam.config import FastWAMConfig
from flashrt_core.models.fastwam.weights import DiTLayer, FastWAMWeights, schedule, time_mlp


@dataclass
class VideoCache:
    """What `denoise` needs from an observation. Per layer l of the MoT: the video DiT's K/V of the observed
    frame (after q/k norm and 3-axis RoPE; V as projected) and the action DiT's cross-attention K/V of the
    context."""

    k: torch.Tensor  # [layers, B, heads, video_tokens, head_dim]
    v: torch.Tensor
    context_k: torch.Tensor  # [layers, B, heads, context_tokens, head_dim]
    context_v: torch.Tensor
    context_mask: torch.Tensor  # [B, context_tokens] bool: True = attended
    first_frame_tokens: int  # video tokens an action may attend to (the first latent frame's)


# ---- building blocks --------------------------------------------------------------------------------
def linear(x, w, b=None):
    return F.linear(x.to(w.dtype), w, b)


def layer_norm(x, eps: float, w=None, b=None):
    """WanLayerNorm / _wan_layer_norm: statistics and affine in fp32, result in x's dtype."""
    wf = None if w is None else w.float()
    bf = None if b is None else b.float()
    return F.layer_norm(x.float(), (x.shape[-1],), wf, bf, eps).to(x.dtype)


def rms_norm(x, w, eps: float):
    """WanRMSNorm: `normed(x.float()).type_as(x) * weight` over the whole (all-heads) width."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def heads(x, n: int) -> torch.Tensor:
    """[B, S, n * d] -> [B, n, S, d]."""
    return x.unflatten(-1, (n, -1)).transpose(1, 2)


def merge(x) -> torch.Tensor:
    """[B, n, S, d] -> [B, S, n * d]."""
    return x.transpose(1, 2).flatten(2)


def rope_freqs(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Wan's rope_params rows: angles position / theta^(2i / dim), i < dim / 2, in float64 [len(positions), dim/2]."""
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64).div(dim))
    return torch.outer(positions.to(torch.float64), inv)


def video_rope_angles(c: FastWAMConfig, grid: tuple[int, int, int]) -> torch.Tensor:
    """[f * h * w, head_dim / 2] float64 angles of the video tokens ("b c f h w -> b (f h w) c" order): the
    head's pairs split frame | row | column as Wan's rope_apply (tables of sub-widths d - 4 (d // 6), 2 (d // 6),
    2 (d // 6))."""
    d = c.video.head_dim
    half = d // 2
    sizes = (half - 2 * (half // 3), half // 3, half // 3)
    dims = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    f, h, w = grid
    axes = [rope_freqs(torch.arange(n), dim, c.rope_theta)[:, :size] for n, dim, size in zip(grid, dims, sizes)]
    return torch.cat([axes[0].view(f, 1, 1, -1).expand(f, h, w, -1),
                      axes[1].view(1, h, 1, -1).expand(f, h, w, -1),
                      axes[2].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1).reshape(f * h * w, -1)


def apply_rope(x, angles) -> torch.Tensor:
    """x [B, n, S, d] rotated pairwise ((x0, x1), (x2, x3), ...) by angles [S, d/2], as a complex product in
    float64 (Wan's rope_apply / apply_dense_rope), returned in fp32."""
    xc = torch.view_as_complex(x.to(torch.float64).unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)).flatten(-2).float()


def attention(q, k, v, allowed=None) -> torch.Tensor:
    """SDPA in fp32 (LeRobot's fp32_attention) over [B, n, S, d]; allowed: bool, True = attend."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed)


def split_mod(L: DiTLayer, t_mod: torch.Tensor):
    """(shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) of `modulation + t_mod` ([6, D])."""
    return (L.modulation.to(t_mod.dtype) + t_mod).unbind(0)


def self_qkv(L: DiTLayer, x, n_heads: int, eps: float, angles):
    """The layer's q, k, v [B, n, S, d] of its (already modulated) input: q/k RMS-normed, then RoPE'd."""
    q, k, v = linear(x, L.qkv_w, L.qkv_b).chunk(3, dim=-1)
    q, k = rms_norm(q, L.norm_q, eps), rms_norm(k, L.norm_k, eps)
    return apply_rope(heads(q, n_heads), angles), apply_rope(heads(k, n_heads), angles), heads(v, n_heads)


def context_kv(L: DiTLayer, context_emb, n_heads: int, eps: float):
    """The layer's cross-attention K/V [B, n, L, d] of the embedded context."""
    k, v = linear(context_emb, L.cross_kv_w, L.cross_kv_b).chunk(2, dim=-1)
    return heads(rms_norm(k, L.cross_norm_k, eps), n_heads), heads(v, n_heads)


def block_rest(L: DiTLayer, x, attn_out, mods, ctx_k, ctx_v, ctx_allowed, n_heads: int, eps: float):
    """After self-attention: gated output projection, cross-attention to the context, modulated gated FFN."""
    _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
    x = x + gate_msa * linear(merge(attn_out), L.o_w, L.o_b)
    q = rms_norm(linear(layer_norm(x, eps, L.norm3_w, L.norm3_b), L.cross_q_w, L.cross_q_b), L.cross_norm_q, eps)
    x = x + linear(merge(attention(heads(q, n_heads), ctx_k, ctx_v, ctx_allowed)), L.cross_o_w, L.cross_o_b)
    h = modulate(layer_norm(x, eps), shift_mlp, scale_mlp)
    return x + gate_mlp * linear(F.gelu(linear(h, L.ffn1_w, L.ffn1_b), approximate="tanh"), L.ffn2_w, L.ffn2_b)


def embed_context(text, w1, b1, w2, b2):
    """A DiT's text_embedding: Linear, gelu-tanh, Linear."""
    return linear(F.gelu(linear(text, w1, b1), approximate="tanh"), w2, b2)


# ---- inputs -------------------------------------------------------------------------------------------
def build_context(w: FastWAMWeights, text_emb, state=None, text_mask=None):
    """(context [B, L (+1), text_dim], mask [B, L (+1)] bool): the prompt embedding, then the proprio token
    (`FastWAM._append_proprio_to_context`) when the model has a proprio encoder."""
    c = w.config
    if text_emb.ndim != 3 or text_emb.shape[-1] != c.text_dim:
        raise InputError(f"text_emb: expected [B, L, {c.text_dim}], got {tuple(text_emb.shape)}")
    B = text_emb.shape[0]
    mask = torch.ones(text_emb.shape[:2], dtype=torch.bool) if text_mask is None else text_mask.to(torch.bool)
    if tuple(mask.shape) != tuple(text_emb.shape[:2]):
        raise InputError(f"text_mask: expected {tuple(text_emb.shape[:2])}, got {tuple(mask.shape)}")
    mask = mask.to(text_emb.device)
    if c.proprio_dim is None:
        if state is not None:
            raise InputError("state: given, but the checkpoint has no proprio encoder (proprio_dim None)")
        return text_emb, mask
    if state is None or tuple(state.shape) != (B, c.proprio_dim):
        raise InputError(f"state: expected [{B}, {c.proprio_dim}], got {None if state is None else tuple(state.shape)}")
    token = linear(state.to(text_emb.dtype)[:, None], w.proprio_w, w.proprio_b).to(text_emb.dtype)
    return torch.cat([text_emb, token], 1), torch.cat([mask, mask.new_ones(B, 1)], 1)


def video_self_allowed(tokens_per_frame: int, seq: int, device=None) -> torch.Tensor:
    """first_frame_causal: everything sees everything, except the first frame's tokens the later frames."""
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=device)
    allowed[:tokens_per_frame, tokens_per_frame:] = False
    return allowed


# ---- stages ---------------------------------------------------------------------------------------------
def prefill(w: FastWAMWeights, video_latents, text_emb, state=None, text_mask=None) -> VideoCache:
    """The video DiT at flow time 0 over the observed frame's latents [B, latent_channels, F, h, w] (F = 1 at
    inference: the first frame), conditioned on the prompt embedding [B, L, text_dim] and the state [B, proprio]."""
    c = w.config
    if video_latents.ndim != 5 or video_latents.shape[1] != c.latent_channels:
        raise InputError(f"video_latents: expected [B, {c.latent_channels}, F, h, w], got {tuple(video_latents.shape)}")
    _, _, _, lh, lw = video_latents.shape
    if lh % c.patch[1] or lw % c.patch[2]:
        raise InputError(f"video_latents: latent grid {lh}x{lw} is not a multiple of the patch {c.patch[1:]}")
    context, mask = build_context(w, text_emb, state, text_mask)
    B = video_latents.shape[0]
    if context.shape[0] != B:
        raise InputError(f"text_emb: batch {context.shape[0]} differs from video_latents' {B}")
    v, a = c.video, c.action
    x = F.conv3d(video_latents.to(w.patch_w.dtype), w.patch_w, w.patch_b, stride=c.patch)
    grid = tuple(x.shape[2:])
    tokens_per_frame = grid[1] * grid[2]
    x = x.flatten(2).transpose(1, 2)  # b c f h w -> b (f h w) c
    angles = video_rope_angles(c, grid).to(x.device)
    allowed = video_self_allowed(tokens_per_frame, x.shape[1], x.device)
    ctx_allowed = mask[:, None, None, :]
    video_ctx = embed_context(context, *w.video_text)
    action_ctx = embed_context(context, *w.action_text)
    t_mod = w.video_t_mod.to(x.dtype)
    ks, vs, cks, cvs = [], [], [], []
    for L, LA in zip(w.video_layers, w.action_layers):
        mods = split_mod(L, t_mod)
        q, k, val = self_qkv(L, modulate(layer_norm(x, v.eps), mods[0], mods[1]), v.heads, v.eps, angles)
        ck, cv = context_kv(L, video_ctx, v.heads, v.eps)
        x = block_rest(L, x, attention(q, k, val, allowed), mods, ck, cv, ctx_allowed, v.heads, v.eps)
        ks.append(k)
        vs.append(val)
        ack, acv = context_kv(LA, action_ctx, a.heads, a.eps)
        cks.append(ack)
        cvs.append(acv)
    return VideoCache(torch.stack(ks), torch.stack(vs), torch.stack(cks), torch.stack(cvs), mask,
                      first_frame_tokens=min(tokens_per_frame, x.shape[1]))


def velocity(w: FastWAMWeights, cache: VideoCache, x_t, step: int) -> torch.Tensor:
    """The action DiT's output at Euler step `step` (flow time w.timesteps[step]) for actions x_t [B, H, action_dim]."""
    c, a = w.config, w.config.action
    n_video = cache.k.shape[3]
    x = linear(x_t, w.action_in_w, w.action_in_b)
    horizon = x.shape[1]
    angles = rope_freqs(torch.arange(horizon), a.head_dim, c.rope_theta).to(x.device)
    # action rows of the joint [video | action] mask: the first frame's video tokens, then every action
    allowed = torch.zeros(horizon, n_video + horizon, dtype=torch.bool, device=x.device)
    allowed[:, :cache.first_frame_tokens] = True
    allowed[:, n_video:] = True
    ctx_allowed = cache.context_mask[:, None, None, :]
    t_mod = w.action_t_mod[step].to(x.dtype)
    for li, L in enumerate(w.action_layers):
        mods = split_mod(L, t_mod)
        q, k, v = self_qkv(L, modulate(layer_norm(x, a.eps), mods[0], mods[1]), a.heads, a.eps, angles)
        out = attention(q, torch.cat([cache.k[li], k], 2), torch.cat([cache.v[li], v], 2), allowed)
        x = block_rest(L, x, out, mods, cache.context_k[li], cache.context_v[li], ctx_allowed, a.heads, a.eps)
    return linear(x, w.action_out_w, w.action_out_b)


def check_noise(c: FastWAMConfig, noise: torch.Tensor, batch: int) -> None:
    if noise.ndim != 3 or noise.shape[0] != batch or noise.shape[2] != c.action_dim:
        raise InputError(f"noise: expected [{batch}, horizon, {c.action_dim}], got {tuple(noise.shape)}")
    if not 1 <= noise.shape[1] <= 1024:  # Wan's RoPE tables hold 1024 positions
        raise InputError(f"noise: horizon {noise.shape[1]} outside 1..1024")


def denoise(w: FastWAMWeights, cache: VideoCache, noise: torch.Tensor) -> torch.Tensor:
    """`num_steps` Euler steps from noise [B, horizon, action_dim] (flow time 1) to the action chunk."""
    check_noise(w.config, noise, cache.k.shape[1])
    x = noise.to(torch.float32)
    for i in range(w.config.num_steps):
        x = x + velocity(w, cache, x, i) * w.deltas[i].to(x.device)
    return x


def sample_actions(w: FastWAMWeights, video_latents, text_emb, state, noise, text_mask=None) -> torch.Tensor:
    """prefill + denoise: LeRobot's infer_action from the encoders' outputs on."""
    return denoise(w, prefill(w, video_latents, text_emb, state, text_mask), noise)


# ---- imagined future (LeRobot's infer_joint video path) ----------------------------------------------------
def split_mod_tokens(L: DiTLayer, t_mod: torch.Tensor):
    """As split_mod, with one modulation per token: t_mod [B, S, 6, D] -> six [B, S, D]."""
    return (L.modulation.to(t_mod.dtype) + t_mod).unbind(-2)


def video_velocity(w: FastWAMWeights, latents, context, ctx_mask, timestep) -> torch.Tensor:
    """The video DiT's output (`pre_dit` + the MoT's video stream + `post_dit`) for latents [B, C, F, h, w] at
    flow time `timestep` (units of num_train_timesteps), frame 0's tokens at time 0 (separated timesteps).
    In infer_joint the video tokens never attend to the action tokens (the joint mask's video rows are
    first_frame_causal over the video only), so the actions do not enter: the video stream runs alone.
    context / ctx_mask: `build_context`'s. Returns the velocity, shaped as latents."""
    c, v = w.config, w.config.video
    x = F.conv3d(latents.to(w.patch_w.dtype), w.patch_w, w.patch_b, stride=c.patch)
    B = x.shape[0]
    grid = tuple(x.shape[2:])
    f, gh, gw = grid
    tokens_per_frame = gh * gw
    x = x.flatten(2).transpose(1, 2)  # b c f h w -> b (f h w) c
    t = torch.full((f, tokens_per_frame), float(timestep), dtype=torch.float32)
    t[0] = 0.0
    t_emb, t_mod = time_mlp(w.video_time, v.freq_dim, t.reshape(-1).to(x.device))
    t_emb = t_emb.to(x.dtype)[None].expand(B, -1, -1)  # [B, S, hidden]
    t_mod = t_mod.to(x.dtype)[None].expand(B, -1, -1, -1)  # [B, S, 6, hidden]
    angles = video_rope_angles(c, grid).to(x.device)
    allowed = video_self_allowed(tokens_per_frame, x.shape[1], x.device)
    ctx_allowed = ctx_mask[:, None, None, :]
    video_ctx = embed_context(context, *w.video_text)
    for L in w.video_layers:
        mods = split_mod_tokens(L, t_mod)
        q, k, val = self_qkv(L, modulate(layer_norm(x, v.eps), mods[0], mods[1]), v.heads, v.eps, angles)
        ck, cv = context_kv(L, video_ctx, v.heads, v.eps)
        x = block_rest(L, x, attention(q, k, val, allowed), mods, ck, cv, ctx_allowed, v.heads, v.eps)
    # Head: LN (no affine) * (1 + scale) + shift, (shift, scale) = head modulation [2, D] + per-token t_emb
    shift, scale = (w.video_head_mod.to(t_emb.dtype) + t_emb[:, :, None]).unbind(-2)
    out = linear(modulate(layer_norm(x, v.eps), shift, scale), w.video_head_w, w.video_head_b)
    # unpatchify: [B, f h w, (p q r c)] -> [B, c, f p, h q, w r]
    p, q_, r = c.patch
    out = out.reshape(B, f, gh, gw, p, q_, r, -1)
    return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(B, -1, f * p, gh * q_, gw * r)


def imagine(w: FastWAMWeights, first_frame_latents, text_emb, state, video_noise, text_mask=None,
            shift: float | None = None) -> torch.Tensor:
    """The imagined future latents [B, C, T, h, w] of LeRobot's `infer_joint`: from video_noise [B, C, T, h, w]
    (LeRobot draws it with the action noise's seed: randn((1, z_dim, T, h, w)), T = (frames - 1) // 4 + 1),
    frame 0 replaced by the observed frame's latents before and after every step; `num_steps` Euler steps
    x += v * (sigma_next - sigma) over the video scheduler's shifted schedule (its infer_shift, default the
    config's `shift`, as sigma_shift overrides both), the video DiT at per-token timesteps (frame 0 at 0).
    The joint actions are `denoise`'s: the actions see only the clean first frame, whose K/V are the prefill's."""
    c = w.config
    if video_noise.ndim != 5 or video_noise.shape[1] != c.latent_channels or video_noise.shape[2] < 1:
        raise InputError(f"video_noise: expected [B, {c.latent_channels}, T, h, w], got {tuple(video_noise.shape)}")
    if first_frame_latents.ndim != 5 or first_frame_latents.shape[2] != 1 or \
            tuple(first_frame_latents.shape[:2]) + tuple(first_frame_latents.shape[3:]) != \
            tuple(video_noise.shape[:2]) + tuple(video_noise.shape[3:]):
        raise InputError(f"first_frame_latents: expected {tuple(video_noise.shape[:2])} + (1,) + "
                         f"{tuple(video_noise.shape[3:])}, got {tuple(first_frame_latents.shape)}")
    _, _, _, lh, lw = video_noise.shape
    if lh % c.patch[1] or lw % c.patch[2]:
        raise InputError(f"video_noise: latent grid {lh}x{lw} is not a multiple of the patch {c.patch[1:]}")
    context, mask = build_context(w, text_emb, state, text_mask)
    if context.shape[0] != video_noise.shape[0]:
        raise InputError(f"text_emb: batch {context.shape[0]} differs from video_noise's {video_noise.shape[0]}")
    timesteps, deltas = schedule(c.num_steps, c.shift if shift is None else float(shift), c.num_train_timesteps)
    first = first_frame_latents.to(torch.float32)
    x = video_noise.to(torch.float32).clone()
    x[:, :, :1] = first
    for t, d in zip(timesteps, deltas):
        x = x + video_velocity(w, x, context, mask, t) * d.to(x.device)
        x[:, :, :1] = first
    return x
