"""LeRobot SmolVLA state dict (model.safetensors of SmolVLAPolicy.save_pretrained(), prefix `model.`) -> the
engine's weight layout, shared by the eager reference and the fused engine.

What changes from LeRobot's layout, and why:
- SigLIP's q/k/v and the Llama layers' q/k/v (self-attention) are concatenated into one `qkv_w` (one GEMM);
- gate and up projections are concatenated into `gate_up_w` (`[gate; up]`, one GEMM);
- a cross-attention expert layer keeps `q_w` (on the actions) apart from `k_w` / `v_w`, which read the VLM
  layer's K and V (two inputs: no merged GEMM), once per observation;
- the vision position table is gathered once for the input's patch grid (`pos_emb`: SmolVLM's bucketed
  position ids, identity when the image is the table's size);
- the action-time MLP's input layer splits into its action half (`time_in_action_w`) and a per-step bias
  (`time_bias`: the time half applied to the sine-cosine embedding of each of the `num_steps` flow times plus
  the bias), since t takes the same values in every decision; `time_emb` keeps the embeddings themselves.
Not kept (they never reach the actions): the text model's final norm, lm_head, the layers past num_vlm_layers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core.errors import CheckpointError
from flashrt_core.models.smolvla.config import SmolVLAConfig

VLM = "model.vlm_with_expert.vlm.model."
VISION = VLM + "vision_model."
TEXT = VLM + "text_model."
EXPERT = "model.vlm_with_expert.lm_expert."
# keys a LeRobot checkpoint may hold that no action depends on
UNUSED = (TEXT + "norm.weight", "model.vlm_with_expert.vlm.lm_head.weight")


@dataclass
class VisionLayer:
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
class LlamaLayer:
    attn_norm: torch.Tensor  # RMSNorm multiplier (Llama: w, not 1 + w)
    mlp_norm: torch.Tensor
    o_w: torch.Tensor  # [width, heads * head_dim]
    gate_up_w: torch.Tensor  # [2*mlp, width], rows gate | up
    down_w: torch.Tensor
    qkv_w: torch.Tensor | None = None  # self-attention: [(H + 2 KV) * Dh, width], rows q | k | v
    # expert cross-attention: q on the actions, k / v on the VLM layer's K / V ([KV*Dh, KV*Dh] each)
    q_w: torch.Tensor | None = None
    k_w: torch.Tensor | None = None
    v_w: torch.Tensor | None = None

    @property
    def cross(self) -> bool:
        return self.qkv_w is None


_VISION_FIELDS = {"patch_w", "patch_b", "pos_emb", "vision_layers", "post_ln_w", "post_ln_b", "connector_w"}
_FP32_FIELDS = {"attn_norm", "mlp_norm", "expert_norm", "time_emb", "time_bias"}
TABLE_FIELDS = frozenset({"pos_emb", "time_emb", "time_bias"})  # derived here from the other weights


@dataclass
class SmolVLAWeights:
    config: SmolVLAConfig
    # SigLIP + connector
    patch_w: torch.Tensor  # [hidden, 3, patch, patch]
    patch_b: torch.Tensor
    pos_emb: torch.Tensor  # [patches, hidden]: the table rows of the input's patch grid
    vision_layers: list[VisionLayer]
    post_ln_w: torch.Tensor
    post_ln_b: torch.Tensor
    connector_w: torch.Tensor  # [vlm.width, hidden * scale_factor^2], no bias
    # SmolLM2 prefix layers
    embed: torch.Tensor  # [vocab, vlm.width], unscaled
    vlm_layers: list[LlamaLayer]
    state_w: torch.Tensor  # [vlm.width, max_state_dim]
    state_b: torch.Tensor
    # action expert (expert_layers[j] sits at VLM layer j * config.expert_stride)
    expert_layers: list[LlamaLayer]
    expert_norm: torch.Tensor
    action_in_w: torch.Tensor  # [expert.width, max_action_dim]
    action_in_b: torch.Tensor
    time_in_w: torch.Tensor  # [expert.width, 2 * expert.width]: LeRobot's action_time_mlp_in (action | time)
    time_in_b: torch.Tensor
    time_out_w: torch.Tensor
    time_out_b: torch.Tensor
    action_out_w: torch.Tensor  # [max_action_dim, expert.width]
    action_out_b: torch.Tensor
    time_emb: torch.Tensor  # [num_steps, expert.width] fp32: sincos(t) of each Euler step
    time_bias: torch.Tensor  # [num_steps, expert.width] fp32: time half of time_in applied to it, + time_in_b

    @property
    def dt(self) -> float:
        """Euler step size: the flow goes from t=1 (noise) to t=0 (actions)."""
        return self.config.dt

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.patch_w.dtype

    @property
    def time_in_action_w(self) -> torch.Tensor:
        """The action half of action_time_mlp_in ([expert.width, expert.width] view)."""
        return self.time_in_w[:, : self.config.expert.width]

    def to(self, device=None, dtype: torch.dtype | None = None, vision_dtype: torch.dtype | None = None
           ) -> "SmolVLAWeights":
        """A copy on `device` with matrices in `dtype` (None: kept), SigLIP + connector in `vision_dtype` (None:
        `dtype`), norms and the time tables in fp32."""
        def move(value, name, group):
            if isinstance(value, torch.Tensor):
                target = torch.float32 if name in _FP32_FIELDS else group
                return value.to(device=device, dtype=target if value.is_floating_point() else None)
            if isinstance(value, list):
                return [move(v, name, group) for v in value]
            if dataclasses.is_dataclass(value) and not isinstance(value, SmolVLAConfig):
                return type(value)(**{f.name: move(getattr(value, f.name), f.name, group)
                                      for f in dataclasses.fields(value)})
            return value
        return type(self)(**{f.name: move(getattr(self, f.name), f.name,
                                          (vision_dtype or dtype) if f.name in _VISION_FIELDS else dtype)
                             for f in dataclasses.fields(self)})


# ---- expected keys -----------------------------------------------------------------------------------
def expected_keys(c: SmolVLAConfig) -> dict[str, tuple[int, ...]]:
    """{key: shape} of every tensor a LeRobot SmolVLA checkpoint of these sizes holds and the engine reads."""
    v, g, e = c.vision, c.vlm, c.expert
    out = {VISION + "embeddings.patch_embedding.weight": (v.hidden, 3, v.patch, v.patch),
           VISION + "embeddings.patch_embedding.bias": (v.hidden,),
           VISION + "embeddings.position_embedding.weight": (v.num_patches, v.hidden),
           VISION + "post_layernorm.weight": (v.hidden,), VISION + "post_layernorm.bias": (v.hidden,),
           VLM + "connector.modality_projection.proj.weight": (g.width, v.hidden * c.scale_factor ** 2),
           TEXT + "embed_tokens.weight": (c.vocab_size, g.width),
           "model.state_proj.weight": (g.width, c.max_state_dim), "model.state_proj.bias": (g.width,),
           "model.action_in_proj.weight": (e.width, c.max_action_dim), "model.action_in_proj.bias": (e.width,),
           "model.action_out_proj.weight": (c.max_action_dim, e.width), "model.action_out_proj.bias": (c.max_action_dim,),
           "model.action_time_mlp_in.weight": (e.width, 2 * e.width), "model.action_time_mlp_in.bias": (e.width,),
           "model.action_time_mlp_out.weight": (e.width, e.width), "model.action_time_mlp_out.bias": (e.width,),
           EXPERT + "norm.weight": (e.width,)}
    for i in range(v.layers):
        p = f"{VISION}encoder.layers.{i}."
        for n in ("q", "k", "v", "out"):
            out[p + f"self_attn.{n}_proj.weight"] = (v.hidden, v.hidden)
            out[p + f"self_attn.{n}_proj.bias"] = (v.hidden,)
        for n in ("layer_norm1", "layer_norm2"):
            out[p + n + ".weight"] = out[p + n + ".bias"] = (v.hidden,)
        out[p + "mlp.fc1.weight"], out[p + "mlp.fc1.bias"] = (v.mlp, v.hidden), (v.mlp,)
        out[p + "mlp.fc2.weight"], out[p + "mlp.fc2.bias"] = (v.hidden, v.mlp), (v.hidden,)
    kv = g.kv_heads * g.head_dim
    for prefix, t, layers in ((TEXT, g, range(g.depth)), (EXPERT, e, range(e.depth))):
        for j in layers:
            p = f"{prefix}layers.{j}."
            # the expert's cross-attention layers read K/V of the VLM ([kv] wide) instead of its own stream
            k_in = kv if prefix == EXPERT and c.is_cross(j * c.expert_stride) else t.width
            out[p + "self_attn.q_proj.weight"] = (t.heads * t.head_dim, t.width)
            out[p + "self_attn.k_proj.weight"] = out[p + "self_attn.v_proj.weight"] = (kv, k_in)
            out[p + "self_attn.o_proj.weight"] = (t.width, t.heads * t.head_dim)
            out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = (t.mlp, t.width)
            out[p + "mlp.down_proj.weight"] = (t.width, t.mlp)
            out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (t.width,)
    return out


def check_keys(c: SmolVLAConfig, sd: dict[str, torch.Tensor]) -> None:
    """CheckpointError naming the missing, unexpected and misshapen keys (all of them, at most 8 each)."""
    want = expected_keys(c)
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(k for k in set(sd) - set(want) if k not in UNUSED)
    shapes = sorted(f"{k}: {tuple(sd[k].shape)} (expected {want[k]})" for k in set(want) & set(sd)
                    if tuple(sd[k].shape) != want[k])
    problems = [f"{what} ({len(keys)}): {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
                for what, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)) if keys]
    if problems:
        raise CheckpointError("SmolVLA state dict does not match the config: " + "; ".join(problems))


# ---- conversion ---------------------------------------------------------------------------------------
def vision_position_ids(c: SmolVLAConfig) -> torch.Tensor:
    """Position-table rows of the input's patches, as SmolVLMVisionEmbeddings buckets them (fp32 fractional
    coordinates of an all-valid patch grid against the table's boundaries; identity at the table's size)."""
    side, n = c.image_size // c.vision.patch, c.vision.patches_per_side
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    coords = (torch.arange(side, dtype=torch.float32) * (1.0 / torch.tensor(float(side)))).clamp(max=1.0 - 1e-6)
    bucket = torch.bucketize(coords, boundaries, right=True)
    return (bucket[:, None] * n + bucket[None, :]).reshape(-1)


def sincos(t: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """LeRobot's create_sinusoidal_pos_embedding: sin | cos of t [N] at periods geometric in [min, max],
    computed in float64 (as on the CPU and CUDA) then cast to fp32."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()


