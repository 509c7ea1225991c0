"""LeRobot FastWAM state dict (model.safetensors of FastWAMPolicy.save_pretrained(): the MoT DiT under
`model.mot.` and the proprio encoder) -> the engine's weight layout, shared by the eager reference and a fused
engine.

What changes from LeRobot's layout, and why:
- a block's self-attention q/k/v become one `qkv_w` (one GEMM over the modulated stream), its cross-attention
  k/v one `cross_kv_w` (one GEMM over the context, once per observation);
- `modulation` loses its leading 1 ([6, hidden]);
- the flow-time path is folded into tables, since its inputs take fixed values: `video_t_mod` is the video
  DiT's time MLP at t = 0 (every token of the prefilled first frame sits at flow time 0: pre_dit zeroes
  frame 0's timesteps), `action_t_mod[i]` the action DiT's at step i of the Euler schedule (`timesteps`,
  `deltas`: LeRobot's WanContinuousFlowMatchScheduler.build_inference_schedule).
Kept but not read by the action path: the video DiT's output head (`video_head_*`, for the imagined future).
Checkpoints saved before LeRobot's MoTLayer refactor (`mot.mixtures.<expert>.blocks.<i>.`) load too.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core.errors import CheckpointError
from flashrt_core.models.fastwam.config import DiTConfig, FastWAMConfig

MOT = "model.mot."
VIDEO = MOT + "mixtures.video."
ACTION = MOT + "mixtures.action."
PROPRIO = "model.proprio_encoder."
_LEGACY = re.compile(re.escape(MOT) + r"mixtures\.(video|action)\.blocks\.(\d+)\.(.+)$")


@dataclass
class DiTLayer:
    modulation: torch.Tensor  # [6, hidden]: shift, scale, gate (attention) | shift, scale, gate (FFN)
    qkv_w: torch.Tensor  # [3 * attn, hidden], rows q | k | v
    qkv_b: torch.Tensor
    norm_q: torch.Tensor  # [attn]: RMSNorm over all heads together (Wan's qk_norm)
    norm_k: torch.Tensor
    o_w: torch.Tensor  # [hidden, attn]
    o_b: torch.Tensor
    norm3_w: torch.Tensor  # the cross-attention's input LayerNorm (affine; norm1 / norm2 are not)
    norm3_b: torch.Tensor
    cross_q_w: torch.Tensor  # [attn, hidden]
    cross_q_b: torch.Tensor
    cross_kv_w: torch.Tensor  # [2 * attn, hidden] over the embedded context, rows k | v
    cross_kv_b: torch.Tensor
    cross_norm_q: torch.Tensor
    cross_norm_k: torch.Tensor
    cross_o_w: torch.Tensor
    cross_o_b: torch.Tensor
    ffn1_w: torch.Tensor  # [ffn, hidden], gelu-tanh
    ffn1_b: torch.Tensor
    ffn2_w: torch.Tensor
    ffn2_b: torch.Tensor


@dataclass
class FastWAMWeights:
    config: FastWAMConfig
    # video DiT (Wan2.2-TI2V)
    patch_w: torch.Tensor  # [video.hidden, latent_channels, *patch]: Conv3d, stride = kernel
    patch_b: torch.Tensor
    video_text: tuple  # (w1, b1, w2, b2): Linear(text_dim, hidden), gelu-tanh, Linear(hidden, hidden)
    video_time: tuple  # (w1, b1, w2, b2, proj_w, proj_b): sincos -> Linear, SiLU, Linear -> SiLU, Linear(6 x)
    video_layers: list[DiTLayer]
    video_head_mod: torch.Tensor  # [2, hidden]
    video_head_w: torch.Tensor  # [prod(patch) * latent_channels, hidden]
    video_head_b: torch.Tensor
    # action DiT
    action_in_w: torch.Tensor  # [action.hidden, action_dim]
    action_in_b: torch.Tensor
    action_text: tuple
    action_time: tuple
    action_layers: list[DiTLayer]
    action_out_w: torch.Tensor  # [action_dim, action.hidden]: ActionDiT.post_dit is a plain Linear
    action_out_b: torch.Tensor
    proprio_w: torch.Tensor | None  # [text_dim, proprio_dim]: the state as one more context token
    proprio_b: torch.Tensor | None
    # derived (fp32)
    video_t_mod: torch.Tensor  # [6, video.hidden]: time_projection(time_embedding(sincos(0)))
    timesteps: torch.Tensor  # [num_steps]: sigma_i * num_train_timesteps
    deltas: torch.Tensor  # [num_steps]: sigma_{i+1} - sigma_i (Euler step sizes, negative)
    action_t_mod: torch.Tensor  # [num_steps, 6, action.hidden]
    action_t: torch.Tensor  # [num_steps, action.hidden]: time_embedding output (LeRobot's `t`)

    def to(self, device=None, dtype: torch.dtype | None = None) -> "FastWAMWeights":
        """A copy on `device` with matrices in `dtype` (None: kept); the derived time tables stay fp32."""
        def move(value, name):
            if isinstance(value, torch.Tensor):
                keep = name in TABLE_FIELDS or not value.is_floating_point()
                return value.to(device=device, dtype=None if keep else dtype)
            if isinstance(value, (list, tuple)):
                return type(value)(move(v, name) for v in value)
            if dataclasses.is_dataclass(value) and not isinstance(value, FastWAMConfig):
                return type(value)(**{f.name: move(getattr(value, f.name), f.name) for f in dataclasses.fields(value)})
            return value
        return type(self)(**{f.name: move(getattr(self, f.name), f.name) for f in dataclasses.fields(self)})


TABLE_FIELDS = frozenset({"video_t_mod", "timesteps", "deltas", "action_t_mod", "action_t"})


# ---- flow time ------------------------------------------------------------------------------------------
def sinusoid(dim: int, t: torch.Tensor) -> torch.Tensor:
    """Wan's sinusoidal_embedding_1d: cos | sin of t [N] at 10000^(-i / (dim/2)), in float64 (as LeRobot)."""
    half = dim // 2
    t = t.to(torch.float64)
    angle = torch.outer(t, torch.pow(10000, -torch.arange(half, dtype=torch.float64).div(half)))
    return torch.cat([torch.cos(angle), torch.sin(angle)], dim=1)


