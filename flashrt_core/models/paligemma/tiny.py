"""Tiny random models of the PaliGemma family (the built-in tiny pi0.5, test models): random weights in the
LeRobot layout, deterministic from a seed, no downloads.

Weights are drawn like the golden fixture's: matrices ~ N(0, 1/fan_in), norm weights and biases non-zero,
so every path (AdaRMS, time MLP, masks) changes the output. Hugging Face's own init would leave AdaRMS
and RMSNorm weights at zero and make the time conditioning inert.
"""
from __future__ import annotations

import math
import os

import torch

from flashrt_core.models.paligemma.checkpoint import expected_keys, save_checkpoint
from flashrt_core.models import registry
from flashrt_core.models.paligemma.config import PaliGemmaConfig

_NORM_STD = 0.1  # spread of norm weights around their neutral value, and of biases


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith(".bias"):
        return noise * _NORM_STD
    if len(shape) == 1:  # norm weights: SigLIP LayerNorm scales by w (neutral 1), Gemma RMSNorm by 1 + w (neutral 0)
        neutral = 1.0 if "vision_tower" in name else 0.0
        return neutral + noise * _NORM_STD
    fan_in = math.prod(shape[1:])
    return noise / math.sqrt(fan_in)


def build_tiny(seed: int = 0, config: PaliGemmaConfig | None = None):
    """-> (config, state_dict) of a random model of `config` (default: the built-in tiny model, the default
    kind's `tiny()`), identical for equal seeds."""
    config = config or registry.config_class(registry.DEFAULT_KIND).tiny()
    gen = torch.Generator().manual_seed(seed)
    # Draw in sorted key order so the tensors do not depend on how expected_keys orders its dict.
    state = {name: _draw(name, shape, gen) for name, shape in sorted(expected_keys(config).items())}
    return config, state


def tiny_checkpoint(path: str | os.PathLike, seed: int = 0):
    """Save the built-in tiny model as a checkpoint folder (same layout as LeRobot's) and return its path."""
    config, state = build_tiny(seed)
    return save_checkpoint(path, config, state)