def step_times(num_steps: int) -> torch.Tensor:
    """t of each Euler step, as LeRobot's loop computes it (1.0 + step * dt in Python floats, then fp32)."""
    dt = -1.0 / num_steps
    return torch.tensor([1.0 + k * dt for k in range(num_steps)], dtype=torch.float32)


def _vision_layer(sd, i: int) -> VisionLayer:
    p = f"{VISION}encoder.layers.{i}."
    a = p + "self_attn."
    return VisionLayer(
        ln1_w=sd[p + "layer_norm1.weight"], ln1_b=sd[p + "layer_norm1.bias"],
        qkv_w=torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]),
        qkv_b=torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"]),
        out_w=sd[a + "out_proj.weight"], out_b=sd[a + "out_proj.bias"],
        ln2_w=sd[p + "layer_norm2.weight"], ln2_b=sd[p + "layer_norm2.bias"],
        fc1_w=sd[p + "mlp.fc1.weight"], fc1_b=sd[p + "mlp.fc1.bias"],
        fc2_w=sd[p + "mlp.fc2.weight"], fc2_b=sd[p + "mlp.fc2.bias"])


def _llama_layer(sd, p: str, cross: bool) -> LlamaLayer:
    a, m = p + "self_attn.", p + "mlp."
    layer = LlamaLayer(attn_norm=sd[p + "input_layernorm.weight"], mlp_norm=sd[p + "post_attention_layernorm.weight"],
                       o_w=sd[a + "o_proj.weight"], down_w=sd[m + "down_proj.weight"],
                       gate_up_w=torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]))
    if cross:
        layer.q_w, layer.k_w, layer.v_w = (sd[a + f"{n}_proj.weight"] for n in "qkv")
    else:
        layer.qkv_w = torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"])
    return layer


