"""The fused SmolVLA engine: SigLIP + connector + SmolLM2 layers as the `observe` stage, the action expert's Euler
loop as the `act` stage, over static buffers (one CUDA graph per stage on CUDA).

Same staged API as the eager reference (`reference.py`):
  encode_prefix(images, image_masks, lang_tokens, lang_mask, state) -> PrefixCache   (stage `observe`)
  denoise(prefix, noise[, rtc]) -> actions                                           (stage `act`)
  sample_actions(images, image_masks, lang_tokens, lang_mask, state, noise)          (a whole decision)
The model-neutral parts (flow buffers, observation staging, share_prefix / set_prefix, RTC) are
`flashrt_core.engine.flow.FlowEngine`'s. What the observe stage does besides the GEMMs: LayerNorm / RMSNorm with
their residuals, the QKV split + RoPE + K/V write (`kernels.qkv_rope_cache`, with LeRobot's RoPE tables), the
prefix attention as two calls (image + prompt tokens over the real prefix without the state token, the state token
over all of it: LeRobot's one-block prefix-LM mask), SwiGLU (`kernels.swiglu`), and, once per observation, the
cross-attention expert layers' k/v projections of the VLM's K/V into the prefix cache, so the act stage's cross
layers only project their queries.
The act stage: the action-time MLP's time half is a per-step bias table (`weights.time_bias`), its silu fused in
the GEMM; cross-attention layers attend the projected prefix with the pad mask (`StagedEngine.attend`); the
self-attention layers' actions attend the prefix plus the actions up to themselves (causal, as LeRobot's suffix
mask), through torch's SDPA with a mask made once per act stage (the project's attention kernel has no causal
second key set); the Euler update is the action-out GEMM's epilogue.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core import kernels as K
from flashrt_core.engine.blas import linear_bias_gelu_tanh, patch_embed, patch_matrix
from flashrt_core.engine.flow import FlowBuffers, FlowEngine
from flashrt_core.engine.staged import _same
from flashrt_core.kernels.skinny_gemm import GatedResidual
from flashrt_core.models.precision import parse_precision
from flashrt_core.models.rtc import RTCInputs
from flashrt_core.models.smolvla.inputs import check_model_inputs, check_noise, check_prefix
from flashrt_core.models.smolvla.reference import PrefixCache
from flashrt_core.models.smolvla.weights import SmolVLAWeights


@dataclass
class SmolVLABuffers(FlowBuffers):
    """Everything a decision reads or writes, allocated once per batch size (fixed CUDA-graph addresses)."""

    images: torch.Tensor  # [B, slots, 3, S, S] SigLIP input in [-1, 1]
    image_masks: torch.Tensor  # [B, slots] bool
    lang_tokens: torch.Tensor  # [B, tokenizer_max_length] int64
    lang_mask: torch.Tensor  # [B, tokenizer_max_length] bool
    state: torch.Tensor  # [B, max_state_dim] fp32, normalized, zero padded
    prefix_k: torch.Tensor  # [expert.depth, B, kv_heads, prefix_len, head_dim] (PrefixCache.k)
    prefix_v: torch.Tensor
    pad_mask: torch.Tensor  # [B, prefix_len] bool
    n_valid: torch.Tensor  # [B] int64

    @classmethod
    def allocate(cls, w, batch: int, device, dtype, vision_dtype) -> "SmolVLABuffers":
        c, e = w.config, w.config.expert
        kv = (e.depth, batch, e.kv_heads, c.prefix_len, e.head_dim)
        return cls(**FlowBuffers.flow_fields(batch, c.chunk_size, c.max_action_dim, c.num_steps, device),
                   images=torch.full((batch, c.num_image_slots, 3, c.image_size, c.image_size), -1.0, device=device,
                                     dtype=vision_dtype),
                   image_masks=torch.zeros(batch, c.num_image_slots, dtype=torch.bool, device=device),
                   lang_tokens=torch.zeros(batch, c.tokenizer_max_length, dtype=torch.int64, device=device),
                   lang_mask=torch.zeros(batch, c.tokenizer_max_length, dtype=torch.bool, device=device),
                   state=torch.zeros(batch, c.max_state_dim, dtype=torch.float32, device=device),
                   prefix_k=torch.zeros(kv, dtype=dtype, device=device), prefix_v=torch.zeros(kv, dtype=dtype, device=device),
                   pad_mask=torch.zeros(batch, c.prefix_len, dtype=torch.bool, device=device),
                   n_valid=torch.zeros(batch, dtype=torch.int64, device=device))


def rope_tables(max_positions: int, head_dim: int, theta: float, device=None):
    """fp32 cos / sin [max_positions, head_dim // 2] as LeRobot's smolvla apply_rope computes the angles
    (position / theta ** (2 i / head_dim), a division: `kernels.rope_cos_sin` multiplies by an inverse)."""
    exps = (2.0 / head_dim) * torch.arange(head_dim // 2, dtype=torch.float32, device=device)
    angle = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] / (theta ** exps)
    return angle.cos(), angle.sin()


class SmolVLAEngine(FlowEngine):
    """SmolVLA over static buffers (constructor: `FlowEngine`'s; bf16 / fp32, no quantized precision yet)."""

    Buffers = SmolVLABuffers
    OBSERVATION = ("images", "image_masks", "lang_tokens", "lang_mask", "state")
    PREFIX = {"k": "prefix_k", "v": "prefix_v", "pad_mask": "pad_mask", "n_valid": "n_valid"}

    def __init__(self, weights: SmolVLAWeights, *args, precision=None, **kwargs):
        precision = parse_precision(precision)
        if precision.quantized:  # (models.precision quantizes merged q|k|v layers; cross layers keep q, k, v apart)
            raise ValueError(f"SmolVLAEngine: quantized precision {precision.name!r} is not supported yet")
        super().__init__(weights, *args, precision=precision, **kwargs)
        w, c, dev = self.weights, self.config, self.device
        self.prefix_layers = c.expert.depth  # prefix_done(j) / prefix_wait(j): expert layer j's K/V are final
        self.cos, self.sin = rope_tables(c.prefix_len + c.chunk_size, c.vlm.head_dim, c.rope_theta, device=dev)
        self._patch_mat = patch_matrix(w.patch_w)
        # LeRobot scales image tokens by a tensor sqrt(width) in their dtype, prompt tokens by the Python float
        self._img_scale = float(torch.tensor(c.vlm.width ** 0.5, dtype=torch.float32).to(self.dtype))
        self._lang_scale = math.sqrt(c.vlm.width)
        # the action-time MLP: its action half as a contiguous matrix, its time half + bias per step (model dtype)
        self._time_in_a = w.time_in_action_w.contiguous()
        self._time_bias = w.time_bias.to(self.dtype)
        if c.add_image_special_tokens:
            self._img_start = w.embed[[c.fake_image_token_id, c.global_image_token_id]]
            self._img_end = w.embed[[c.fake_image_token_id]]

    def check_observation(self, images, image_masks, lang_tokens, lang_mask, state) -> None:
        check_model_inputs(self.config, images, image_masks, lang_tokens, lang_mask, state)

    def check_prefix(self, prefix) -> int:
        return check_prefix(self.config, prefix)

    def _swiglu(self, h, gate_up_w):
        """SwiGLU MLP's first half: the gate|up GEMM, then silu(gate) * up in one kernel."""
        return K.swiglu(self.linear(h, gate_up_w), backend=self.backend)

    # ---- the observe stage ------------------------------------------------------------------------------
    def _siglip(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] -> patch features [N, patches, hidden] after the post LayerNorm (vision dtype)."""
        w, vc, be, lin = self.weights, self.config.vision, self.backend, self.linear
        layers = w.vision_layers
        # the patch embedding as one GEMM; the position embedding is added by the first LayerNorm's kernel
        x, h = K.add_layer_norm(patch_embed(pixels, w.patch_w, w.patch_b, self._patch_mat), w.pos_emb,
                                layers[0].ln1_w, layers[0].ln1_b, vc.ln_eps, backend=be)
        n, t = x.shape[:2]
        for i, L in enumerate(layers):
            qkv = lin(h, L.qkv_w, L.qkv_b).view(n, t, 3, vc.heads, vc.head_dim)
            a = self.attend(qkv[:, :, 0], qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2), backend=be)
            o = lin(a.reshape(n, t, vc.hidden), L.out_w, L.out_b)
            x, h = K.add_layer_norm(o, x, L.ln2_w, L.ln2_b, vc.ln_eps, residual_out=x, backend=be)
            f = linear_bias_gelu_tanh(h, L.fc1_w, L.fc1_b) if h.is_cuda else K.bias_gelu(lin(h, L.fc1_w), L.fc1_b,
                                                                                         backend=be)
            nw, nb = (layers[i + 1].ln1_w, layers[i + 1].ln1_b) if i + 1 < len(layers) else (w.post_ln_w, w.post_ln_b)
            x, h = K.add_layer_norm(lin(f, L.fc2_w, L.fc2_b), x, nw, nb, vc.ln_eps, residual_out=x, backend=be)
        return h

    def _image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] -> scaled connector tokens [N, image_tokens, vlm.width] (model dtype)."""
        x = self._siglip(pixels)
        n, seq, d = x.shape
        s, side = self.config.scale_factor, math.isqrt(seq)
        # pixel shuffle: each token an s x s block of patches (row in block, column, feature), one copy
        x = x.view(n, side // s, s, side // s, s, d).permute(0, 1, 3, 2, 4, 5).reshape(n, seq // s ** 2, s * s * d)
        return (self.linear(x, self.weights.connector_w) * self._img_scale).to(self.dtype)

    def _observe_body(self, prefix_done=None) -> None:
        """images + prompt + state buffers -> every expert layer's prefix K/V, pad mask and valid count."""
        w, c, buf, be, lin = self.weights, self.config, self.buffers, self.backend, self.linear
        g, eps, P = c.vlm, c.rms_eps, c.prefix_len
        b, slots = buf.image_masks.shape
        ones = torch.ones(b, slots, 2, dtype=torch.bool, device=self.device)
        img_pad = buf.image_masks[:, :, None].expand(b, slots, c.image_tokens)
        if c.add_image_special_tokens:  # the special tokens are real even where the camera is missing
            img_pad = torch.cat([ones, img_pad, ones[:, :, :1]], dim=2)
        pad = torch.cat([img_pad.reshape(b, -1), buf.lang_mask, ones[:, 0, :1]], dim=1)
        buf.pad_mask.copy_(pad)
        buf.n_valid.copy_(pad.sum(dim=1))
        if prefix_done is not None:
            prefix_done(-1)
        no_state = pad.clone()  # image and prompt tokens do not see the state token (the last)
        no_state[:, -1] = False
        # a masked (missing) camera reads as a -1 image, as LeRobot builds it; token ids clamped into the table
        pixels = torch.where(buf.image_masks[:, :, None, None, None], buf.images, -1.0)
        img = self._image_tokens(pixels.flatten(0, 1)).view(b, slots, c.image_tokens, -1)
        if c.add_image_special_tokens:
            img = torch.cat([self._img_start.expand(b, slots, 2, -1), img, self._img_end.expand(b, slots, 1, -1)], 2)
        lang = F.embedding(buf.lang_tokens.clamp(0, c.vocab_size - 1), w.embed) * self._lang_scale
        st = lin(buf.state, w.state_w, w.state_b)[:, None]
        x = torch.cat([img.reshape(b, slots * c.slot_tokens, -1), lang.to(self.dtype), st.to(self.dtype)], dim=1)
        positions = (torch.cumsum(pad, dim=1) - 1).clamp_(min=0)  # padding gets a clamped (unused) position
        scratch_k = torch.empty(b, g.kv_heads, P, g.head_dim, device=self.device, dtype=self.dtype)
        scratch_v = torch.empty_like(scratch_k)
        layers = w.vlm_layers
        h = K.rms_norm(x, layers[0].attn_norm, eps, weight_offset=0.0, backend=be)
        for i, L in enumerate(layers):
            j = c.expert_layer(i)
            direct = j is not None and not c.is_cross(i)  # a self-attention expert layer reads these K/V as they are
            kc, vc = (buf.prefix_k[j], buf.prefix_v[j]) if direct else (scratch_k, scratch_v)
            q = K.qkv_rope_cache(lin(h, L.qkv_w), positions, self.cos, self.sin, kc, vc, 0,
                                 num_q_heads=g.heads, num_kv_heads=g.kv_heads, backend=be)
            if j is not None and not direct:  # the cross layer's k / v projections, once per observation
                E = w.expert_layers[j]
                for src, proj, dst in ((kc, E.k_w, buf.prefix_k[j]), (vc, E.v_w, buf.prefix_v[j])):
                    rows = lin(src.transpose(1, 2).reshape(b, P, -1), proj)
                    dst.copy_(rows.view(b, P, g.kv_heads, g.head_dim).transpose(1, 2))
            if j is not None and prefix_done is not None:
                prefix_done(j)
            if i == len(layers) - 1:
                break  # the last layer's attention output and MLP only feed the unused prefix outputs
            a = torch.empty_like(q)
            self.attend(q[:, :P - 1], kc, vc, key_mask=no_state, out=a[:, :P - 1], backend=be)
            self.attend(q[:, P - 1:], kc, vc, key_mask=pad, out=a[:, P - 1:], backend=be)
            x, h = K.add_rms_norm(lin(a.flatten(2), L.o_w), x, L.mlp_norm, eps, weight_offset=0.0, residual_out=x,
                                  backend=be)
            d = lin(self._swiglu(h, L.gate_up_w), L.down_w)
            x, h = K.add_rms_norm(d, x, layers[i + 1].attn_norm, eps, weight_offset=0.0, residual_out=x, backend=be)

    # ---- the act stage --------------------------------------------------------------------------------
    def _act_body(self, prefix_wait=None, rtc: bool = False) -> None:
        """noise + prefix buffers -> `num_steps` Euler steps of the action expert -> actions; rtc: each step guided
        towards the RTC buffers' previous chunk (`set_rtc`; the "act+rtc" graph, LeRobot's real-time chunking)."""
        w, c, buf, be, lin = self.weights, self.config, self.buffers, self.backend, self.linear
        e, eps, chunk = c.expert, c.rms_eps, c.chunk_size
        b = buf.noise.shape[0]
        if prefix_wait is not None:
            prefix_wait(-1)
        ar = torch.arange(chunk, device=self.device)
        self_pos = buf.n_valid[:, None] + ar  # self-attention layers: the actions follow the real prefix
        cross_cos, cross_sin = self.cos[:chunk, None], self.sin[:chunk, None]  # cross layers: positions from 0
        # self-attention: the real prefix, then the actions up to each one (bool, True = attend)
        allowed = torch.cat([buf.pad_mask[:, None, :].expand(b, chunk, -1),
                             (ar[None, :] <= ar[:, None]).expand(b, chunk, chunk)], dim=2)[:, None]
        suffix_k = torch.empty(b, e.kv_heads, chunk, e.head_dim, device=self.device, dtype=self.dtype)
        suffix_v = torch.empty_like(suffix_k)
        x_t = buf.noise.clone()  # the fp32 flow state
        layers = w.expert_layers
        for step in range(c.num_steps):
            a = lin(x_t, w.action_in_w, w.action_in_b)
            x = lin(lin(a, self._time_in_a, self._time_bias[step], silu=True), w.time_out_w, w.time_out_b)
            h = K.rms_norm(x, layers[0].attn_norm, eps, weight_offset=0.0, backend=be)
            for j, L in enumerate(layers):
                if L.cross:
                    q = lin(h, L.q_w).view(b, chunk, e.heads, e.head_dim)
                    q = K.reference.apply_rope_ref(q, cross_cos, cross_sin).to(self.dtype)
                    if prefix_wait is not None and step == 0:
                        prefix_wait(j)
                    att = self.attend(q, buf.prefix_k[j], buf.prefix_v[j], key_mask=buf.pad_mask, constant_kv=True,
                                      backend=be)
                else:
                    q = K.qkv_rope_cache(lin(h, L.qkv_w), self_pos, self.cos, self.sin, suffix_k, suffix_v, 0,
                                         num_q_heads=e.heads, num_kv_heads=e.kv_heads, backend=be)
                    if prefix_wait is not None and step == 0:
                        prefix_wait(j)
                    keys = torch.cat([buf.prefix_k[j], suffix_k], dim=2)
                    values = torch.cat([buf.prefix_v[j], suffix_v], dim=2)
                    att = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=allowed,
                                                         enable_gqa=e.heads != e.kv_heads).transpose(1, 2)
                x, h = K.add_rms_norm(lin(att.reshape(b, chunk, -1), L.o_w), x, L.mlp_norm, eps, weight_offset=0.0,
                                      residual_out=x, backend=be)
                d = lin(self._swiglu(h, L.gate_up_w), L.down_w)
                nxt = layers[j + 1].attn_norm if j + 1 < len(layers) else w.expert_norm
                x, h = K.add_rms_norm(d, x, nxt, eps, weight_offset=0.0, residual_out=x, backend=be)
            if rtc:  # the velocity out, then the guided step
                self._guided_update(x_t, lin(h, w.action_out_w, w.action_out_b), step)
            else:  # x_t += dt * velocity in the action-out GEMM
                lin(h, w.action_out_w, w.action_out_b, residual=GatedResidual(x_t, self._dt))
        buf.actions.copy_(x_t)

    # ---- staged API (copies into the static buffers) --------------------------------------------------
    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask, state) -> PrefixCache:
        """-> PrefixCache viewing the engine's static buffers: valid until the next observe (clone to keep)."""
        self.set_observation(images, image_masks, lang_tokens, lang_mask, state)
        self.observe()
        buf = self.buffers
        return PrefixCache(k=buf.prefix_k, v=buf.prefix_v, pad_mask=buf.pad_mask, n_valid=buf.n_valid)

    def denoise(self, prefix: PrefixCache, noise: torch.Tensor, rtc: RTCInputs | None = None) -> torch.Tensor:
        """noise [B, chunk, max_action_dim] -> actions (a fresh fp32 tensor); checked before anything changes."""
        b = check_prefix(self.config, prefix)
        check_noise(self.config, noise, b)
        if not _same(prefix.k, self.buffers.prefix_k):
            self._resize(b)  # a cache from elsewhere may bring its own batch size
        self._copy_prefix(prefix)
        self.buffers.noise.copy_(noise)
        if rtc is not None:
            self.set_rtc(rtc)
        self.act(rtc=rtc is not None)
        return self.buffers.actions.clone()

    def sample_actions(self, images, image_masks, lang_tokens, lang_mask, state, noise) -> torch.Tensor:
        """One whole decision (`decision()`): observation + noise -> actions (a fresh fp32 tensor)."""
        self.check_observation(images, image_masks, lang_tokens, lang_mask, state)
        check_noise(self.config, noise, images.shape[0])
        self._write_observation(images, image_masks, lang_tokens, lang_mask, state)
        self.buffers.noise.copy_(noise)
        self.decision()
        return self.buffers.actions.clone()


def make_engine(weights: SmolVLAWeights, precision=None) -> SmolVLAEngine:
    """The policy's engine hook (`models.precision.build_engine`): the fused engine on the weights' device and dtype."""
    return SmolVLAEngine(weights, precision=precision)