def schedule(num_steps: int, shift: float, num_train_timesteps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps, deltas) [num_steps] fp32, as build_inference_schedule: sigma = 1 .. 1/num_steps shifted
    by shift * s / (1 + (shift - 1) s) in float64, then fp32; timesteps = sigma * T, deltas = next - sigma."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)[:num_steps]
    sigma = (shift * s / (1 + (shift - 1) * s)).to(torch.float32)
    timesteps = sigma * float(num_train_timesteps)
    deltas = torch.cat([sigma[1:], sigma.new_zeros(1)]) - sigma
    return timesteps, deltas


def time_mlp(time: tuple, freq_dim: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_emb [N, hidden], t_mod [N, 6, hidden]) of flow times t [N] (in units of num_train_timesteps)."""
    w1, b1, w2, b2, pw, pb = (x.float() for x in time)
    e = F.linear(F.silu(F.linear(sinusoid(freq_dim, t).float(), w1, b1)), w2, b2)
    return e, F.linear(F.silu(e), pw, pb).unflatten(1, (6, w2.shape[0]))


# ---- expected keys ------------------------------------------------------------------------------------
def _dit_keys(prefix: str, d: DiTConfig, context_width: int) -> dict[str, tuple[int, ...]]:
    h, a = d.hidden, d.attn_dim
    out = {prefix + "modulation": (1, 6, h), prefix + "norm3.weight": (h,), prefix + "norm3.bias": (h,),
           prefix + "ffn.0.weight": (d.ffn, h), prefix + "ffn.0.bias": (d.ffn,),
           prefix + "ffn.2.weight": (h, d.ffn), prefix + "ffn.2.bias": (h,)}
    for attn in ("self_attn.", "cross_attn."):
        p = prefix + attn
        width = context_width if attn == "cross_attn." else h
        out |= {p + "q.weight": (a, h), p + "q.bias": (a,), p + "k.weight": (a, width), p + "k.bias": (a,),
                p + "v.weight": (a, width), p + "v.bias": (a,), p + "o.weight": (h, a), p + "o.bias": (h,),
                p + "norm_q.weight": (a,), p + "norm_k.weight": (a,)}
    return out


def _embed_keys(prefix: str, d: DiTConfig, text_dim: int) -> dict[str, tuple[int, ...]]:
    h = d.hidden
    return {prefix + "text_embedding.0.weight": (h, text_dim), prefix + "text_embedding.0.bias": (h,),
            prefix + "text_embedding.2.weight": (h, h), prefix + "text_embedding.2.bias": (h,),
            prefix + "time_embedding.0.weight": (h, d.freq_dim), prefix + "time_embedding.0.bias": (h,),
            prefix + "time_embedding.2.weight": (h, h), prefix + "time_embedding.2.bias": (h,),
            prefix + "time_projection.1.weight": (6 * h, h), prefix + "time_projection.1.bias": (6 * h,)}


def expected_keys(c: FastWAMConfig) -> dict[str, tuple[int, ...]]:
    """{key: shape} of every tensor a LeRobot FastWAM checkpoint of these sizes holds (MoTLayer layout)."""
    v, a = c.video, c.action
    out = {VIDEO + "patch_embedding.weight": (v.hidden, c.latent_channels, *c.patch),
           VIDEO + "patch_embedding.bias": (v.hidden,),
           VIDEO + "head.modulation": (1, 2, v.hidden),
           VIDEO + "head.head.weight": (math.prod(c.patch) * c.latent_channels, v.hidden),
           VIDEO + "head.head.bias": (math.prod(c.patch) * c.latent_channels,),
           ACTION + "action_encoder.weight": (a.hidden, c.action_dim), ACTION + "action_encoder.bias": (a.hidden,),
           ACTION + "head.weight": (c.action_dim, a.hidden), ACTION + "head.bias": (c.action_dim,)}
    out |= _embed_keys(VIDEO, v, c.text_dim) | _embed_keys(ACTION, a, c.text_dim)
    for i in range(v.layers):
        out |= _dit_keys(f"{MOT}layers.{i}.blocks.video.", v, v.hidden)
        out |= _dit_keys(f"{MOT}layers.{i}.blocks.action.", a, a.hidden)
    if c.proprio_dim is not None:
        out |= {PROPRIO + "weight": (c.text_dim, c.proprio_dim), PROPRIO + "bias": (c.text_dim,)}
    return out


def _unused(key: str) -> bool:
    # an action-conditioned video DiT's action embedding: read only when the video DiT is given actions
    # (training, infer_joint with a ground-truth action), never on the prefill / action path
    return key.startswith(VIDEO + "action_embedding.")


def canonical_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with pre-MoTLayer keys (`mot.mixtures.<e>.blocks.<i>.x`) renamed as LeRobot's
    MoT._load_from_state_dict does (`mot.layers.<i>.blocks.<e>.x`)."""
    out = {}
    for key, t in sd.items():
        m = _LEGACY.match(key)
        out[f"{MOT}layers.{m.group(2)}.blocks.{m.group(1)}.{m.group(3)}" if m else key] = t
    return out


