"""Readable eager SmolVLA in plain torch (fp32), numerically following LeRobot 0.6.1 (`VLAFlowMatching.sample_actions`).

Two stages, as the project's other models:
  encode_prefix: images + prompt + state -> SigLIP -> pixel-shuffle connector -> SmolLM2 layers -> the K/V every
                 expert layer reads (`PrefixCache`). A cross-attention expert layer reads the VLM layer's K/V
                 through its own k/v projections: applied here, once per observation, not at every flow step.
  denoise:       noise + prefix -> `num_steps` Euler steps of the action expert -> action chunk.
The prefix has the fixed length `config.prefix_len`: [slot 0 | slot 1 | ... | prompt padded to
tokenizer_max_length | state]; padding (missing cameras, prompt padding) is masked instead of removed, which
LeRobot's masks and position ids (cumulative count of real tokens) make equivalent.
Masks, as LeRobot builds them: image and prompt tokens see each other (not the state), the state token sees
them and itself; an action token sees the real prefix and the action tokens up to itself (causal), in the
self-attention layers; a cross-attention layer's actions see the real prefix only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core.models.precision import parse_precision
from flashrt_core.models.rtc import RTCInputs, guided_step
from flashrt_core.models.smolvla.config import SmolVLAConfig
from flashrt_core.models.smolvla.inputs import check_model_inputs, check_noise, check_prefix
from flashrt_core.models.smolvla.weights import SmolVLAWeights

MASK_VALUE = torch.finfo(torch.float32).min  # LeRobot's smolvla masks with finfo.min


@dataclass
class PrefixCache:
    """What `denoise` needs from an observation: per expert layer j, the prefix K/V it attends to (the RoPE'd
    K/V of VLM layer j * expert_stride for a self-attention layer, those through the layer's k/v projections
    for a cross-attention one), and the padding mask."""

    k: torch.Tensor  # [expert.depth, B, kv_heads, prefix_len, head_dim]
    v: torch.Tensor
    pad_mask: torch.Tensor  # [B, prefix_len] bool: True where the token is real
    n_valid: torch.Tensor  # [B] long: real prefix tokens; the self-attention layers' action positions start here


# ---- building blocks --------------------------------------------------------------------------------
def linear(x, w, b=None):
    return F.linear(x.to(w.dtype), w, b)


def rms_norm(x, weight, eps: float):
    """Llama RMSNorm: statistics in fp32, `weight * x_normed` (no 1 + w)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [B, 1, T, head_dim // 2] of integer positions [B, T], as LeRobot's smolvla `apply_rope` makes
    them: angle = position / theta ** (2 i / head_dim) (a division, in fp32)."""
    exps = (2.0 / head_dim) * torch.arange(head_dim // 2, dtype=torch.float32, device=positions.device)
    angle = positions.float()[..., None] / (theta ** exps)
    return angle.cos()[:, None], angle.sin()[:, None]


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on x [B, H, T, Dh] in fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention(q, k, v, allowed):
    """q [B, H, Tq, D], k / v [B, KV, Tk, D], allowed [B, Tq, Tk] bool or None -> [B, Tq, H*D]. LeRobot's
    eager softmax(q k^T / sqrt(D), masked with finfo.min) v, through torch's SDPA (same to ~1e-7 in fp32)."""
    b, h, tq, _ = q.shape
    mask = None if allowed is None else torch.where(allowed[:, None], 0.0, MASK_VALUE).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, enable_gqa=h != k.shape[1])
    return out.transpose(1, 2).reshape(b, tq, -1)


def heads(x, n: int, head_dim: int):
    """[B, T, n * Dh] -> [B, n, T, Dh]."""
    return x.view(*x.shape[:2], n, head_dim).transpose(1, 2)


def swiglu_mlp(L, x):
    gate, up = linear(x, L.gate_up_w).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, L.down_w)


