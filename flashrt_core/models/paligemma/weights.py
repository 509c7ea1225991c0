"""The weights every PaliGemma-prefix flow policy shares, in the engine layout: SigLIP, the projector, the Gemma
prefix tower, the Gemma layers of an action expert, and the tables that depend only on the flow step.

What changes from LeRobot's layout, and why:
- q/k/v projections are concatenated into one `qkv_w` (one GEMM per layer instead of three);
- gate and up projections are concatenated into `gate_up_w` (`[gate; up]`, one GEMM);
- Gemma RMSNorm weights are stored folded as `1 + w` (the form the norm multiplies by).
A model's own weights dataclass (`models/<kind>/weights.py`) adds its action expert's fields.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from flashrt_core.models.paligemma.config import PG, VISION, VLM, PaliGemmaConfig


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


class PrefixWeights:
    """What the engines read of every family member's weights dataclass besides its fields."""

    @property
    def vision_dtype(self) -> torch.dtype:
        """The dtype SigLIP and the projector are in (`to(vision_dtype=)`)."""
        return self.patch_w.dtype


# Field groups for `moved`: the tensors that follow the vision dtype.
_VISION_FIELDS = {"patch_w", "patch_b", "pos_emb", "vision_layers", "post_ln_w", "post_ln_b", "proj_w", "proj_b"}

def moved(w, device=None, dtype: torch.dtype | None = None, vision_dtype: torch.dtype | None = torch.float32,
          fp32_fields=frozenset()):
    """A copy of a weights dataclass (pi0.5's or pi0's) on `device`: matrices in `dtype`, the vision fields in
    `vision_dtype` (None: `dtype`), `fp32_fields` in fp32."""

    def move(value, name: str, group_dtype):
        if isinstance(value, torch.Tensor):
            target = torch.float32 if name in fp32_fields else group_dtype
            return value.to(device=device, dtype=target if value.is_floating_point() else None)
        if isinstance(value, list):
            return [move(v, name, group_dtype) for v in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, PaliGemmaConfig):
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


def step_times(num_steps: int) -> torch.Tensor:
    # Same arithmetic as LeRobot's Euler loop: t = 1.0 + step * dt in Python floats, then fp32.
    dt = -1.0 / num_steps
    return torch.tensor([1.0 + k * dt for k in range(num_steps)], dtype=torch.float32)


def rope_inv_freq(config: PaliGemmaConfig, device) -> torch.Tensor:
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


def prefix_fields(config: PaliGemmaConfig, sd: dict[str, torch.Tensor]) -> dict:
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