def check_keys(c: FastWAMConfig, sd: dict[str, torch.Tensor]) -> None:
    """CheckpointError naming the missing, unexpected and misshapen keys (all of them, at most 8 each)."""
    sd = canonical_keys(sd)
    want = expected_keys(c)
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(k for k in set(sd) - set(want) if not _unused(k))
    shapes = sorted(f"{k}: {tuple(sd[k].shape)} (expected {want[k]})" for k in set(want) & set(sd)
                    if tuple(sd[k].shape) != want[k])
    problems = [f"{what} ({len(keys)}): {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
                for what, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)) if keys]
    if problems:
        raise CheckpointError("FastWAM state dict does not match the config: " + "; ".join(problems))


# ---- conversion ---------------------------------------------------------------------------------------
def _layer(sd, p: str) -> DiTLayer:
    s, x = p + "self_attn.", p + "cross_attn."
    return DiTLayer(
        modulation=sd[p + "modulation"][0],
        qkv_w=torch.cat([sd[s + f"{n}.weight"] for n in "qkv"]), qkv_b=torch.cat([sd[s + f"{n}.bias"] for n in "qkv"]),
        norm_q=sd[s + "norm_q.weight"], norm_k=sd[s + "norm_k.weight"],
        o_w=sd[s + "o.weight"], o_b=sd[s + "o.bias"],
        norm3_w=sd[p + "norm3.weight"], norm3_b=sd[p + "norm3.bias"],
        cross_q_w=sd[x + "q.weight"], cross_q_b=sd[x + "q.bias"],
        cross_kv_w=torch.cat([sd[x + "k.weight"], sd[x + "v.weight"]]),
        cross_kv_b=torch.cat([sd[x + "k.bias"], sd[x + "v.bias"]]),
        cross_norm_q=sd[x + "norm_q.weight"], cross_norm_k=sd[x + "norm_k.weight"],
        cross_o_w=sd[x + "o.weight"], cross_o_b=sd[x + "o.bias"],
        ffn1_w=sd[p + "ffn.0.weight"], ffn1_b=sd[p + "ffn.0.bias"],
        ffn2_w=sd[p + "ffn.2.weight"], ffn2_b=sd[p + "ffn.2.bias"])


