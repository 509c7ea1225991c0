"""pi0's config: the PaliGemma family's sizes, and the checkpoint keys of pi0's action expert (plain RMSNorms,
a state token, and the action-time MLP over [action embedding, time embedding])."""
from __future__ import annotations

from dataclasses import dataclass

from flashrt_core.models.paligemma.config import EXPERT, PaliGemmaConfig


@dataclass(frozen=True)
class Pi0Config(PaliGemmaConfig):
    kind: str = "pi0"

    ACT_READS_STATE = True  # the state token: denoise(prefix, state, noise)
    MARKER_KEY = "model.state_proj.weight"  # only pi0's checkpoints have it (`paligemma.config`)

    @staticmethod
    def expert_keys(config: PaliGemmaConfig) -> dict[str, tuple[int, ...]]:
        e = config.expert
        keys = {}
        for i in range(e.depth):
            for n in ("input_layernorm", "post_attention_layernorm"):
                keys[f"{EXPERT}layers.{i}.{n}.weight"] = (e.width,)
        keys[EXPERT + "norm.weight"] = (e.width,)
        keys["model.state_proj.weight"] = (e.width, config.state_dim)
        keys["model.state_proj.bias"] = (e.width,)
        keys["model.action_time_mlp_in.weight"] = (e.width, 2 * e.width)
        keys["model.action_time_mlp_in.bias"] = (e.width,)
        keys["model.action_time_mlp_out.weight"] = (e.width, e.width)
        keys["model.action_time_mlp_out.bias"] = (e.width,)
        return keys
