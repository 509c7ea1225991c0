"""Attention launch configurations of the engine, picked per shape by measuring them on this GPU.

The three attention shapes of pi0.5 (SigLIP patches, the prefix over itself, the 50 action queries over the
cached prefix + themselves) want very different tilings: the action expert has 8 query heads sharing one
K/V head and only 50 tokens, so its 400 query rows must be split over keys to fill the SMs, and the best
(BLOCK_M, BLOCK_N, splits, warps) differs between GPUs (H200, Thor). `AttentionPicker` times the kernel's
own heuristic and a few alternatives once per shape during the engine's warm-up (CUDA-graph timing, as in
a decision; never inside capture) and keeps the fastest whose output matches the heuristic's (remembered
across processes by `flashrt_core.engine.tuning.TuningCache`, and checked against the heuristic once when read). On CPU it is
`kernels.attention` unchanged. Reference: `kernels.reference.attention_ref`.
"""
from __future__ import annotations

import torch

from flashrt_core import kernels as K
from flashrt_core.engine.timing import graph_ms
from flashrt_core.kernels._common import precompile
from flashrt_core.engine.tuning import agrees, reuse_or_tune

# (BLOCK_M, BLOCK_N, splits, num_warps[, num_stages]) tried besides the kernel's heuristic
# (None). The last rows are aimed at the expert's 400 GQA rows over ~610 keys of head dim 256 (its
# heuristic: (16, 32, 8, 8)): shallower or deeper key pipelines, 16 warps for the wide accumulator, other
# split counts.
# Left out (H200, 2026-12-03): (64, 32, 4, 4), (64, 32, 8, 4), (64, 32, 16, 4) and (128, 32, 4, 8), 2.4-7x slower
# than the best at every pi0.5 shape of W2, one and three views (benchmarks/results/pi05_*.json attention_choices), and
# spilling 432-2072 bytes per thread at the expert's (sm_90, test/ptx_testing.py): compile time at warm-up only.
CANDIDATES = [(16, 32, 8, 4), (32, 32, 8, 4), (32, 64, 4, 4), (64, 64, 4, 8),
              (32, 32, 16, 4), (64, 64, 1, 4), (128, 64, 1, 8),
              (16, 32, 8, 8, 1), (16, 32, 8, 8, 3), (16, 64, 4, 8, 2), (16, 32, 16, 8, 1), (32, 32, 8, 8, 2),
              (32, 32, 8, 16, 2), (64, 32, 8, 16, 2), (16, 32, 4, 8, 3),
              # fewer or no key splits: the split merge (partials, ticket, reload) is a serial tail of its own
              (16, 64, 1, 4), (32, 64, 1, 4), (16, 64, 2, 4), (32, 64, 2, 8),
              # one key tile per program (no serial key loop; the merge sums 5-10 partials)
              (16, 64, 16, 4), (16, 128, 8, 4), (16, 128, 8, 8),
              # the same with one pipeline stage: a one-tile loop needs no second buffer, so the shared memory
              # halves (expert shape, sm_90: 76-88 KB instead of 140 KB, two programs per SM; no spills,
              # `test/ptx_testing.py`)
              (16, 128, 8, 8, 1), (32, 128, 8, 8, 1), (32, 64, 16, 8, 1),
              # the prefix's (560 queries x 8 heads over 560 keys) pick (64, 64, 1, 4) uses 255 registers and
              # spills at sm_90; these forms do not (8 warps, or 32-key tiles: 96 KB, two programs per SM)
              (64, 64, 1, 8), (64, 32, 1, 8), (64, 32, 2, 8), (128, 32, 1, 8)]
TIMED_CALLS = 10
MATCH_REL = 2e-2  # a candidate's output vs the heuristic's, relative to its largest entry


class AttentionPicker:
    """`picker(q, k, v, key_mask, k2, v2, backend=...)` = `kernels.attention`, with the launch configuration
    per shape chosen by timing while `tuning` is True (CUDA only)."""

    def __init__(self, device, enabled: bool = True, cache=None):
        self.device, self.enabled, self.tuning, self.cache = torch.device(device), enabled, False, cache
        self.candidates = list(CANDIDATES)
        self.cache_name = "attention"
        self.choices: dict[tuple, tuple | None] = {}
        self.timings: dict[tuple, dict] = {}

    def __call__(self, q, k, v, key_mask=None, k2=None, v2=None, *, constant_kv=False, out=None, backend=None):
        """constant_kv: k, v and key_mask are written by no kernel of this launch's PDL chain (the cached
        prefix during the act stage): the kernel reads them before its PDL wait (`kernels.attention`). out: the
        result is written there (a view of a larger buffer may do)."""
        if not (self.enabled and q.device.type == "cuda" and K.available(q.device) and backend != "torch"):
            return K.attention(q, k, v, key_mask, k2, v2, constant_kv=constant_kv, out=out, backend=backend)
        from flashrt_core.kernels.flash_attention import attention as kernel

        def attention(*args, **kwargs):
            return kernel(*args, constant_kv=constant_kv, **kwargs)
        key = (tuple(q.shape), tuple(k.shape), key_mask is not None, None if k2 is None else tuple(k2.shape), q.dtype)
        if constant_kv:  # another kernel specialization, tuned on its own
            key += ("constant_kv",)
        if key not in self.choices:
            if not self.tuning:
                return attention(q, k, v, key_mask, k2, v2, out=out)
            self.choices[key] = self._cached(key, attention, q, k, v, key_mask, k2, v2)
        return attention(q, k, v, key_mask, k2, v2, config=self.choices[key], out=out)

    def _cached(self, key, attention, q, k, v, key_mask, k2, v2):
        """The cache's choice for this shape if it still matches the heuristic's output, else a new tuning."""
        def check(config):
            got = attention(q, k, v, key_mask, k2, v2, config=config)
            return agrees(got, attention(q, k, v, key_mask, k2, v2), MATCH_REL)
        return reuse_or_tune(self.cache, self.cache_name, key, self.candidates, check,
                             lambda: self._tune(key, attention, q, k, v, key_mask, k2, v2), self.timings, q.device)

    def _tune(self, key, attention, q, k, v, key_mask, k2, v2):
        # every candidate's kernels compiled in parallel first (compiling is most of a tuning's time)
        precompile([lambda c=config: attention(q, k, v, key_mask, k2, v2, config=c)
                    for config in [None, *self.candidates]])
        want = attention(q, k, v, key_mask, k2, v2)
        times = {}
        for config in [None, *self.candidates]:
            name = "heuristic" if config is None else str(config)
            fn = (lambda _, c=config: attention(q, k, v, key_mask, k2, v2, config=c))
            try:
                if not agrees(fn(None), want, MATCH_REL):
                    times[name] = "mismatch"
                    continue
                times[name] = graph_ms(fn, [None] * TIMED_CALLS)
            except Exception as exc:  # a configuration this GPU cannot launch (shared memory) is skipped
                torch.cuda.synchronize(q.device)
                times[name] = f"failed: {type(exc).__name__}"
        self.timings[key] = times
        valid = {n: t for n, t in times.items() if isinstance(t, float)}
        best = min(valid, key=valid.get)
        return None if best == "heuristic" else next(c for c in self.candidates if str(c) == best)

    def report(self) -> list[dict]:
        """The chosen configuration per shape with every candidate's time (for benchmark JSON)."""
        return [{"q": list(key[0]), "k": list(key[1]), "masked": key[2], "k2": key[3],
                 "constant_kv": "constant_kv" in key, "choice": "heuristic" if c is None else str(c),
                 "ms": self.timings.get(key)} for key, c in self.choices.items()]