def _mlps(sd, p: str) -> tuple[tuple, tuple]:
    text = tuple(sd[p + f"text_embedding.{i}.{n}"] for i in (0, 2) for n in ("weight", "bias"))
    time = tuple(sd[p + f"time_embedding.{i}.{n}"] for i in (0, 2) for n in ("weight", "bias"))
    return text, time + (sd[p + "time_projection.1.weight"], sd[p + "time_projection.1.bias"])


def convert(c: FastWAMConfig, sd: dict[str, torch.Tensor]) -> FastWAMWeights:
    """The engine layout of a LeRobot-layout state dict (checked first: `check_keys`)."""
    check_keys(c, sd)
    sd = canonical_keys(sd)
    video_text, video_time = _mlps(sd, VIDEO)
    action_text, action_time = _mlps(sd, ACTION)
    timesteps, deltas = schedule(c.num_steps, c.shift, c.num_train_timesteps)
    _, video_t_mod = time_mlp(video_time, c.video.freq_dim, torch.zeros(1))
    action_t, action_t_mod = time_mlp(action_time, c.action.freq_dim, timesteps)
    has_proprio = c.proprio_dim is not None
    return FastWAMWeights(
        config=c,
        patch_w=sd[VIDEO + "patch_embedding.weight"], patch_b=sd[VIDEO + "patch_embedding.bias"],
        video_text=video_text, video_time=video_time,
        video_layers=[_layer(sd, f"{MOT}layers.{i}.blocks.video.") for i in range(c.video.layers)],
        video_head_mod=sd[VIDEO + "head.modulation"][0], video_head_w=sd[VIDEO + "head.head.weight"],
        video_head_b=sd[VIDEO + "head.head.bias"],
        action_in_w=sd[ACTION + "action_encoder.weight"], action_in_b=sd[ACTION + "action_encoder.bias"],
        action_text=action_text, action_time=action_time,
        action_layers=[_layer(sd, f"{MOT}layers.{i}.blocks.action.") for i in range(c.action.layers)],
        action_out_w=sd[ACTION + "head.weight"], action_out_b=sd[ACTION + "head.bias"],
        proprio_w=sd[PROPRIO + "weight"] if has_proprio else None,
        proprio_b=sd[PROPRIO + "bias"] if has_proprio else None,
        video_t_mod=video_t_mod[0], timesteps=timesteps, deltas=deltas, action_t_mod=action_t_mod, action_t=action_t)
