"""The PaliGemma prefix stage every pi model shares (SigLIP + projector + Gemma over images and prompt), fused.

`PaliGemmaEngine` holds the weights' prefix part, the static buffers of a decision (`EngineBuffers`: camera
images, prompt tokens + mask, prefix K/V of every layer, pad mask, valid count, and the flow state's noise and
actions that every flow-matching action expert reads and writes) and the `observe` stage: the patch
embedding as one GEMM, LayerNorm / RMSNorm with their residuals, QKV split + RoPE + K/V write, attention with
padding, GeGLU and bias + GELU in their GEMMs (fc1's through cuBLASLt's epilogue). A model's engine adds its
action expert (`_act_body`, `denoise`, `sample_actions`): pi0.5's in `models/pi05/engine.py`, pi0's in
`models/pi0/engine.py`. Graphs, hooks and launch settings: `flashrt_core.engine.staged`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core import kernels as K
from flashrt_core.engine.blas import linear_bias_gelu_tanh, patch_embed, patch_matrix
from flashrt_core.engine.flow import FlowBuffers, FlowEngine
from flashrt_core.kernels.fp8 import FP8Weight
from flashrt_core.models.paligemma.inputs import check_model_inputs, check_prefix
from flashrt_core.models.paligemma.reference import PrefixCache


@dataclass
class EngineBuffers(FlowBuffers):
    """Everything a decision reads or writes, allocated once per batch size (fixed CUDA-graph addresses): the
    flow state (`FlowBuffers`) and the observation and prefix of a PaliGemma prefix."""

    images: torch.Tensor  # [B, slots, 3, S, S] SigLIP input in [-1, 1]
    image_masks: torch.Tensor  # [B, slots] bool
    lang_tokens: torch.Tensor  # [B, L_max] int64
    lang_mask: torch.Tensor  # [B, L_max] bool
    prefix_k: torch.Tensor  # [depth, B, kv_heads, prefix_len, head_dim], RoPE applied
    prefix_v: torch.Tensor
    pad_mask: torch.Tensor  # [B, prefix_len] bool
    n_valid: torch.Tensor  # [B] int64

    @classmethod
    def allocate(cls, w, batch: int, device, dtype, vision_dtype) -> "EngineBuffers":
        c = w.config
        size, g = c.vision.image_size, c.vlm
        kv = (g.depth, batch, g.kv_heads, c.prefix_len, g.head_dim)
        return cls(
            **cls.flow_fields(batch, c.chunk_size, c.action_dim, c.num_steps, device),
            images=torch.full((batch, c.num_image_slots, 3, size, size), -1.0, device=device, dtype=vision_dtype),
            image_masks=torch.zeros(batch, c.num_image_slots, dtype=torch.bool, device=device),
            lang_tokens=torch.zeros(batch, c.tokenizer_max_length, dtype=torch.int64, device=device),
            lang_mask=torch.zeros(batch, c.tokenizer_max_length, dtype=torch.bool, device=device),
            prefix_k=torch.zeros(kv, dtype=dtype, device=device), prefix_v=torch.zeros(kv, dtype=dtype, device=device),
            pad_mask=torch.zeros(batch, c.prefix_len, dtype=torch.bool, device=device),
            n_valid=torch.zeros(batch, dtype=torch.int64, device=device),
        )


class PaliGemmaEngine(FlowEngine):
    """The prefix stage over static buffers (see the module docstring); `encode_prefix` copies an observation
    in and runs it, `share_prefix` makes a caller's buffers the engine's own."""

    Buffers = EngineBuffers  # the static buffers' class (a model with more inputs extends it)
    OBSERVATION = ("images", "image_masks", "lang_tokens", "lang_mask")
    PREFIX = {"k": "prefix_k", "v": "prefix_v", "pad_mask": "pad_mask", "n_valid": "n_valid"}

    def __init__(self, weights, *args, **kwargs):
        """As `FlowEngine`'s: weights in the engine layout (`pi05.convert` / `pi0.convert`)."""
        super().__init__(weights, *args, **kwargs)
        w, device = self.weights, self.device
        c = self.config
        self.prefix_layers = c.vlm.depth
        self.cos, self.sin = K.rope_cos_sin(c.prefix_len + c.chunk_size, c.vlm.head_dim, c.rope_theta, device=device)
        # Gemma multiplies token embeddings by sqrt(width) rounded to the table's dtype (a Python float:
        # no host->device copy during capture).
        self.embed_scale = float(torch.tensor(c.vlm.width ** 0.5, dtype=torch.float32).to(w.embed.dtype))
        self._patch_mat = patch_matrix(w.patch_w)  # [hidden, K padded to 16 bytes]

    def check_observation(self, images, image_masks, lang_tokens, lang_mask) -> None:
        check_model_inputs(self.config, images, image_masks, lang_tokens, lang_mask)

    def check_prefix(self, prefix) -> int:
        return check_prefix(self.config, prefix, self.config.prefix_len)

    # ---- the observe stage ------------------------------------------------------------------------------
    def _siglip(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] -> projected image tokens [N, patches, vlm.width] in the model dtype."""
        w, vc, eps, be, lin = self.weights, self.config.vision, self.config.ln_eps, self.backend, self.linear
        layers = w.vision_layers
        # the patch embedding as one GEMM; the position embedding is added by the first LayerNorm's kernel
        x, h = K.add_layer_norm(patch_embed(pixels, w.patch_w, w.patch_b, self._patch_mat), w.pos_emb,
                                layers[0].ln1_w, layers[0].ln1_b, eps, backend=be)
        n, t = x.shape[:2]
        for i, L in enumerate(layers):
            qkv = lin(h, L.qkv_w, L.qkv_b).view(n, t, 3, vc.heads, vc.head_dim)
            # q stays token-major; k / v are [N, H, T, Dh] views of the same GEMM output (no copies).
            a = self.attend(qkv[:, :, 0], qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2), backend=be)
            o = lin(a.reshape(n, t, vc.hidden), L.out_w, L.out_b)
            x, h = K.add_layer_norm(o, x, L.ln2_w, L.ln2_b, eps, residual_out=x, backend=be)
            if h.is_cuda:  # one cuBLASLt GEMM with a bias + GELU epilogue
                f = linear_bias_gelu_tanh(h, L.fc1_w, L.fc1_b)
            else:
                f = K.bias_gelu(lin(h, L.fc1_w), L.fc1_b, backend=be)
            m = lin(f, L.fc2_w, L.fc2_b)
            nw, nb = (layers[i + 1].ln1_w, layers[i + 1].ln1_b) if i + 1 < len(layers) else (w.post_ln_w, w.post_ln_b)
            x, h = K.add_layer_norm(m, x, nw, nb, eps, residual_out=x, backend=be)
        return lin(h, w.proj_w, w.proj_b).to(self.dtype)

    def _observe_body(self, prefix_done=None) -> None:
        """images + prompt buffers -> prefix K/V, pad mask and valid count (the `observe` stage).
        prefix_done(i) is called once prefix layer i's K/V are written (-1: the pad mask and valid count)."""
        w, c, buf, be, lin = self.weights, self.config, self.buffers, self.backend, self.linear
        g, eps = c.vlm, c.rms_eps
        b, slots = buf.image_masks.shape
        # A masked (missing) camera reads as a -1 image, as LeRobot builds it, whatever its buffer holds
        # (stale or NaN pixels), and token ids are clamped into the vocabulary (on CUDA an id past it would
        # abort the context in the lookup; CPU ids were checked, see inputs.py). Done here rather than in
        # set_observation: buffers filled any other way (a restored capsule) get the same, and the staged
        # copies before the graph need no extra eager kernels.
        n_patch = c.vision.num_patches
        # The pad mask and valid count first: they depend on the masks only (the decision graph's act stream
        # starts its first flow step on them while SigLIP runs).
        pad = torch.cat([buf.image_masks[:, :, None].expand(b, slots, n_patch).reshape(b, slots * n_patch),
                         buf.lang_mask], dim=1)
        buf.pad_mask.copy_(pad)
        buf.n_valid.copy_(pad.sum(dim=1))
        if prefix_done is not None:
            prefix_done(-1)
        pixels = torch.where(buf.image_masks[:, :, None, None, None], buf.images, -1.0)
        img = self._siglip(pixels.flatten(0, 1))
        lang = F.embedding(buf.lang_tokens.clamp(0, c.vocab_size - 1), w.embed) * self.embed_scale
        x = torch.cat([img.view(b, slots * n_patch, -1), lang], dim=1)
        # Positions count valid tokens only; padding gets a clamped (unused) position.
        positions = (torch.cumsum(pad, dim=1) - 1).clamp_(min=0)
        layers = w.vlm_layers
        # An fp8 prefix: each norm and the GeGLU write their rows in e4m3 with per-row scales for the fp8 GEMM
        # after them (no row-quantization kernel between; the attention output still gets one in the o GEMM)
        fp8 = isinstance(layers[0].qkv_w, FP8Weight)
        h = K.rms_norm(x, layers[0].attn_norm, eps, weight_offset=0.0, fp8=fp8, backend=be)
        for i, L in enumerate(layers):
            q = K.qkv_rope_cache(lin(h, L.qkv_w), positions, self.cos, self.sin, buf.prefix_k[i], buf.prefix_v[i], 0,
                                 num_q_heads=g.heads, num_kv_heads=g.kv_heads, backend=be)
            if prefix_done is not None:
                prefix_done(i)
            if i == len(layers) - 1:
                break  # the last layer's attention output and MLP only feed the unused prefix logits
            a = self.attend(q, buf.prefix_k[i], buf.prefix_v[i], key_mask=buf.pad_mask, backend=be)
            o = lin(a.flatten(2), L.o_w)
            x, h = K.add_rms_norm(o, x, L.mlp_norm, eps, weight_offset=0.0, residual_out=x, fp8=fp8, backend=be)
            d = lin(lin.geglu(h, L.gate_up_w, fp8=fp8, backend=be), L.down_w)
            x, h = K.add_rms_norm(d, x, layers[i + 1].attn_norm, eps, weight_offset=0.0, residual_out=x, fp8=fp8,
                                  backend=be)

    # ---- staged API (copies into the static buffers; the rest is `FlowEngine`'s) ---------------------
    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask) -> PrefixCache:
        """-> PrefixCache viewing the engine's static buffers: valid until the next encode_prefix (clone to keep)."""
        self.set_observation(images, image_masks, lang_tokens, lang_mask)
        self.observe()
        buf = self.buffers
        return PrefixCache(k=buf.prefix_k, v=buf.prefix_v, pad_mask=buf.pad_mask, n_valid=buf.n_valid)
