"""pi0.5's config: the PaliGemma family's sizes, and the checkpoint keys of pi0.5's action expert (AdaRMS
norms conditioned on the flow time through the time MLP; the state is printed into the prompt)."""
from __future__ import annotations

from dataclasses import dataclass

from flashrt_core.models.paligemma.config import EXPERT, GemmaConfig, PaliGemmaConfig, VisionConfig

__all__ = ["Pi05Config", "GemmaConfig", "VisionConfig"]


@dataclass(frozen=True)
class Pi05Config(PaliGemmaConfig):
    kind: str = "pi05"

    ACT_READS_STATE = False  # the state is in the prompt
    MARKER_KEY = "model.time_mlp_in.weight"  # only pi0.5's checkpoints have it (`paligemma.config`)

    @staticmethod
    def expert_keys(config: PaliGemmaConfig) -> dict[str, tuple[int, ...]]:
        """The expert's norms as AdaRMS dense layers (cond -> scale|shift|gate), and the time MLP."""
        e = config.expert
        keys = {}
        for i in range(e.depth):
            for n in ("input_layernorm", "post_attention_layernorm"):
                keys[f"{EXPERT}layers.{i}.{n}.dense.weight"] = (3 * e.width, e.width)
                keys[f"{EXPERT}layers.{i}.{n}.dense.bias"] = (3 * e.width,)
        keys[EXPERT + "norm.dense.weight"] = (3 * e.width, e.width)
        keys[EXPERT + "norm.dense.bias"] = (3 * e.width,)
        for n in ("time_mlp_in", "time_mlp_out"):
            keys[f"model.{n}.weight"] = (e.width, e.width)
            keys[f"model.{n}.bias"] = (e.width,)
        return keys
