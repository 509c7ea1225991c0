"""Known kinds of submodules, in the order they are tried (larger units first, so a kept MLP or attention
block is not also split into merged linears and activations)."""
from flashrt_core.adopt.kinds.attention import ATTENTION
from flashrt_core.adopt.kinds.base import NotRecognised, Plan, Replacement
from flashrt_core.adopt.kinds.mlp import GATED_MLP, GELU, MLP
from flashrt_core.adopt.kinds.norms import ADA_RMS_NORM, LAYER_NORM, RMS_NORM

LINEAR_MERGE = "linear_merge"  # not a single-module Replacement: groups come from the capture run

# (kind, replacement or None for the linear merge), in trial order.
BUILTIN_ORDER = [
    ("attention", ATTENTION), ("gated_mlp", GATED_MLP), ("mlp", MLP), ("ada_rms_norm", ADA_RMS_NORM),
    ("rms_norm", RMS_NORM), ("layer_norm", LAYER_NORM), (LINEAR_MERGE, None), ("gelu", GELU),
]
KINDS = tuple(kind for kind, _ in BUILTIN_ORDER)

__all__ = ["BUILTIN_ORDER", "KINDS", "LINEAR_MERGE", "NotRecognised", "Plan", "Replacement"]