# ---- SigLIP + connector ---------------------------------------------------------------------------
def siglip(w: SmolVLAWeights, pixels: torch.Tensor) -> torch.Tensor:
    """pixels [N, 3, S, S] in [-1, 1] -> patch features [N, patches, hidden] after the post LayerNorm."""
    vc = w.config.vision
    x = F.conv2d(pixels.to(w.patch_w.dtype), w.patch_w, w.patch_b, stride=vc.patch)
    x = x.flatten(2).transpose(1, 2) + w.pos_emb
    for L in w.vision_layers:
        h = F.layer_norm(x, (vc.hidden,), L.ln1_w, L.ln1_b, vc.ln_eps)
        q, k, v = (heads(t, vc.heads, vc.head_dim) for t in linear(h, L.qkv_w, L.qkv_b).chunk(3, dim=-1))
        x = x + linear(attention(q, k, v, None), L.out_w, L.out_b)
        h = F.layer_norm(x, (vc.hidden,), L.ln2_w, L.ln2_b, vc.ln_eps)
        x = x + linear(F.gelu(linear(h, L.fc1_w, L.fc1_b), approximate="tanh"), L.fc2_w, L.fc2_b)
    return F.layer_norm(x, (vc.hidden,), w.post_ln_w, w.post_ln_b, vc.ln_eps)


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """[N, side*side, D] -> [N, side*side / s^2, D * s^2]: each token holds an s x s block of patches, the
    row in the block outer, then the column, then the feature, as SmolVLM's connector orders them."""
    n, seq, d = x.shape
    side = math.isqrt(seq)
    x = x.view(n, side // s, s, side // s, s, d)  # (block row, row in block, block col, col in block)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(n, seq // s ** 2, s * s * d)


def image_tokens(w: SmolVLAWeights, pixels: torch.Tensor) -> torch.Tensor:
    """pixels [N, 3, S, S] -> connector tokens [N, image_tokens, vlm.width], scaled by sqrt(width) as LeRobot's
    embed_prefix scales them."""
    x = linear(pixel_shuffle(siglip(w, pixels), w.config.scale_factor), w.connector_w)
    return x * torch.tensor(w.config.vlm.width ** 0.5, dtype=x.dtype)


# ---- prefix ----------------------------------------------------------------------------------------
def pad_prompt(c: SmolVLAConfig, lang_tokens, lang_mask):
    """Prompt [B, L <= tokenizer_max_length] -> [B, tokenizer_max_length] (id 0, masked, past L)."""
    pad = c.tokenizer_max_length - lang_tokens.shape[1]
    return F.pad(lang_tokens.long(), (0, pad)), F.pad(lang_mask.bool(), (0, pad))


def embed_prefix(w: SmolVLAWeights, images, image_masks, lang_tokens, lang_mask, state):
    """-> embeddings [B, prefix_len, width] and pad mask [B, prefix_len] in LeRobot's order."""
    c = w.config
    b, s = images.shape[:2]
    masks = image_masks.bool()
    if s < c.num_image_slots:  # unused slots are missing cameras: the prefix keeps its fixed length
        images = torch.cat([images, images.new_full((b, c.num_image_slots - s, *images.shape[2:]), -1.0)], 1)
        masks = F.pad(masks, (0, c.num_image_slots - s))
        s = c.num_image_slots
    # A missing camera (mask False) is a -1 image, as LeRobot builds it: what the slot held never matters.
    images = images.masked_fill(~masks[:, :, None, None, None], -1.0)
    img = image_tokens(w, images.flatten(0, 1).to(w.patch_w.dtype)).to(w.embed.dtype).view(b, s, c.image_tokens, -1)
    img_pad = masks[:, :, None].expand(b, s, c.image_tokens)
    if c.add_image_special_tokens:  # unscaled embeddings, real even where the camera is missing
        start = w.embed[[c.fake_image_token_id, c.global_image_token_id]].expand(b, s, 2, -1)
        end = w.embed[[c.fake_image_token_id]].expand(b, s, 1, -1)
        img = torch.cat([start, img, end], dim=2)
        ones = torch.ones(b, s, 2, dtype=torch.bool, device=masks.device)
        img_pad = torch.cat([ones, img_pad, ones[:, :, :1]], dim=2)
    tokens, tmask = pad_prompt(c, lang_tokens, lang_mask)
    lang = F.embedding(tokens, w.embed) * math.sqrt(c.vlm.width)
    state = F.pad(state.float(), (0, c.max_state_dim - state.shape[-1]))
    st = linear(state, w.state_w, w.state_b)[:, None].to(lang.dtype)
    x = torch.cat([img.reshape(b, s * c.slot_tokens, -1), lang, st], dim=1)
    pad = torch.cat([img_pad.reshape(b, -1), tmask, torch.ones(b, 1, dtype=torch.bool, device=tmask.device)], dim=1)
    return x, pad


def prefix_allowed(pad: torch.Tensor) -> torch.Tensor:
    """[B, P, P] bool: real tokens see real tokens, except that only the state token (last) sees the state."""
    allowed = pad[:, None, :] & pad[:, :, None]
    allowed[:, :-1, -1] = False
    return allowed


def encode_prefix(w: SmolVLAWeights, images, image_masks, lang_tokens, lang_mask, state) -> PrefixCache:
    """images [B, S, 3, size, size] in [-1, 1], image_masks [B, S], lang_tokens / lang_mask [B, L], state
    [B, <= max_state_dim] (normalized) -> PrefixCache."""
    c = w.config
    g, eps = c.vlm, c.rms_eps
    x, pad = embed_prefix(w, images, image_masks, lang_tokens, lang_mask, state)
    allowed = prefix_allowed(pad)
    cos, sin = rope_cos_sin(torch.cumsum(pad.long(), dim=1) - 1, g.head_dim, c.rope_theta)
    ks, vs = [], []
    for i, L in enumerate(w.vlm_layers):
        h = rms_norm(x, L.attn_norm, eps)
        q, k, v = linear(h, L.qkv_w).split([g.heads * g.head_dim, g.kv_heads * g.head_dim, g.kv_heads * g.head_dim], -1)
        q, k, v = heads(q, g.heads, g.head_dim), heads(k, g.kv_heads, g.head_dim), heads(v, g.kv_heads, g.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        j = c.expert_layer(i)
        if j is not None:
            E = w.expert_layers[j]
            if E.cross:  # the expert's k/v projections of the RoPE'd VLM K and V (token-major rows)
                ks.append(heads(linear(k.transpose(1, 2).flatten(2), E.k_w), g.kv_heads, g.head_dim))
                vs.append(heads(linear(v.transpose(1, 2).flatten(2), E.v_w), g.kv_heads, g.head_dim))
            else:
                ks.append(k)
                vs.append(v)
        if i == len(w.vlm_layers) - 1:
            break  # the last layer's attention output and MLP only feed the unused prefix outputs
        x = x + linear(attention(q, k, v, allowed), L.o_w).to(x.dtype)
        x = x + swiglu_mlp(L, rms_norm(x, L.mlp_norm, eps)).to(x.dtype)
    return PrefixCache(k=torch.stack(ks), v=torch.stack(vs), pad_mask=pad, n_valid=pad.sum(dim=1))


# ---- action expert ---------------------------------------------------------------------------------
def velocity(w: SmolVLAWeights, prefix: PrefixCache, x_t: torch.Tensor, step: int) -> torch.Tensor:
    """The flow's velocity at Euler step `step` for actions x_t [B, chunk, max_action_dim] (fp32 out)."""
    c = w.config
    e, eps = c.expert, c.rms_eps
    b, chunk, _ = x_t.shape
    a = linear(x_t, w.action_in_w, w.action_in_b)
    t = w.time_emb[step].to(a.dtype).expand(b, chunk, -1)
    x = linear(F.silu(linear(torch.cat([a, t], dim=2), w.time_in_w, w.time_in_b)), w.time_out_w, w.time_out_b)
    n_prefix = prefix.pad_mask.shape[1]
    ar = torch.arange(chunk, device=x.device)
    cross_allowed = prefix.pad_mask[:, None, :].expand(b, chunk, n_prefix)
    self_allowed = torch.cat([cross_allowed, (ar[None, :] <= ar[:, None]).expand(b, chunk, chunk)], dim=2)
    cross_rope = rope_cos_sin(ar[None].expand(b, chunk), e.head_dim, c.rope_theta)  # positions from 0
    self_rope = rope_cos_sin(prefix.n_valid[:, None] + ar, e.head_dim, c.rope_theta)  # after the real prefix
    for j, L in enumerate(w.expert_layers):
        h = rms_norm(x, L.attn_norm, eps)
        if L.cross:
            q = apply_rope(heads(linear(h, L.q_w), e.heads, e.head_dim), *cross_rope)
            k, v, allowed = prefix.k[j], prefix.v[j], cross_allowed
        else:
            q, k, v = linear(h, L.qkv_w).split([e.heads * e.head_dim, e.kv_heads * e.head_dim,
                                                e.kv_heads * e.head_dim], -1)
            q = apply_rope(heads(q, e.heads, e.head_dim), *self_rope)
            k = torch.cat([prefix.k[j].to(k.dtype), apply_rope(heads(k, e.kv_heads, e.head_dim), *self_rope)], 2)
            v = torch.cat([prefix.v[j].to(v.dtype), heads(v, e.kv_heads, e.head_dim)], 2)
            allowed = self_allowed
        x = x + linear(attention(q, k, v, allowed), L.o_w).to(x.dtype)
        x = x + swiglu_mlp(L, rms_norm(x, L.mlp_norm, eps)).to(x.dtype)
    return linear(rms_norm(x, w.expert_norm, eps), w.action_out_w, w.action_out_b).float()


def denoise(w: SmolVLAWeights, prefix: PrefixCache, noise: torch.Tensor, rtc: RTCInputs | None = None
            ) -> torch.Tensor:
    """Euler-integrate the flow from t=1 (noise [B, chunk, max_action_dim]) to t=0 -> actions (fp32); with `rtc`,
    every step guided towards the previous chunk (`flashrt_core.models.rtc`: LeRobot's RTC, whose SmolVLA runs
    the same `euler_integrate` + `RTCProcessor.denoise_step` as pi0.5)."""
    dt = w.config.dt
    x_t = noise.float()
    for step in range(w.config.num_steps):
        v = velocity(w, prefix, x_t, step)
        x_t = x_t + dt * v if rtc is None else guided_step(x_t, v, rtc, 1.0 + step * dt, dt)
    return x_t


def sample_actions(w: SmolVLAWeights, images, image_masks, lang_tokens, lang_mask, state, noise) -> torch.Tensor:
    return denoise(w, encode_prefix(w, images, image_masks, lang_tokens, lang_mask, state), noise)


class ReferenceEngine:
    """The eager reference behind the staged engine interface (`encode_prefix`, `denoise`, `sample_actions`)."""

    name = "reference"

    def __init__(self, weights: SmolVLAWeights):
        self.weights = weights

    @torch.no_grad()
    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask, state) -> PrefixCache:
        check_model_inputs(self.weights.config, images, image_masks, lang_tokens, lang_mask, state)
        return encode_prefix(self.weights, images, image_masks, lang_tokens, lang_mask, state)

    @torch.no_grad()
    def denoise(self, prefix: PrefixCache, noise: torch.Tensor, rtc: RTCInputs | None = None) -> torch.Tensor:
        check_noise(self.weights.config, noise, check_prefix(self.weights.config, prefix))
        return denoise(self.weights, prefix, noise, rtc)

    def sample_actions(self, images, image_masks, lang_tokens, lang_mask, state, noise) -> torch.Tensor:
        return self.denoise(self.encode_prefix(images, image_masks, lang_tokens, lang_mask, state), noise)


def make_engine(weights: SmolVLAWeights, precision=None) -> ReferenceEngine:
    """The policy's engine hook (`models.precision.build_engine`): the eager reference (unquantized only)."""
    if precision is not None and parse_precision(precision).quantized:
        raise ValueError("SmolVLA reference: quantized precisions are not supported yet")
    return ReferenceEngine(weights)
