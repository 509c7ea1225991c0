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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core.models.paligemma.config import EXPERT
from flashrt_core.models.paligemma.weights import (GemmaLayerWeights, PrefixWeights, VisionLayerWeights, gemma_layer,
                                                  moved, prefix_fields, rope_inv_freq, sincos_time_embedding,
                                                  step_times)
from flashrt_core.models.pi05.config import Pi05Config


# LeRobot keeps every norm parameter in fp32 in bf16 mode; the precomputed tables and RoPE frequencies too.
_FP32_FIELDS = {"attn_norm", "mlp_norm", "attn_ada_w", "attn_ada_b", "mlp_ada_w", "mlp_ada_b",
                "final_ada_w", "final_ada_b", "step_times", "time_cond", "ada_attn", "ada_mlp", "ada_final",
                "rope_inv_freq"}


# The tables `precompute_tables` derives from the other weights (CPU matmuls: their last bits depend on the
# thread count): not part of the weights' identity (`paligemma.binding.named_tensors`).
TABLE_FIELDS = frozenset({"step_times", "time_cond", "ada_attn", "ada_mlp", "ada_final", "rope_inv_freq"})


@dataclass
class Pi05Weights(PrefixWeights):
    TABLE_FIELDS = TABLE_FIELDS  # (a class attribute: not a field)
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
        return moved(self, device, dtype, vision_dtype, fp32_fields=_FP32_FIELDS)


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
