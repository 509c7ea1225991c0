"""Random weights in the LeRobot layout, for runs without a checkpoint (benchmarks, a contract with no
checkpoint, the GPU tests): every tensor `expected_keys(config)` names (pi0.5 or pi0 by `config.kind`), fp32,
drawn on `device` in sorted key order from one seeded generator (seconds on a GPU, minutes at full size on a
CPU). The built-in tiny model has its own draw (`models.paligemma.tiny`), fixed by the golden tests."""
from __future__ import annotations

import math

import torch


def random_state(config, seed: int, device, std: float | None = None) -> dict[str, torch.Tensor]:
    """std given: every tensor ~ normal(0, std) (the benchmarks' workload: normal(0, 0.02), as the issues
    state it). std None: matrices ~ N(0, 1/fan_in), norm weights near neutral (SigLIP's LayerNorms near 1,
    Gemma's RMSNorm offsets near 0), biases small, so every path changes the output (a contract run without
    a checkpoint)."""
    from flashrt_core.models.paligemma.checkpoint import expected_keys

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in sorted(expected_keys(config).items()):
        t = torch.randn(shape, generator=gen, device=device)
        if std is not None:
            t.mul_(std)
        elif name.endswith(".bias"):
            t.mul_(0.1)
        elif len(shape) == 1:
            t.mul_(0.1).add_(1.0 if "vision_tower" in name else 0.0)
        else:
            t.div_(math.sqrt(math.prod(shape[1:])))
        out[name] = t
    return out


__all__ = ["random_state"]
