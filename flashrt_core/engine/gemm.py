"""GEMMs of the engine: cuBLAS, or the skinny Triton GEMM for the action expert, whichever measures faster.

`LinearPicker` times cuBLAS and the skinny GEMM's launch configurations (`CONFIGS`, `kernels.skinny_gemm`) per
shape during the engine's warm-up (never inside graph capture) and keeps the fastest (remembered across
processes by `flashrt_core.engine.tuning.TuningCache`); on CPU it is plain torch. A call may also add its result into a
residual stream (`GatedResidual`) or leave a split-K GEMM's partial sums to the kernel that reads the result
(`defer`): both are fused into the skinny GEMM, or done around cuBLAS when that measures faster.
Reference: `F.linear` (and `kernels.geglu` / `kernels.gated_residual` after it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core import kernels as K
from flashrt_core.engine.timing import graph_ms
from flashrt_core.kernels._common import KernelInputError, precompile
from flashrt_core.kernels.partials import dense
from flashrt_core.kernels.skinny_gemm import SKINNY_MAX_M, GatedResidual, skinny_linear, split_layout
from flashrt_core.kernels.fp8 import FP8Rows, FP8Weight, scaled_linear
from flashrt_core.kernels.mx4 import K_TILE as MX4_K_TILE, MX4Weight, mx_rows_ref
from flashrt_core.kernels.w4 import W4Weight, as_dense, weight_bytes
from flashrt_core.engine.tuning import agrees, reuse_or_tune

MATCH_REL = 3e-2  # a candidate's outputs vs cuBLAS's, relative to their largest entry
ROTATE_BYTES = 96 * 2 ** 20  # weight copies cycled while tuning: more than the H200's 50 MB L2
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, preload]) tried per shape on CUDA (at most SKINNY_MAX_M
# rows; above that the GEMM is compute-bound and cuBLAS wins).
CONFIGS = [(32, 128, 1, 4, 4), (64, 128, 1, 4, 4), (32, 256, 1, 4, 3), (16, 256, 1, 4, 4),
           (32, 128, 2, 4, 4), (32, 128, 4, 4, 4), (64, 128, 2, 4, 4), (16, 256, 4, 4, 3),
           (32, 128, 8, 4, 4), (64, 128, 4, 4, 4),
           # split 0: one BLOCK_K slice per program, weight tile prefetched before the PDL wait
           (32, 256, 0, 4, 1), (64, 128, 0, 4, 1), (32, 128, 0, 4, 1), (16, 256, 0, 4, 1), (64, 256, 0, 8, 1),
           (32, 512, 0, 4, 1),
           # for the N = 1024 outputs (o_proj, down), the slowest per byte on the H200 (0.7-1.1 TB/s)
           (16, 512, 0, 4, 1), (64, 512, 0, 8, 1), (16, 128, 0, 4, 1), (16, 256, 2, 4, 3), (32, 256, 2, 4, 3),
           (16, 128, 8, 4, 3),
           # a 6th entry: BLOCK_K weight tiles each program requests before the PDL wait in the looped modes
           # (`preload`). A stream of the expert's weights alone ran fastest with ~32 KB per program in flight
           # across each kernel boundary and two programs per SM (persistent_probe.py at f940ba3, H200).
           (32, 256, 1, 4, 3, 1), (32, 256, 1, 4, 3, 2), (16, 256, 1, 4, 4, 2), (32, 128, 1, 4, 4, 2),
           (16, 256, 2, 4, 3, 2), (32, 256, 2, 4, 3, 2), (16, 256, 4, 4, 3, 2), (32, 128, 4, 4, 4, 4),
           (16, 128, 8, 4, 3, 2), (16, 256, 8, 4, 3, 2)]
# (none of these spills at the expert's shapes on sm_90: `test/test_kernels_ptx.py`; (64, 128, 4, 4, 4, 2) did
# at gate|up and was left out)
# Tried and left out (H200, 2026-12-03): the whole K = 1024 in one step, (32, 1024, 0, 8, 1) and
# (16, 1024, 0, 8, 1): QKV 5.44 / 9.52 us vs 4.57, o 5.41 vs 5.01, down 7.60 vs 7.41, gate|up out of shared
# memory or 14.3 vs 7.14 (each program then reads all of x, 100 KB, after the PDL wait).
# The configurations tried for 4-bit weights (`kernels.w4`; K tiles of whole groups). A 4-bit tile carries a
# quarter of the bytes, so these take wider tiles (64 outputs, 512 inputs: 16 KB of packed weights per program);
# the preload and one-step forms load and dequantize their weight tile before the PDL wait. None spills at the
# expert's shapes on sm_90 (`test/test_kernels_ptx.py`). (16, 256, 1, 4, 3, 2), two programs per SM, is the
# GeGLU's pick (gate|up 9.4 us vs 10.7 for the next, H100 e98c285; its qkv / o / down forms lose 2-5x).
W4_CONFIGS = [(32, 256, 0, 4, 1), (16, 256, 1, 4, 4), (16, 128, 8, 4, 3), (32, 512, 0, 4, 1), (32, 512, 0, 8, 1),
              (64, 256, 0, 8, 1), (64, 512, 0, 8, 1), (32, 256, 1, 4, 3, 1), (32, 256, 1, 4, 3, 2),
              (16, 256, 2, 4, 3, 2), (16, 256, 1, 4, 3, 2), (32, 256, 2, 4, 3, 2), (16, 256, 4, 4, 3, 2),
              (16, 128, 8, 4, 3, 2), (16, 256, 8, 4, 3, 2)]
# A deferred split-K reduction's reader (one program per row) loads S partial rows: 8 at most (32 KB of fp32
# per 1024-wide row), so that read stays short.
DEFER_MAX_SPLITS = 8


def _cublas(x, w, b, geglu, backend, residual=None, silu=False, fp8_out=False):
    """The route without the skinny kernel: cuBLAS (-> GeGLU kernel), with a residual added by the
    gated-residual kernel after it (torch ops in fp32 for an fp32 stream). fp32 rows into a bf16 / fp16 GEMM
    are rounded first, as the skinny kernel rounds them on load (bf16 rows into an fp32 GEMM widened). A 4-bit weight is dequantized first (the
    reference route; the skinny kernel dequantizes in registers), an MXFP4 one too, multiplying the rows in MX
    e4m3 as the kernel does (`kernels.mx4.mx_rows_ref`); an fp8 weight multiplies fp8 rows
    (`kernels.fp8.scaled_linear`: per-token scales, cuBLAS's scaled GEMM on CUDA), or takes x as `FP8Rows`
    (quantized by the kernel that wrote them); fp8_out: a GeGLU's result as `FP8Rows` for the fp8 GEMM after it."""
    if isinstance(x, FP8Rows) or fp8_out:
        if not isinstance(w, FP8Weight) or (fp8_out and not geglu):
            raise KernelInputError("LinearPicker: fp8 rows go into (and come out of a GeGLU of) an fp8 weight only")
    else:
        x = x.to(w.dtype)
    if isinstance(w, MX4Weight):  # (the skinny kernel's activations: MX e4m3, exact in bf16)
        x = mx_rows_ref(x).to(x.dtype)
    if isinstance(w, FP8Weight):
        y = K.geglu(scaled_linear(x, w), fp8=fp8_out, backend=backend) if geglu else scaled_linear(x, w, b)
    else:
        w = as_dense(w)
        y = K.geglu(F.linear(x, w), backend=backend) if geglu else F.linear(x, w, b)
    if silu:
        y = F.silu(y)
    if residual is not None and residual.x.dtype != y.dtype:  # an fp32 stream (the flow state): torch, in fp32
        y = residual.x.add_(y.to(residual.x.dtype) * residual.gate.to(residual.x.dtype))
    elif residual is not None:
        y = K.gated_residual(residual.x, y, residual.gate, out=residual.x, backend=backend)
    return y


@dataclass(frozen=True)
class Fusion:
    """What a GEMM call does besides its product (each optional)."""

    residual: GatedResidual | None = None  # the result added into a residual stream in place
    defer: bool = False  # the skinny GEMM may leave its split-K partials to the reader (`kernels.Partials`)
    silu: bool = False  # the result is silu(product + bias)

    def tags(self, dtype: torch.dtype) -> tuple:
        """Part of the tuning key: each fusion is another kernel specialization, tuned on its own (a residual
        stream in another dtype than the GEMM's `dtype`, the fp32 flow state, is one more)."""
        tags = ("residual",) if self.residual is not None else ()
        if self.defer:
            tags += ("defer",)
        if self.silu:
            tags += ("silu",)
        if self.residual is not None and self.residual.x.dtype != dtype:
            tags += (f"residual:{self.residual.x.dtype}",)
        return tags

    def scratch(self) -> "Fusion":
        """The same call writing into copies (tuning trials must not change the engine's buffers)."""
        r = self.residual
        return Fusion(None if r is None else GatedResidual(r.x.clone(), r.gate), self.defer, self.silu)

    def outputs(self, y) -> list:
        """Everything the call writes, for comparing two routes."""
        return [dense(y)]


NO_FUSION = Fusion()


class LinearPicker:
    """`picker(x, w, b)` = F.linear and `picker.geglu(x, w_gate_up)` = GeGLU(F.linear), each routed per shape to
    the fastest of cuBLAS and the skinny Triton GEMM configurations (timed while `tuning` is True, i.e. in
    the engine's warm-up). `picker(..., residual=GatedResidual(...))` adds the result into a residual stream
    in place; `defer=True` lets a skinny GEMM return its split-K partials. mode: "auto" (time on CUDA,
    cuBLAS elsewhere), "torch" or "triton" (always the first skinny configuration where M is small: for
    tests)."""

    def __init__(self, device, mode: str = "auto", cache=None):
        """cache: an `flashrt_core.engine.tuning.TuningCache` whose choices are used (after one check against cuBLAS)
        instead of timing the candidates again; new choices are put into it."""
        if mode not in ("auto", "torch", "triton"):
            raise ValueError(f"gemm: one of auto, torch, triton; got {mode!r}")
        self.device, self.mode, self.tuning, self.cache = torch.device(device), mode, False, cache
        self.candidates = list(CONFIGS)
        self.cache_name = "linear"
        self.choices: dict[tuple, object] = {}  # shape key -> None (cuBLAS) or a CONFIGS entry
        self.timings: dict[tuple, dict] = {}  # shape key -> {candidate: ms}, for benchmark reports

    def __call__(self, x, w, b=None, *, residual=None, defer=False, silu=False, backend=None):
        """defer: a skinny GEMM may return its split-K partials unreduced (`kernels.Partials`, for
        `kernels.gated_residual_ada_rms_norm`, `kernels.add_rms_norm` or `kernels.qkv_rope_cache` to add up;
        cuBLAS returns the product): a plain product only. silu: F.silu of the result (fused into the skinny
        GEMM; not with a residual or defer)."""
        if defer and (b is not None or residual is not None):  # (checked here too: cuBLAS would ignore defer)
            raise KernelInputError("LinearPicker: defer= leaves a plain product's partials (no bias or residual)")
        if silu and (defer or residual is not None):
            raise KernelInputError("LinearPicker: silu= applies to a plain product (+ bias) only")
        return self._run(x, w, b, False, backend, Fusion(residual, defer=bool(defer), silu=bool(silu)))

    def geglu(self, x, w_gate_up, *, fp8=False, backend=None):
        """fp8: (an fp8 weight) the result as `FP8Rows` for the fp8 GEMM after it (`kernels.geglu(fp8=True)`)."""
        if fp8:  # (an fp8 weight always takes cuBLAS's scaled GEMM: nothing to pick)
            return _cublas(x, w_gate_up, None, True, backend, fp8_out=True)
        return self._run(x, w_gate_up, None, True, backend)

    def _run(self, x, w, b, geglu, backend, fusion=NO_FUSION):
        m = x.numel() // x.shape[-1]
        # (False without Triton; an fp8 weight always takes the scaled GEMM: the skinny kernel's fp8 forms measured
        # slower than bf16, docs/performance-history.md. 4-bit weights take it at any row count: it spreads rows
        # past SKINNY_MAX_M over programs, where cuBLAS would need the weight dequantized on every call)
        skinny = (m <= SKINNY_MAX_M or isinstance(w, (W4Weight, MX4Weight))) and K.available(x.device) \
            and not isinstance(w, FP8Weight)
        if self.mode == "torch" or not skinny or backend == "torch":
            return _route(None, x, w, b, geglu, backend, fusion)
        if self.mode == "triton":
            return _route(CONFIGS[0], x, w, b, geglu, backend, fusion)
        key = (m, tuple(w.shape), b is not None, geglu, x.dtype, *fusion.tags(w.dtype))
        if isinstance(w, W4Weight):  # another kernel specialization (and cuBLAS only after dequantizing)
            key += (f"w4g{w.group}",)
        elif isinstance(w, MX4Weight):
            key += ("mx4",)
        if key not in self.choices:
            if not (self.tuning and x.device.type == "cuda"):
                return _route(None, x, w, b, geglu, backend, fusion)
            self.choices[key] = self._cached(key, x, w, b, geglu, backend, fusion)
        return _route(self.choices[key], x, w, b, geglu, backend, fusion)

    def candidates_for(self, fusion=NO_FUSION, kdim: int | None = None, w=None) -> list:
        """The configurations tried for a call (of inner dimension `kdim`, weight `w`). A deferred reduction
        (fusion.defer) keeps those of at most DEFER_MAX_SPLITS splits: its reader loads every partial of each
        row, and that read is not part of the GEMM's timing. A 4-bit weight takes W4_CONFIGS whose K tiles hold
        whole groups."""
        out = list(W4_CONFIGS if isinstance(w, W4Weight) else self.candidates)
        if fusion.defer and kdim is not None:
            out = [c for c in out if splits(c, kdim) <= DEFER_MAX_SPLITS]
        if isinstance(w, W4Weight):
            out = [c for c in out if c[1] % w.group == 0]
        if isinstance(w, MX4Weight):  # (K tiles of whole pairs of scale blocks; nothing preloaded)
            out = [c for c in out if c[1] % MX4_K_TILE == 0 and not (len(c) > 5 and c[5])]
        return out

    def _cached(self, key, x, w, b, geglu, backend, fusion=NO_FUSION):
        """The cache's choice for this shape if it still computes the same as cuBLAS, else a new tuning."""
        def check(config):
            return _same(_outputs(config, x, w, b, geglu, backend, fusion),
                         _outputs(None, x, w, b, geglu, backend, fusion))
        return reuse_or_tune(self.cache, self.cache_name, key, self.candidates_for(fusion, x.shape[-1], w), check,
                             lambda: self._tune(key, x, w, b, geglu, backend, fusion), self.timings, x.device)

    def _tune(self, key, x, w, b, geglu, backend, fusion=NO_FUSION):
        """Time each candidate and return the fastest. Runs during warm-up (outside capture). Each candidate
        is timed the way a decision runs it: captured in a CUDA graph (no host launch cost, which would
        otherwise favour cuBLAS's cheaper launches), with the weight cycled through enough copies to
        overflow L2 (a decision streams every weight from HBM once per flow step). A residual stream is
        never touched here: every trial writes into copies."""
        candidates = {"cublas": None}
        for c in self.candidates_for(fusion, x.shape[-1], w):
            candidates[str(c)] = c
        trial = fusion.scratch()
        # every candidate's kernels compiled in parallel first (compiling is most of a tuning's time)
        precompile([lambda c=config: _route(c, x, w, b, geglu, backend, trial)
                    for config in candidates.values() if config is not None])
        copies = max(2, min(32, -(-ROTATE_BYTES // weight_bytes(w))))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        want = _outputs(None, x, w, b, geglu, backend, fusion)
        times = {}
        for name, config in candidates.items():
            try:
                # A candidate must agree with cuBLAS to bf16 accuracy before its speed counts.
                if not _same(_outputs(config, x, w, b, geglu, backend, fusion), want):
                    times[name] = "mismatch: disagrees with cuBLAS"
                    continue
                times[name] = graph_ms(lambda wi, c=config: _route(c, x, wi, b, geglu, backend, trial), ws)
            except Exception as exc:  # a configuration the compiler rejects on this GPU is simply skipped
                torch.cuda.synchronize(x.device)
                times[name] = f"failed: {type(exc).__name__}"
        del ws
        valid = {k: v for k, v in times.items() if isinstance(v, float)}
        self.timings[key] = times
        best = min(valid, key=valid.get)
        return candidates[best]

    def report(self) -> list[dict]:
        """The chosen GEMM per shape with every candidate's time (for benchmark JSON)."""
        out = []
        for key, config in self.choices.items():
            m, shape, bias, geglu, dtype, *fused = key
            out.append({"m": m, "weight": list(shape), "bias": bias, "geglu": geglu, "dtype": str(dtype),
                        "fused": list(fused), "choice": "cublas" if config is None else str(config),
                        "ms": self.timings.get(key)})
        return out


def _route(config, x, w, b, geglu, backend, fusion):
    """One GEMM call: cuBLAS (config None) or the skinny kernel with a CONFIGS entry."""
    if config is None:
        return _cublas(x, w, b, geglu, backend, fusion.residual, fusion.silu)
    return skinny_linear(x, w, b, geglu=geglu, residual=fusion.residual, defer=fusion.defer, silu=fusion.silu,
                         **_kwargs(config))


def _outputs(config, x, w, b, geglu, backend, fusion) -> list:
    """Everything route `config` writes for this call, written into copies (never the engine's buffers)."""
    scratch = fusion.scratch()
    return scratch.outputs(_route(config, x, w, b, geglu, backend, scratch))


def _same(got: list, want: list) -> bool:
    return all(agrees(g, t, MATCH_REL) for g, t in zip(got, want))


def splits(config, kdim: int) -> int:
    """How many K splits (programs per output tile) a CONFIGS entry gives at inner dimension kdim."""
    return split_layout(kdim, config[1], config[2])[1]


def _kwargs(config):
    """`skinny_linear`'s launch keywords for a CONFIGS entry."""
    bn, bk, split, warps, stages, *rest = config
    return {"block_n": bn, "block_k": bk, "split_k": split, "num_warps": warps, "num_stages": stages,
            "preload": rest[0] if rest else 0}
