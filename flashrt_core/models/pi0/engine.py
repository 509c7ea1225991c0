"""The fused pi0 engine: the shared PaliGemma prefix stage (`PaliGemmaEngine`) with pi0's act stage.

Same staged API as pi0's eager reference (`reference.py`), so `Pi0Policy` and the runtime drive either:
  encode_prefix(images, image_masks, lang_tokens, lang_mask) -> PrefixCache   (stage `observe`, pi0.5's)
  denoise(prefix, state, noise) -> actions                                    (stage `act`)
The prefix is pi0.5's (`_observe_body` is `PaliGemmaEngine`'s: same static buffers, kernels, CUDA graphs).

pi0's act stage (LeRobot 0.6.1 `PI0Pytorch.denoise_step`) runs the expert over a suffix of 1 + chunk tokens,
[state token, action tokens], at RoPE positions n_valid + 0 .. n_valid + chunk, under a block-causal mask: the
state token sees the valid prefix and itself, never the actions; the action tokens see the valid prefix, the
state token and each other. So the state token's hidden states, and its K/V at every layer, depend on the
prefix and the state only, not on the flow step or x_t: the reference recomputes the same values at every
Euler step. Here they are computed ONCE per act, inside the first Euler step: that step runs the expert over
all 1 + chunk rows (the state token's GEMMs share the action tokens' weight stream and launches; its K/V go to
slot 0 of a per-layer suffix K/V buffer of 1 + chunk rows, the action tokens' to slots 1 ..), with two attention
launches per layer for the block-causal mask: the state row over [valid prefix, suffix slot 0], the action rows
over [valid prefix, all suffix slots]. Every later step runs the chunk's action tokens only (positions
n_valid + 1 ...), attending to the valid prefix (pad mask) and all 1 + chunk suffix keys; the state row's
hidden states are not needed past the first step. This is exact, the reference's own math, not an
approximation: the masked action keys the reference's state query skips carry an additive -2.4e38 and get an
exactly zero softmax weight. (Floating point: the later steps' GEMMs run on 50 rows instead of 51, so a tuned
GEMM may sum in another order: bf16 rounding level.)

Action tokens: a = action_in(x_t); h = silu(action_time_in([a, time_emb[step]])); token = action_time_out(h).
The time half of action_time_in is a per-step constant, folded once per engine into a [num_steps, width] bias
(time_emb[step] rounded to the model dtype, as the reference concatenates it, times W_in[:, width:]^T plus
b_in, summed in fp32 and rounded to the model dtype), so the GEMM is a @ W_in[:, :width]^T + bias[step]. In
fp32 that changes only the summation order (~1e-7); in bf16 the bias is rounded once more before it is added
(the reference rounds the whole sum once): a difference at bf16 rounding level.
The final norm's output (the action rows only) goes through action_out in fp32, as the reference computes it,
and the Euler update x_t += dt * v is that GEMM's epilogue (`GatedResidual` into the fp32 flow state).
Fused kernels as in pi0.5's expert: residual + RMSNorm (`add_rms_norm`), QKV split + RoPE + K/V write
(`qkv_rope_cache`, reading the QKV GEMM's split-K partials), attention over the cached prefix + the suffix,
GeGLU in the gate|up GEMM; the SiLU of the action-time MLP is plain torch (no kernel of its own).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flashrt_core import kernels as K
from flashrt_core.errors import InputError
from flashrt_core.kernels.skinny_gemm import GatedResidual
from flashrt_core.models.pi0.weights import Pi0Weights
from flashrt_core.models.rtc import RTCInputs
from flashrt_core.models.paligemma.engine import EngineBuffers, PaliGemmaEngine
from flashrt_core.models.paligemma.inputs import check_model_inputs, check_noise, check_prefix
from flashrt_core.models.paligemma.reference import PrefixCache


def check_state(config, state, batch: int) -> None:
    """state [batch, n <= max_state_dim] floats (and finite, where that needs no device sync); InputError
    otherwise. Shorter states are zero padded by the engine, as LeRobot's pi0 pads them."""
    if not isinstance(state, torch.Tensor):
        raise InputError(f"state: expected a torch.Tensor, got {type(state).__name__}")
    if state.ndim != 2:
        raise InputError(f"state: expected [B, state_dim], got shape {tuple(state.shape)}")
    if state.shape[0] != batch:
        raise InputError(f"state: batch {state.shape[0]}, expected {batch}")
    if state.shape[1] > config.state_dim:
        raise InputError(f"state: {state.shape[1]} values but the model takes at most {config.state_dim} "
                         "(max_state_dim)")
    if not state.is_floating_point():
        raise InputError(f"state: expected floats, got {state.dtype}")
    if state.device.type == "cpu" and not torch.isfinite(state).all():
        raise InputError("state: NaN or infinite values")


