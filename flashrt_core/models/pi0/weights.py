"""pi0 weights in the engine layout: the pi0.5 prefix (SigLIP, projector, Gemma 2B) and pi0's action expert.

pi0 differs from pi0.5 only after the prefix (LeRobot 0.6.1 `PI0Pytorch`): the suffix starts with one state
token (`state_proj`, max_state_dim -> expert width), and each action token is
`action_time_mlp_out(silu(action_time_mlp_in(cat[action_in_proj(x_t), sincos(t)])))`; the expert's norms are
plain RMSNorms with (1 + w) multipliers, without AdaRMS or gates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt_core.models.paligemma.config import EXPERT
from flashrt_core.models.pi0.config import Pi0Config
from flashrt_core.models.paligemma.weights import (GemmaLayerWeights, PrefixWeights, VisionLayerWeights, gemma_layer,
                                                  moved, prefix_fields, rope_inv_freq, sincos_time_embedding,
                                                  step_times)

_FP32_FIELDS = {"attn_norm", "mlp_norm", "final_norm", "step_times", "time_emb", "rope_inv_freq"}


# derived from the config alone (step times, their sincos embedding, RoPE frequencies): not part of the weights'
# identity (`paligemma.binding.named_tensors`)
TABLE_FIELDS = frozenset({"step_times", "time_emb", "rope_inv_freq"})


@dataclass
class Pi0Weights(PrefixWeights):
    TABLE_FIELDS = TABLE_FIELDS  # (a class attribute: not a field)
    config: Pi0Config  # (kind "pi0")
    # the prefix: the same fields as Pi05Weights, so pi0.5's prefix code runs on them unchanged
    patch_w: torch.Tensor
    patch_b: torch.Tensor
    pos_emb: torch.Tensor
    vision_layers: list[VisionLayerWeights]
    post_ln_w: torch.Tensor
    post_ln_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor
    embed: torch.Tensor
    vlm_layers: list[GemmaLayerWeights]
    # the action expert
    expert_layers: list[GemmaLayerWeights]  # plain RMSNorm multipliers (attn_norm, mlp_norm)
    final_norm: torch.Tensor  # [expert.width] fp32: 1 + w
    state_w: torch.Tensor  # [expert.width, max_state_dim]
    state_b: torch.Tensor
    action_in_w: torch.Tensor
    action_in_b: torch.Tensor
    action_time_in_w: torch.Tensor  # [expert.width, 2 * expert.width]: over [action embedding, time embedding]
    action_time_in_b: torch.Tensor
    action_time_out_w: torch.Tensor
    action_time_out_b: torch.Tensor
    action_out_w: torch.Tensor
    action_out_b: torch.Tensor
    # precomputed (depend only on the step index)
    step_times: torch.Tensor  # [num_steps] fp32
    time_emb: torch.Tensor  # [num_steps, expert.width] fp32: sincos(t) of every step
    rope_inv_freq: torch.Tensor

    @property
    def dt(self) -> float:
        return -1.0 / self.config.num_steps

    def to(self, device=None, dtype: torch.dtype | None = None, vision_dtype: torch.dtype | None = torch.float32):
        """As Pi05Weights.to: matrices in `dtype`, SigLIP in `vision_dtype`, norms and tables in fp32."""
        return moved(self, device, dtype, vision_dtype, fp32_fields=_FP32_FIELDS)


def convert(config: Pi0Config, sd: dict[str, torch.Tensor]) -> Pi0Weights:
    """The engine layout of a LeRobot-layout pi0 state dict (as `pi05.load_checkpoint` returns it)."""
    if config.kind != "pi0":
        raise ValueError(f"convert: a {config.kind} checkpoint is not pi0")
    # the tables on the weights' device (a state dict drawn on the GPU gives GPU tables)
    times = step_times(config.num_steps).to(sd["model.action_in_proj.weight"].device)
    c = config
    return Pi0Weights(
        **prefix_fields(config, sd),
        expert_layers=[gemma_layer(sd, f"{EXPERT}layers.{i}.", adaptive=False) for i in range(c.expert.depth)],
        final_norm=1.0 + sd[EXPERT + "norm.weight"].float(),
        state_w=sd["model.state_proj.weight"], state_b=sd["model.state_proj.bias"],
        action_in_w=sd["model.action_in_proj.weight"], action_in_b=sd["model.action_in_proj.bias"],
        action_time_in_w=sd["model.action_time_mlp_in.weight"], action_time_in_b=sd["model.action_time_mlp_in.bias"],
        action_time_out_w=sd["model.action_time_mlp_out.weight"],
        action_time_out_b=sd["model.action_time_mlp_out.bias"],
        action_out_w=sd["model.action_out_proj.weight"], action_out_b=sd["model.action_out_proj.bias"],
        step_times=times,
        time_emb=sincos_time_embedding(times, c.expert.width, c.min_period, c.max_period).float(),
        rope_inv_freq=rope_inv_freq(config, times.device),
    )