def convert(c: SmolVLAConfig, sd: dict[str, torch.Tensor]) -> SmolVLAWeights:
    """The engine layout of a LeRobot-layout state dict (checked first: `check_keys`)."""
    check_keys(c, sd)
    e = c.expert
    time_in_w, time_in_b = sd["model.action_time_mlp_in.weight"], sd["model.action_time_mlp_in.bias"]
    time_emb = sincos(step_times(c.num_steps), e.width, c.min_period, c.max_period)
    time_bias = F.linear(time_emb, time_in_w[:, e.width:].float(), time_in_b.float())
    return SmolVLAWeights(
        config=c,
        patch_w=sd[VISION + "embeddings.patch_embedding.weight"], patch_b=sd[VISION + "embeddings.patch_embedding.bias"],
        pos_emb=sd[VISION + "embeddings.position_embedding.weight"][vision_position_ids(c)].contiguous(),
        vision_layers=[_vision_layer(sd, i) for i in range(c.vision.layers)],
        post_ln_w=sd[VISION + "post_layernorm.weight"], post_ln_b=sd[VISION + "post_layernorm.bias"],
        connector_w=sd[VLM + "connector.modality_projection.proj.weight"],
        embed=sd[TEXT + "embed_tokens.weight"],
        vlm_layers=[_llama_layer(sd, f"{TEXT}layers.{i}.", cross=False) for i in range(c.vlm.depth)],
        state_w=sd["model.state_proj.weight"], state_b=sd["model.state_proj.bias"],
        expert_layers=[_llama_layer(sd, f"{EXPERT}layers.{j}.", cross=c.is_cross(j * c.expert_stride))
                       for j in range(e.depth)],
        expert_norm=sd[EXPERT + "norm.weight"],
        action_in_w=sd["model.action_in_proj.weight"], action_in_b=sd["model.action_in_proj.bias"],
        time_in_w=time_in_w, time_in_b=time_in_b,
        time_out_w=sd["model.action_time_mlp_out.weight"], time_out_b=sd["model.action_time_mlp_out.bias"],
        action_out_w=sd["model.action_out_proj.weight"], action_out_b=sd["model.action_out_proj.bias"],
        time_emb=time_emb, time_bias=time_bias)
