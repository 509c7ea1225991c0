"""LeRobot pi0.5 state dict -> the engine's weight layout, shared by the eager reference and fused engines.

What changes from LeRobot's layout, and why:
- q/k/v projections are concatenated into one `qkv_w` (one GEMM per layer instead of three);
- gate and up projections are concatenated into `gate_up_w` (`[gate; up]`, one GEMM);
- Gemma RMSNorm weights are stored folded as `1 + w` (the form the norm multiplies by);
- the action expert's AdaRMS modulation depends only on the flow time t, and t takes the same
  `num_steps` values in every decision, so `(scale, shift, gate)` of every expert norm at every step is
  precomputed once here (`ada_attn`, `ada_mlp`, `ada_final`), as is the time condition itself.
The prefix tower's final norm is not kept: only the per-layer K/V of the prefix reach the actions.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core.models.pi05.config import EXPERT, PG, VISION, VLM, Pi05Config


@dataclass
class VisionLayerWeights:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv_w: torch.Tensor  # [3*hidden, hidden], rows q | k | v
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor


@dataclass
class GemmaLayerWeights:
    qkv_w: torch.Tensor  # [(heads + 2*kv_heads) * head_dim, width], rows q | k | v
    o_w: torch.Tensor  # [width, heads * head_dim]
    gate_up_w: torch.Tensor  # [2*mlp, width], rows gate | up
    down_w: torch.Tensor  # [width, mlp]
    # Prefix tower: plain RMSNorm multipliers (1 + w). None in the expert.
    attn_norm: torch.Tensor | None = None
    mlp_norm: torch.Tensor | None = None
    # Expert: AdaRMS dense layers (cond -> scale|shift|gate), kept so tables can be recomputed. None in the prefix.
    attn_ada_w: torch.Tensor | None = None
    attn_ada_b: torch.Tensor | None = None
    mlp_ada_w: torch.Tensor | None = None
    mlp_ada_b: torch.Tensor | None = None


# Field groups for `Pi05Weights.to`: which tensors follow the vision dtype or always stay fp32.
_VISION_FIELDS = {"patch_w", "patch_b", "pos_emb", "vision_layers", "post_ln_w", "post_ln_b", "proj_w", "proj_b"}
# LeRobot keeps every norm parameter in fp32 in bf16 mode; the precomputed tables and RoPE frequencies too.
_FP32_FIELDS = {"attn_norm", "mlp_norm", "attn_ada_w", "attn_ada_b", "mlp_ada_w", "mlp_ada_b",
                "final_ada_w", "final_ada_b", "step_times", "time_cond", "ada_attn", "ada_mlp", "ada_final",
                "rope_inv_freq"}


# The tables `precompute_tables` derives from the other weights (CPU matmuls: their last bits depend on the
# thread count): not part of the weights' identity (`contract.bindings.pi05.named_tensors`).
TABLE_FIELDS = frozenset({"step_times", "time_cond", "ada_attn", "ada_mlp", "ada_final", "rope_inv_freq"})


@dataclass
class Pi05Weights:
    config: Pi05Config
    # SigLIP + projector
    patch_w: torch.Tensor  # [hidden, 3, patch, patch]
    patch_b: torch.Tensor
    pos_emb: torch.Tensor  # [num_patches, hidden]
    vision_layers: list[VisionLayerWeights]
    post_ln_w: torch.Tensor
    post_ln_b: torch.Tensor
    proj_w: torch.Tensor  # [vlm.width, hidden]
    proj_b: torch.Tensor
    # Gemma prefix tower
    embed: torch.Tensor  # [vocab, vlm.width], unscaled; the gather multiplies by sqrt(width)
    vlm_layers: list[GemmaLayerWeights]
    # Action expert
    expert_layers: list[GemmaLayerWeights]
    final_ada_w: torch.Tensor
    final_ada_b: torch.Tensor
    action_in_w: torch.Tensor
    action_in_b: torch.Tensor
    action_out_w: torch.Tensor
    action_out_b: torch.Tensor
    time_in_w: torch.Tensor
    time_in_b: torch.Tensor
    time_out_w: torch.Tensor
    time_out_b: torch.Tensor
    # Precomputed from the above (depend only on the step index)
    step_times: torch.Tensor  # [num_steps] fp32: t = 1, 1 - 1/n, ...
    time_cond: torch.Tensor  # [num_steps, expert.width]: silu(mlp_out(silu(mlp_in(sincos(t)))))
    ada_attn: torch.Tensor  # [num_steps, depth, 3, expert.width]: scale, shift, gate before attention
    ada_mlp: torch.Tensor  # [num_steps, depth, 3, expert.width]: scale, shift, gate before the MLP
    ada_final: torch.Tensor  # [num_steps, 2, expert.width]: scale, shift of the final norm (gate unused)
    rope_inv_freq: torch.Tensor  # [head_dim // 2] fp32

    @property
    def dt(self) -> float:
        """Euler step size: the flow goes from t=1 (noise) to t=0 (actions)."""
        return -1.0 / self.config.num_steps

    def to(self, device=None, dtype: torch.dtype | None = None, vision_dtype: torch.dtype | None = torch.float32):
        """A copy on `device` with matrices in `dtype`; SigLIP+projector in `vision_dtype` (fp32 as in
        LeRobot's bf16 mode; None = follow `dtype`); norms, AdaRMS and precomputed tables stay fp32."""
        return moved(self, device, dtype, vision_dtype)


def moved(w, device=None, dtype: torch.dtype | None = None, vision_dtype: torch.dtype | None = torch.float32,
          fp32_fields=_FP32_FIELDS):
    """A copy of a weights dataclass (pi0.5's or pi0's) on `device`: matrices in `dtype`, the vision fields in
    `vision_dtype` (None: `dtype`), `fp32_fields` in fp32."""

    def move(value, name: str, group_dtype):
        if isinstance(value, torch.Tensor):
            target = torch.float32 if name in fp32_fields else group_dtype
            return value.to(device=device, dtype=target if value.is_floating_point() else None)
        if isinstance(value, list):
            return [move(v, name, group_dtype) for v in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, Pi05Config):
            return type(value)(**{f.name: move(getattr(value, f.name), f.name, group_dtype)
                                  for f in dataclasses.fields(value)})
        return value

    changes = {}
    for f in dataclasses.fields(w):
        group = (vision_dtype or dtype) if f.name in _VISION_FIELDS else dtype
        changes[f.name] = move(getattr(w, f.name), f.name, group)
    return type(w)(**changes)


def sincos_time_embedding(t: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """Sine|cosine embedding of flow times t [N] -> [N, dim], computed in float64 then cast to t's dtype,
    the way LeRobot does (the float64 step matters at the 1e-7 level)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(t.dtype)


def time_condition(w: Pi05Weights, t: torch.Tensor) -> torch.Tensor:
    """The AdaRMS condition for flow times t [N] (fp32) -> [N, expert.width]."""
    c = w.config
    emb = sincos_time_embedding(t.float(), c.expert.width, c.min_period, c.max_period)
    x = F.silu(F.linear(emb, w.time_in_w.float(), w.time_in_b.float()))
    return F.silu(F.linear(x, w.time_out_w.float(), w.time_out_b.float()))


def ada_modulation(dense_w: torch.Tensor, dense_b: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """AdaRMS dense layer: cond [N, width] -> [N, 3, width] = (scale, shift, gate)."""
    out = F.linear(cond.float(), dense_w.float(), dense_b.float())
    return out.view(cond.shape[0], 3, -1)


def step_times(num_steps: int) -> torch.Tensor:
    # Same arithmetic as LeRobot's Euler loop: t = 1.0 + step * dt in Python floats, then fp32.
    dt = -1.0 / num_steps
    return torch.tensor([1.0 + k * dt for k in range(num_steps)], dtype=torch.float32)


def precompute_tables(w: Pi05Weights) -> Pi05Weights:
    """Fill the step-indexed tables (time condition and every AdaRMS modulation) from the weights."""
    times = step_times(w.config.num_steps).to(w.time_in_w.device)
    cond = time_condition(w, times)
    w.step_times = times
    w.time_cond = cond
    w.ada_attn = torch.stack([ada_modulation(L.attn_ada_w, L.attn_ada_b, cond) for L in w.expert_layers], dim=1)
    w.ada_mlp = torch.stack([ada_modulation(L.mlp_ada_w, L.mlp_ada_b, cond) for L in w.expert_layers], dim=1)
    w.ada_final = ada_modulation(w.final_ada_w, w.final_ada_b, cond)[:, :2].contiguous()
    w.rope_inv_freq = rope_inv_freq(w.config, times.device)
    return w


def rope_inv_freq(config: Pi05Config, device) -> torch.Tensor:
    hd = config.vlm.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))


def vision_layer(sd: dict[str, torch.Tensor], i: int) -> VisionLayerWeights:
    """SigLIP layer `i` of a LeRobot-layout state dict (shared by pi0.5 and pi0)."""
    p = f"{VISION}encoder.layers.{i}."
    a = p + "self_attn."
    return VisionLayerWeights(
        ln1_w=sd[p + "layer_norm1.weight"], ln1_b=sd[p + "layer_norm1.bias"],
        qkv_w=torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]),
        qkv_b=torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"]),
        out_w=sd[a + "out_proj.weight"], out_b=sd[a + "out_proj.bias"],
        ln2_w=sd[p + "layer_norm2.weight"], ln2_b=sd[p + "layer_norm2.bias"],
        fc1_w=sd[p + "mlp.fc1.weight"], fc1_b=sd[p + "mlp.fc1.bias"],
        fc2_w=sd[p + "mlp.fc2.weight"], fc2_b=sd[p + "mlp.fc2.bias"],
    )


def gemma_layer(sd: dict[str, torch.Tensor], prefix: str, adaptive: bool) -> GemmaLayerWeights:
    """A Gemma layer under `prefix`: AdaRMS dense layers (pi0.5's expert) or plain RMSNorm multipliers."""
    a, m = prefix + "self_attn.", prefix + "mlp."
    layer = GemmaLayerWeights(
        qkv_w=torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]),
        o_w=sd[a + "o_proj.weight"],
        gate_up_w=torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]),
        down_w=sd[m + "down_proj.weight"],
    )
    if adaptive:
        layer.attn_ada_w = sd[prefix + "input_layernorm.dense.weight"]
        layer.attn_ada_b = sd[prefix + "input_layernorm.dense.bias"]
        layer.mlp_ada_w = sd[prefix + "post_attention_layernorm.dense.weight"]
        layer.mlp_ada_b = sd[prefix + "post_attention_layernorm.dense.bias"]
    else:  # 1 + w computed in fp32, exactly the multiplier LeRobot's RMSNorm applies
        layer.attn_norm = 1.0 + sd[prefix + "input_layernorm.weight"].float()
        layer.mlp_norm = 1.0 + sd[prefix + "post_attention_layernorm.weight"].float()
    return layer