@dataclass(kw_only=True)
class Pi0Buffers(EngineBuffers):
    """pi0.5's static buffers plus what pi0's act stage reads and writes."""

    state: torch.Tensor  # [B, max_state_dim] fp32: the normalized robot state, zero padded
    suffix_k: torch.Tensor  # [depth, B, kv_heads, 1 + chunk, head_dim]: row 0 the state token's, RoPE applied
    suffix_v: torch.Tensor

    @classmethod
    def allocate(cls, w: Pi0Weights, batch: int, device, dtype, vision_dtype) -> "Pi0Buffers":
        base = EngineBuffers.allocate(w, batch, device, dtype, vision_dtype)
        c, e = w.config, w.config.expert
        kv = (e.depth, batch, e.kv_heads, 1 + c.chunk_size, e.head_dim)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                   state=torch.zeros(batch, c.state_dim, dtype=torch.float32, device=device),
                   suffix_k=torch.zeros(kv, dtype=dtype, device=device),
                   suffix_v=torch.zeros(kv, dtype=dtype, device=device))


class Pi0Engine(PaliGemmaEngine):
    """pi0 over static buffers (constructor: `PaliGemmaEngine`'s). `encode_prefix` / `denoise` / `sample_actions` /
    `set_state` copy inputs into the buffers and run the stages; a runtime that owns the buffers can fill
    `buffers` (state included) itself and call `observe()` / `act()` / `decision()`."""

    Buffers = Pi0Buffers

    def __init__(self, weights: Pi0Weights, *args, **kwargs):
        if weights.config.kind != "pi0":
            raise ValueError(f"Pi0Engine: a {weights.config.kind} model (pi0.5's engine is Pi05Engine)")
        super().__init__(weights, *args, **kwargs)
        w, c, e = self.weights, self.config, self.config.expert
        # the suffix reaches position n_valid + chunk <= prefix_len + chunk: one row more than pi0.5 needs
        self.cos, self.sin = K.rope_cos_sin(c.prefix_len + 1 + c.chunk_size, c.vlm.head_dim, c.rope_theta,
                                            device=self.device)
        width = e.width
        # action_time_in over [a, time_emb[step]] = a @ W[:, :width]^T + (time_emb[step] @ W[:, width:]^T + b)
        self._time_in_w = w.action_time_in_w[:, :width].contiguous()
        t = w.time_emb.to(self.dtype).float()  # (rounded as the reference's concatenation rounds it)
        bias = t @ w.action_time_in_w[:, width:].float().T + w.action_time_in_b.float()
        self._time_bias = bias.to(self.dtype).contiguous()  # [num_steps, width]
        # action_out in fp32, as the reference computes it
        self._out_w = w.action_out_w.float().contiguous()
        self._out_b = w.action_out_b.float().contiguous()

    # ---- the act stage ----------------------------------------------------------------------------------
    def _state_token(self):
        """state buffer -> the state token's residual stream [B, 1, width] (before any layer)."""
        w = self.weights
        return self.linear(self.buffers.state[:, None], w.state_w, w.state_b)  # (fp32 rounded to the weights' dtype)

    def _action_embedding(self, x_t, step: int):
        """Flow state x_t [B, chunk, action_dim] fp32 -> action tokens [B, chunk, width] (before any layer)."""
        w, lin = self.weights, self.linear
        a = lin(x_t, w.action_in_w, w.action_in_b)  # (the fp32 state is rounded to the weights' dtype on load)
        hidden = lin(a, self._time_in_w, self._time_bias[step], silu=True)
        return lin(hidden, w.action_time_out_w, w.action_time_out_b)

    def _layer(self, i: int, x, h, positions, with_state: bool, wait):
        """Expert layer i over the suffix rows x (residual) / h (its RMSNorm): with_state, the state row and the
        action rows (the first Euler step: K/V into suffix slots 0 ..), else the action rows only (slots 1 ..);
        K/V written, attention over [valid prefix, the suffix keys the rows may see], o + residual, MLP +
        residual. Returns (x, the next layer's or the final RMSNorm of x). wait(i) before the prefix read (a
        no-op after the first step's)."""
        w, c, buf, be, lin = self.weights, self.config, self.buffers, self.backend, self.linear
        e, eps, layers = c.expert, c.rms_eps, self.weights.expert_layers
        L = layers[i]
        # defer=True: the QKV, o and down GEMMs may leave their split-K partials to the kernel after them (the
        # split/rotate kernel, the residual add + RMSNorm), which adds them up as it loads the row.
        q = K.qkv_rope_cache(lin(h, L.qkv_w, defer=True), positions, self.cos, self.sin, buf.suffix_k[i],
                             buf.suffix_v[i], 0 if with_state else 1, num_q_heads=e.heads, num_kv_heads=e.kv_heads,
                             constant_positions=True, backend=be)
        wait(i)
        k, v = buf.suffix_k[i], buf.suffix_v[i]
        # (the cached prefix K/V and pad mask are constant in the act stage's PDL chain: read before the wait)
        if with_state:  # block-causal: the state row sees only itself of the suffix (two launches, one buffer)
            a = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self.attend(q[:, :1], buf.prefix_k[i], buf.prefix_v[i], key_mask=buf.pad_mask, k2=k[:, :, :1],
                        v2=v[:, :, :1], constant_kv=True, out=a[:, :1], backend=be)
            self.attend(q[:, 1:], buf.prefix_k[i], buf.prefix_v[i], key_mask=buf.pad_mask, k2=k, v2=v,
                        constant_kv=True, out=a[:, 1:], backend=be)
        else:
            a = self.attend(q, buf.prefix_k[i], buf.prefix_v[i], key_mask=buf.pad_mask, k2=k, v2=v, constant_kv=True,
                            backend=be)
        x, h = K.add_rms_norm(lin(a.flatten(2), L.o_w, defer=True), x, L.mlp_norm, eps, weight_offset=0.0,
                              residual_out=x, backend=be)
        d = lin(lin.geglu(h, L.gate_up_w, backend=be), L.down_w, defer=True)
        norm = layers[i + 1].attn_norm if i + 1 < len(layers) else w.final_norm
        return K.add_rms_norm(d, x, norm, eps, weight_offset=0.0, residual_out=x, backend=be)

    def _act_body(self, prefix_wait=None, rtc: bool = False) -> None:
        """noise + state + prefix buffers -> `num_steps` Euler steps (the first over the state token too) ->
        actions (the `act` stage). prefix_wait(i) is called before the first read of prefix layer i's K/V (-1:
        of the valid count), each once; rtc: each step guided towards the RTC buffers' previous chunk
        (`set_rtc`)."""
        c, buf, be = self.config, self.buffers, self.backend
        first_norm = self.weights.expert_layers[0].attn_norm
        waited = set()

        def wait(i):
            if prefix_wait is not None and i not in waited:
                waited.add(i)
                prefix_wait(i)
        wait(-1)
        # Positions are computed by torch before the first Triton kernel (constant_positions: the kernels of
        # the stage's PDL chain read them before waiting for the kernel before them).
        suffix_pos = buf.n_valid[:, None] + torch.arange(0, 1 + c.chunk_size, device=self.device)
        action_pos = buf.n_valid[:, None] + torch.arange(1, 1 + c.chunk_size, device=self.device)
        x_t = buf.noise.clone()  # the fp32 flow state
        for step in range(c.num_steps):
            x = self._action_embedding(x_t, step)
            if step == 0:  # [state token, action tokens]
                x = torch.cat((self._state_token(), x), dim=1)
            h = K.rms_norm(x, first_norm, c.rms_eps, weight_offset=0.0, backend=be)
            for i in range(c.expert.depth):
                x, h = self._layer(i, x, h, suffix_pos if step == 0 else action_pos, step == 0, wait)
            if step == 0:
                h = h[:, 1:]
            # x_t += dt * velocity in the fp32 action-out GEMM (h is the final norm, in the model dtype, widened on
            # load)
            if rtc:  # the velocity out, then the guided step
                self._guided_update(x_t, self.linear(h, self._out_w, self._out_b), step)
            else:
                self.linear(h, self._out_w, self._out_b, residual=GatedResidual(x_t, self._dt))
        buf.actions.copy_(x_t)

    # ---- staged API (copies into the static buffers) ------------------------------------------------------
    def _write_state(self, state: torch.Tensor) -> None:
        n = state.shape[1]
        self.buffers.state[:, :n].copy_(state)
        if n < self.config.state_dim:
            self.buffers.state[:, n:].zero_()

    def set_state(self, state: torch.Tensor) -> None:
        """Copy the normalized robot state [B, <= max_state_dim] into the state buffer, zero padded (the act
        stage reads it). Checked before anything is written."""
        check_state(self.config, state, self.batch)
        self._write_state(state)

    def denoise(self, prefix: PrefixCache, state: torch.Tensor, noise: torch.Tensor,
                rtc: RTCInputs | None = None) -> torch.Tensor:
        """state [B, <= max_state_dim] normalized, noise [B, chunk, action_dim] -> actions [B, chunk, action_dim]
        fp32 (a fresh tensor). Prefix, state and noise are checked before the engine changes anything."""
        b = check_prefix(self.config, prefix, self.config.prefix_len)
        check_noise(self.config, noise, b)
        check_state(self.config, state, b)
        self._resize(b)  # a cache from elsewhere may bring its own batch size (the engine's own: a no-op)
        self._copy_prefix(prefix)
        self._write_state(state)
        self.buffers.noise.copy_(noise)
        if rtc is not None:
            self.set_rtc(rtc)
        self.act(rtc=rtc is not None)
        return self.buffers.actions.clone()

    def sample_actions(self, images, image_masks, lang_tokens, lang_mask, state, noise) -> torch.Tensor:
        """One whole decision (`decision()`): observation + state + noise -> actions [B, chunk, action_dim] fp32
        (a fresh tensor). Everything is checked before anything is written."""
        check_model_inputs(self.config, images, image_masks, lang_tokens, lang_mask)
        b = images.shape[0]
        check_noise(self.config, noise, b)
        check_state(self.config, state, b)
        self._write_observation(images, image_masks, lang_tokens, lang_mask)
        self._write_state(state)
        self.buffers.noise.copy_(noise)
        self.decision()
        return self.buffers.actions.clone()


def make_engine(weights: Pi0Weights, precision=None) -> Pi0Engine:
    """The `Pi0Policy` engine hook: the fused engine on the weights' own device and dtype."""
    return Pi0Engine(weights, precision=precision)
