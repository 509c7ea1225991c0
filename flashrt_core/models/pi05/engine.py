"""The fused pi0.5 engine: the shared PaliGemma prefix stage and pi0.5's action expert (AdaRMS), one CUDA graph per stage.

Same staged API as the eager reference (`reference.py`), so `Pi05Policy` and the runtime drive either:
  encode_prefix(images, image_masks, lang_tokens, lang_mask) -> PrefixCache   (stage `observe`)
  denoise(prefix, noise) -> actions                                           (stage `act`)
What makes it fast (each decision and its measured effect: docs/performance-history.md):
- every buffer a decision reads or writes lives at a fixed address (`EngineBuffers`): camera images,
  prompt tokens + mask, prefix K/V of every layer, pad mask, noise, actions. A prompt of any length up to
  `tokenizer_max_length` is padded into the token buffer and masked, so it never needs a new graph;
- the glue between GEMMs is one Triton kernel each (`flashrt_core.kernels`): residual + RMSNorm, AdaRMS +
  gated residual, GeGLU, bias + GELU, LayerNorm (+ residual), QKV split + RoPE + K/V write, attention with
  padding / over the cached prefix; GEMMs run on merged weights (q|k|v, gate|up) through cuBLAS or the
  skinny Triton GEMM (`kernels.skinny_gemm`), whichever measured faster for that shape on this GPU
  (`flashrt_core.engine.gemm.LinearPicker`); SigLIP's patch embedding is one GEMM over the gathered patches and its
  fc1 + bias + GELU one cuBLASLt GEMM with an epilogue (`flashrt_core.engine.blas`);
- the action expert's split-K GEMMs (QKV, o, down) hand their fp32 partial sums to the kernel that reads
  their result anyway (split/rotate, gated residual + AdaRMS), which adds them up in split order as it loads
  the row (`kernels.Partials`): no in-kernel reduction at the end of those GEMMs; once per engine those
  GEMMs' candidates are ranked again by the act graph's own time (`flashrt_core.engine.rerank`);
- with PDL each Triton kernel reads what no kernel of the chain writes (weights, the AdaRMS modulation
  table, the act stage's positions and RoPE rows) before it waits for the kernel before it;
- each flow step's Euler update x_t += dt * velocity is the action-out GEMM's epilogue, and the next step's
  action-in GEMM reads the fp32 state, rounding it on load (no torch kernel between the steps' PDL chains);
- AdaRMS scale/shift/gate of every step and layer come from the tables precomputed in `weights.py`;
- `observe` and `act` are each captured once as a CUDA graph and replayed (no host syncs inside); a whole
  decision is one graph of its own in which the act stage runs on a second stream beside observe, each of
  its first flow step's layers waiting only for that prefix layer's K/V.
On a CPU the same code runs with the kernels' torch references (or Triton under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch

from flashrt_core import kernels as K
from flashrt_core.kernels.skinny_gemm import GatedResidual
from flashrt_core.engine.staged import _same
from flashrt_core.models.paligemma.engine import PaliGemmaEngine
from flashrt_core.models.paligemma.inputs import check_model_inputs, check_noise, check_prefix
from flashrt_core.models.paligemma.reference import PrefixCache
from flashrt_core.models.pi05.weights import Pi05Weights
from flashrt_core.models.rtc import RTCInputs


class Pi05Engine(PaliGemmaEngine):
    """pi0.5 over static buffers (constructor: `PaliGemmaEngine`'s). `encode_prefix` / `denoise` /
    `sample_actions` copy inputs into the buffers and run the stages; a runtime that owns the buffers can fill
    `buffers` itself and call `observe()` / `act()`, which replay the CUDA graphs (captured on first use on
    CUDA, or with `capture()`)."""

    def __init__(self, weights: Pi05Weights, *args, **kwargs):
        if weights.config.kind != "pi05":
            raise ValueError(f"Pi05Engine: a {weights.config.kind} model (pi0's engine is Pi0Engine)")
        super().__init__(weights, *args, **kwargs)

    # ---- the act stage --------------------------------------------------------------------------------
    def _act_body(self, prefix_wait=None, rtc: bool = False) -> None:
        """noise + prefix buffers -> `num_steps` Euler steps of the action expert -> actions (the `act` stage).
        prefix_wait(i) is called before the first read of prefix layer i's K/V (-1: of the valid count); rtc:
        each step guided towards the RTC buffers' previous chunk (`set_rtc`)."""
        w, c, buf, be, lin = self.weights, self.config, self.buffers, self.backend, self.linear
        e, eps, chunk = c.expert, c.rms_eps, c.chunk_size
        b = buf.noise.shape[0]
        if prefix_wait is not None:
            prefix_wait(-1)
        positions = buf.n_valid[:, None] + torch.arange(chunk, device=self.device)
        suffix_k = torch.empty(b, e.kv_heads, chunk, e.head_dim, device=self.device, dtype=self.dtype)
        suffix_v = torch.empty_like(suffix_k)
        x_t = buf.noise.clone()  # the fp32 flow state
        layers = w.expert_layers
        # defer=True: the QKV, o and down GEMMs may leave their split-K partials to the kernel after them (the
        # split/rotate kernel, the gated residual + AdaRMS), which adds them up as it loads the row.
        # constant_mod / constant_positions: the modulation rows, positions and RoPE rows are written by no
        # kernel of the stage's PDL chain, so those kernels read them before waiting for the one before.
        for step in range(c.num_steps):
            x = lin(x_t, w.action_in_w, w.action_in_b)  # (the fp32 state is rounded to the weights' dtype on load)
            mod = w.ada_attn[step, 0]
            h = K.ada_rms_norm(x, mod[0], mod[1], eps, constant_mod=True, backend=be)
            for i, L in enumerate(layers):
                q = K.qkv_rope_cache(lin(h, L.qkv_w, defer=True), positions, self.cos, self.sin, suffix_k, suffix_v,
                                     0, num_q_heads=e.heads, num_kv_heads=e.kv_heads, constant_positions=True,
                                     backend=be)
                if prefix_wait is not None and step == 0:
                    prefix_wait(i)
                # Action tokens see the valid prefix (cached K/V, pad mask: constant in this stage's PDL chain,
                # read before the wait) and every action token.
                a = self.attend(q, buf.prefix_k[i], buf.prefix_v[i], key_mask=buf.pad_mask, k2=suffix_k, v2=suffix_v,
                                constant_kv=True, backend=be)
                o = lin(a.flatten(2), L.o_w, defer=True)
                gate, mod = w.ada_attn[step, i, 2], w.ada_mlp[step, i]
                x, h = K.gated_residual_ada_rms_norm(x, o, gate, mod[0], mod[1], eps, x_out=x, constant_mod=True,
                                                     backend=be)
                d = lin(lin.geglu(h, L.gate_up_w, backend=be), L.down_w, defer=True)
                gate = w.ada_mlp[step, i, 2]
                mod = w.ada_attn[step, i + 1] if i + 1 < len(layers) else w.ada_final[step]
                x, h = K.gated_residual_ada_rms_norm(x, d, gate, mod[0], mod[1], eps, x_out=x, constant_mod=True,
                                                     backend=be)
            # x_t += dt * velocity in the action-out GEMM (the velocity rounded to the model dtype first)
            if rtc:  # the velocity out (rounded to the model dtype, as above), then the guided step
                self._guided_update(x_t, lin(h, w.action_out_w, w.action_out_b), step)
            else:
                lin(h, w.action_out_w, w.action_out_b, residual=GatedResidual(x_t, self._dt))
        buf.actions.copy_(x_t)

    # ---- staged API (copies into the static buffers) --------------------------------------------------
    def denoise(self, prefix: PrefixCache, noise: torch.Tensor, rtc: RTCInputs | None = None) -> torch.Tensor:
        """noise [B, chunk, action_dim] -> actions [B, chunk, action_dim] fp32 (a fresh tensor). The prefix and
        the noise are checked before the engine changes anything (a refused call keeps its buffers)."""
        b = check_prefix(self.config, prefix, self.config.prefix_len)
        check_noise(self.config, noise, b)
        if not _same(prefix.k, self.buffers.prefix_k):
            self._resize(b)  # a cache from elsewhere may bring its own batch size
        self._copy_prefix(prefix)
        self.buffers.noise.copy_(noise)
        if rtc is not None:
            self.set_rtc(rtc)
        self.act(rtc=rtc is not None)
        return self.buffers.actions.clone()

    def sample_actions(self, images, image_masks, lang_tokens, lang_mask, noise) -> torch.Tensor:
        """One whole decision (`decision()`): observation + noise -> actions [B, chunk, action_dim] fp32 (a fresh
        tensor). Everything is checked before anything is written."""
        check_model_inputs(self.config, images, image_masks, lang_tokens, lang_mask)
        check_noise(self.config, noise, images.shape[0])
        self._write_observation(images, image_masks, lang_tokens, lang_mask)
        self.buffers.noise.copy_(noise)
        self.decision()
        return self.buffers.actions.clone()


def make_engine(weights: Pi05Weights, precision=None) -> Pi05Engine:
    """The `Pi05Policy` engine hook: the fused engine on the weights' own device and dtype."""
    return Pi05Engine(weights, precision=precision)