def prefix_fields(config: Pi05Config, sd: dict[str, torch.Tensor]) -> dict:
    """The SigLIP, projector and Gemma prefix fields, identical in pi0.5 and pi0."""
    return dict(
        config=config,
        patch_w=sd[VISION + "embeddings.patch_embedding.weight"],
        patch_b=sd[VISION + "embeddings.patch_embedding.bias"],
        pos_emb=sd[VISION + "embeddings.position_embedding.weight"],
        vision_layers=[vision_layer(sd, i) for i in range(config.vision.layers)],
        post_ln_w=sd[VISION + "post_layernorm.weight"], post_ln_b=sd[VISION + "post_layernorm.bias"],
        proj_w=sd[PG + "multi_modal_projector.linear.weight"], proj_b=sd[PG + "multi_modal_projector.linear.bias"],
        embed=sd[VLM + "embed_tokens.weight"],
        vlm_layers=[gemma_layer(sd, f"{VLM}layers.{i}.", adaptive=False) for i in range(config.vlm.depth)],
    )


def convert(config: Pi05Config, sd: dict[str, torch.Tensor]) -> Pi05Weights:
    """Build the engine layout from a LeRobot-layout state dict (as returned by `load_checkpoint`)."""
    if config.kind != "pi05":
        raise ValueError(f"convert: a {config.kind} checkpoint is not pi0.5 (flashrt_core.models.{config.kind})")
    empty = torch.empty(0)
    w = Pi05Weights(
        **prefix_fields(config, sd),
        expert_layers=[gemma_layer(sd, f"{EXPERT}layers.{i}.", adaptive=True) for i in range(config.expert.depth)],
        final_ada_w=sd[EXPERT + "norm.dense.weight"], final_ada_b=sd[EXPERT + "norm.dense.bias"],
        action_in_w=sd["model.action_in_proj.weight"], action_in_b=sd["model.action_in_proj.bias"],
        action_out_w=sd["model.action_out_proj.weight"], action_out_b=sd["model.action_out_proj.bias"],
        time_in_w=sd["model.time_mlp_in.weight"], time_in_b=sd["model.time_mlp_in.bias"],
        time_out_w=sd["model.time_mlp_out.weight"], time_out_b=sd["model.time_mlp_out.bias"],
        step_times=empty, time_cond=empty, ada_attn=empty, ada_mlp=empty, ada_final=empty, rope_inv_freq=empty,
    )
    return precompute_tables(w)
