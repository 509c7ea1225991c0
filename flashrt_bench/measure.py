"""The measurements every benchmark shares: CUDA-event timing of a call, peak memory, and the parity of two
action chunks (cosine and relative L2 against stated targets)."""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from flashrt_core.engine.timing import cuda_samples

PARITY_TARGETS = {"cosine_min": 0.999, "rel_l2_max": 2e-2}


def host_samples(fn, warmup: int = 3, iters: int = 20) -> list[float]:
    """Host wall-clock ms of each call (where there is no GPU: the CPU tests of the benchmark's plumbing)."""
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def time_cuda(fn, warmup: int = 3, iters: int = 20, device="cuda") -> dict:
    """p50/p90/p99/mean ms of `cuda_samples` (of `host_samples` for a device other than CUDA)."""
    samples = cuda_samples if torch.device(device).type == "cuda" else host_samples
    ms = sorted(samples(fn, warmup, iters))

    def pct(p):
        return ms[min(len(ms) - 1, max(0, math.ceil(p / 100 * len(ms)) - 1))]

    return {"p50_ms": statistics.median(ms), "p90_ms": pct(90), "p99_ms": pct(99), "mean_ms": statistics.mean(ms),
            "min_ms": ms[0], "iters": iters, "warmup": warmup}


class PeakMemory:
    """Peak GPU memory allocated inside the `with` block beyond what was allocated when it began (0 off CUDA)."""

    def __init__(self, device="cuda"):
        self.cuda = torch.device(device).type == "cuda"
        self.gib = 0.0

    def __enter__(self):
        if not self.cuda:
            return self
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if not self.cuda:
            return False
        torch.cuda.synchronize()
        self.gib = (torch.cuda.max_memory_allocated() - self.base) / 2 ** 30
        return False


def compare(actions: torch.Tensor, truth: torch.Tensor, cosine_min: float = PARITY_TARGETS["cosine_min"],
            rel_l2_max: float = PARITY_TARGETS["rel_l2_max"]) -> dict:
    """Cosine, relative L2 and max error of actions against truth; pass at the given targets (default: bf16's)."""
    a, b = actions.float().flatten(), truth.float().flatten()
    cos = F.cosine_similarity(a, b, dim=0).item()
    rel = ((a - b).norm() / b.norm()).item()
    return {"cosine": cos, "rel_l2": rel, "max_abs": (a - b).abs().max().item(),
            "pass": cos >= cosine_min and rel <= rel_l2_max}


# ---- FLOPs and bytes per stage (for achieved TFLOP/s and GB/s) -------------------------------------------------
