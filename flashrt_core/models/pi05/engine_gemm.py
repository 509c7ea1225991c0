"""GEMMs of the engine: cuBLAS, or a skinny Triton GEMM for the action expert, whichever measures faster.

The action expert multiplies 50 tokens by 0.6 GB of weights per flow step: memory-bound GEMMs with M = 50,
where cuBLAS reaches only 0.7-1.4 TB/s (docs/gpu-machine.md). The Triton kernel here tiles only N and
(optionally) K, keeps the whole M in one tile, and streams weight tiles through a deep software pipeline;
with GEGLU=True it multiplies the gate and up halves of a merged [gate; up] weight side by side and
writes gelu_tanh(gate) * up directly (the GeGLU kernel and its intermediate disappear). Optional fusions
for the expert's AdaRMS blocks (`Pi05Engine(norm_in_gemm=True)`): a GEMM that produces the residual stream
adds its gated residual in place (`GatedResidual`) and writes the next norm's scaled input and row sums
(`RowStats`); the GEMM that reads that norm scales its rows after the product (`RowNorm`). With `QkvRope`
the fused QKV GEMM splits its output into heads, rotates q and k and writes q / k / v where the attention
reads them (`Pi05Engine(rope_in_gemm=True)`).
`LinearPicker` times cuBLAS and a few Triton configurations per shape during the engine's warm-up (never
inside graph capture) and keeps the fastest (remembered across processes by `engine_tuning.TuningCache`);
on CPU it is plain torch.
Reference: `F.linear` (and `kernels.geglu` after it); the fusions: `kernels.reference.ada_rms_norm_ref`,
`gated_residual_ref` and `qkv_rope_cache_ref`, and `row_stats_ref` here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core import kernels as K
from flashrt_core.engine.timing import graph_ms
from flashrt_core.kernels._common import (KernelInputError, KernelUnavailableError, interpreting, launch, pdl_launch,
                                         precompile, semaphores)
from flashrt_core.kernels.partials import Partials, dense
from flashrt_core.models.pi05.engine_tuning import agrees, reuse_or_tune

SKINNY_MAX_M = 128  # above this the GEMM is compute-bound and cuBLAS wins
MID_MAX_M = 1024  # ... except where its tiles leave SMs idle: SigLIP's GEMMs (512 rows) are offered MID_CONFIGS
MATCH_REL = 3e-2  # a candidate's outputs vs cuBLAS's, relative to their largest entry
ROTATE_BYTES = 96 * 2 ** 20  # weight copies cycled while tuning: more than the H200's 50 MB L2
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, preload]) tried per shape on CUDA.
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
           # across each kernel boundary and two programs per SM (`benchmarks/persistent_probe.py`, H200).
           (32, 256, 1, 4, 3, 1), (32, 256, 1, 4, 3, 2), (16, 256, 1, 4, 4, 2), (32, 128, 1, 4, 4, 2),
           (16, 256, 2, 4, 3, 2), (32, 256, 2, 4, 3, 2), (16, 256, 4, 4, 3, 2), (32, 128, 4, 4, 4, 4),
           (16, 128, 8, 4, 3, 2), (16, 256, 8, 4, 3, 2)]
# A 7th entry 1: the weight tiles come through a TMA descriptor (`skinny_linear(tma=True)`; preload 0 or 1,
# blocks up to 256 per dim), offered with `LinearPicker(tma=True)`. Deeper pipelines cost shared memory only
# (a TMA copy needs no registers), so these go to 6-8 stages. Measured on the H200 (1bdf079): slower than the
# pointer-loaded forms at the expert's four big shapes (QKV 4.74 vs 4.58 us, o 5.85 vs 5.06, gate|up 7.38 vs
# 6.99, down 7.66 vs 7.15), faster only at the flow step's tiny action in / out GEMMs; act unchanged.
TMA_CONFIGS = [(32, 128, 1, 4, 4, 0, 1), (32, 128, 1, 4, 6, 0, 1), (32, 64, 1, 4, 8, 0, 1), (64, 128, 1, 4, 4, 0, 1),
               (32, 128, 1, 4, 4, 1, 1), (32, 128, 2, 4, 4, 0, 1), (32, 128, 2, 4, 6, 1, 1), (32, 128, 4, 4, 4, 0, 1),
               (32, 128, 4, 4, 6, 1, 1), (16, 128, 8, 4, 4, 0, 1), (32, 64, 4, 4, 8, 0, 1),
               (16, 256, 1, 4, 4, 0, 1), (32, 256, 1, 4, 3, 0, 1), (32, 256, 0, 4, 1, 0, 1), (64, 256, 0, 8, 1, 0, 1),
               # 64 columns per program: as many weight bytes as row bytes per stage (x is staged too)
               (64, 128, 2, 4, 4, 0, 1), (64, 64, 2, 4, 8, 0, 1)]
# Mid-size rows (SKINNY_MAX_M < M <= MID_MAX_M, `LinearPicker(mid=True)`): an 8th entry is BLOCK_M. At M = 512
# cuBLAS runs SigLIP's o projection (512 x 1152 x 1152) at ~140 TFLOP/s: 36-45 output tiles for 132 SMs, and its
# kernels take no part in PDL. These offer smaller tiles, split K, and the PDL launch overlap.
MID_CONFIGS = [(64, 64, 1, 4, 4, 0, 0, 64), (128, 64, 1, 4, 4, 0, 0, 64), (64, 64, 1, 4, 4, 0, 0, 128),
               (128, 64, 1, 8, 4, 0, 0, 128), (128, 64, 1, 8, 3, 0, 0, 128), (64, 128, 1, 4, 3, 0, 0, 64),
               (64, 64, 2, 4, 4, 0, 0, 128), (128, 64, 2, 8, 4, 0, 0, 128), (64, 64, 2, 4, 4, 0, 0, 64),
               (32, 64, 1, 4, 4, 0, 0, 64), (64, 64, 3, 4, 4, 0, 0, 128), (256, 64, 1, 8, 3, 0, 0, 128)]
# (left out: (32, 128, 8, 4, 4, 0, 1), (64, 128, 0, 4, 1, 0, 1), (64, 128, 4, 4, 4, 0, 1) and (64, 128, 8, 4, 3, 0, 1)
# spill at one expert shape or more on sm_90, `test/ptx_testing.py --tma`)
# (none of these spills at the expert's shapes on sm_90: `test/test_kernels_ptx.py`; (64, 128, 4, 4, 4, 2) did
# at gate|up and was left out)
# Tried and left out (H200, 2026-12-03): the whole K = 1024 in one step, (32, 1024, 0, 8, 1) and
# (16, 1024, 0, 8, 1): QKV 5.44 / 9.52 us vs 4.57, o 5.41 vs 5.01, down 7.60 vs 7.41, gate|up out of shared
# memory or 14.3 vs 7.14 (each program then reads all of x, 100 KB, after the PDL wait).

try:  # Triton is optional on CPU-only installs; the picker then never offers it
    import triton
    import triton.language as tl

    from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait
    from flashrt_core.kernels._tickets import last_of_split, reset_ticket
except ImportError:  # pragma: no cover
    triton = None
try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

if triton is not None:
    @triton.jit
    def _gelu_tanh(g):
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 sqrt(2/pi) (g + 0.044715 g^3)
        e = tl.exp(-tl.abs(z))
        return g * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    @triton.jit
    def _rope_store(a1, a2, rm, rn, m_ok, out_mask, POS, COS, SIN, QO, KO, VO, T, n_positions,
                    q_sb, q_st, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, HQ: tl.constexpr, HKV: tl.constexpr,
                    HALF: tl.constexpr):
        """The QKV epilogue: dims j and j + HALF of each column's head (a1, a2, fp32), rotated for q and k heads
        by the row's position (v heads take cos 1, sin 0: unchanged), stored into q / k / v (see ROPE in the
        kernel)."""
        head = rn // HALF
        j = rn % HALF
        pos = tl.load(POS + rm, mask=m_ok, other=-1).to(tl.int64)  # positions [B, T]: row b T + t
        pos_ok = (pos >= 0) & (pos < n_positions)
        turn = out_mask & pos_ok[:, None] & (head < HQ + HKV)[None, :]
        idx = tl.where(turn, pos[:, None] * HALF + j[None, :], 0)
        c = tl.load(COS + idx, mask=turn, other=1.0)
        s = tl.load(SIN + idx, mask=turn, other=0.0)
        b = (rm // T).to(tl.int64)[:, None]
        t = (rm % T).to(tl.int64)[:, None]
        is_q = (head < HQ)[None, :]
        is_k = (head < HQ + HKV)[None, :]  # and not q
        dst = tl.where(is_q, QO + (b * q_sb + t * q_st + (head * q_sh + j)[None, :]),
                       tl.where(is_k, KO + (b * k_sb + t * k_ss + ((head - HQ) * k_sh + j)[None, :]),
                                VO + (b * v_sb + t * v_ss + ((head - HQ - HKV) * v_sh + j)[None, :])))
        tl.store(dst, (a1 * c - a2 * s).to(QO.dtype.element_ty), mask=out_mask)
        tl.store(dst + HALF, (a2 * c + a1 * s).to(QO.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _skinny_gemm_kernel(X, W, WD, B, Y, P, C, SW, SSI, G, SCN, XS, SSO, POS, COS, SIN, QO, KO, VO,
                            M, N, K, k_per_split, sxm, swn, sym, sps, up_rows, up_off, eps, n_chunks, T, n_positions,
                            q_sb, q_st, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
                            HAS_BIAS: tl.constexpr, GEGLU: tl.constexpr, SPLIT: tl.constexpr,
                            ONE_STEP: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr, EMIT: tl.constexpr,
                            ROPE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                            CHUNKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr,
                            TMA: tl.constexpr, DEFER: tl.constexpr, PDL: tl.constexpr):
        """Y[M, N] = X[M, K] @ W[N, K]^T (+ bias), X rounded to W's dtype on load (an fp32 X into a bf16 GEMM);
        GEGLU: Y = gelu(X Wg^T) * (X Wu^T) with Wu = W + up_rows rows.
        ROPE (the fused QKV projection, heads of 2 HALF dims): output column n of N = (HQ + 2 HKV) HALF is dim
        n % HALF of head n // HALF, and the second accumulator holds its rotate-half partner (weight row + HALF);
        the epilogue rotates q and k heads by POS[row] (fp32 COS / SIN tables, [n_positions, HALF]; a position
        outside them does not rotate) and stores q into QO [B, T, HQ, 2 HALF], k and v into KO / VO
        [B, HKV, >= T, 2 HALF] at row t (row = b T + t); Y is not written.
        SPLIT > 1: split-K; each program stores its fp32 partial(s) in P and the last of a tile's SPLIT programs
        to finish (ticket C[tile]) adds them up in split order and writes Y.
        DEFER (any SPLIT, plain product only): each program stores its fp32 partial in P [SPLIT, M, N] and
        stops there; the kernel that reads the result adds them up (`kernels.Partials`). No ticket, no Y.
        PRE_K > 0: the first PRE_K weight columns of the program's K range are loaded as one tile before
        waiting for the previous kernel (PDL), so the weight stream overlaps that kernel's tail; the K loop
        covers the rest. ONE_STEP (each program covers exactly one BLOCK_K slice, PRE_K = BLOCK_K): no loop.
        TMA: the weight tiles come through WD, a tensor descriptor of W with [BLOCK_N, BLOCK_K] blocks (Hopper's
        tensor memory accelerator: one bulk copy per tile into shared memory instead of per-thread loads; rows
        and columns past W's end read as zeros), PRE_K is 0 or BLOCK_K; not with ROPE (its rows are gathered).
        NORM (AdaRMS of the rows, X already scaled by (1 + scale) by the kernel that produced it, see EMIT):
        the product is scaled by each row's rsqrt(mean(x^2) + eps), with sum(x^2) the sum of SSI[:, row]
        ([n_chunks, M] partial sums, CHUNKS >= n_chunks), and the shift enters as SW = W @ shift (fp32, [N];
        for GEGLU [2N]). The K loop is the plain one: X feeds the dots straight from memory.
        RESID: Y holds the residual stream and is updated in place, Y += G[n] * result.
        EMIT (for the AdaRMS of the next GEMM): also writes XS = Y * (1 + SCN[n]) and the partial sums of
        Y^2 over each STAT_CHUNK columns into SSO [ceil(N / 16), M], from Y as stored."""
        pdl_trigger(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        k_lo = pid_k * k_per_split
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if ROPE:  # weight row of each output column (its partner: + HALF rows)
            wr = (rn // HALF) * (2 * HALF) + rn % HALF
        else:
            wr = rn  # GEGLU: the up half's weights are up_rows (= up_off elements) further, as for ROPE
        if PRE_K > 0:  # weights never depend on the previous kernel: request them before waiting for it
            kp = k_lo + tl.arange(0, PRE_K)
            kp_ok = (kp < K) & (kp < k_lo + k_per_split)
            if TMA:  # (PRE_K = BLOCK_K: the tile never crosses the split's end, which is a BLOCK_K multiple)
                wp = WD.load([pid_n * BLOCK_N, k_lo]).T
                wpu = wp
                if GEGLU:
                    wpu = WD.load([up_rows + pid_n * BLOCK_N, k_lo]).T
            else:
                wp_ptr = W + wr[None, :].to(tl.int64) * swn + kp[:, None]
                wp = tl.load(wp_ptr, mask=n_ok[None, :] & kp_ok[:, None], other=0.0)
                wpu = wp
                if GEGLU or ROPE:
                    wpu = tl.load(wp_ptr + up_off, mask=n_ok[None, :] & kp_ok[:, None], other=0.0)
            pdl_wait(PDL)
            xp = tl.load(X + rm[:, None] * sxm + kp[None, :], mask=m_ok[:, None] & kp_ok[None, :],
                         other=0.0).to(W.dtype.element_ty)
            if UPCAST:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: compute in fp32 there
                xp = xp.to(tl.float32)
                wp = wp.to(tl.float32)
                wpu = wpu.to(tl.float32)
            acc += tl.dot(xp, wp, input_precision=PRECISION)
            if GEGLU or ROPE:
                acc_up += tl.dot(xp, wpu, input_precision=PRECISION)
        else:
            pdl_wait(PDL)
        if not ONE_STEP:  # (one step: PRE_K = BLOCK_K = the whole split, loaded above)
            for k0 in range(k_lo + PRE_K, k_lo + k_per_split, BLOCK_K):
                kk = k0 + rk
                k_ok = kk < K
                x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0).to(W.dtype.element_ty)
                if TMA:
                    w = WD.load([pid_n * BLOCK_N, k0]).T
                else:
                    w_ptr = W + wr[None, :].to(tl.int64) * swn + kk[:, None]
                    w = tl.load(w_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] = W^T
                if UPCAST:
                    x = x.to(tl.float32)
                    w = w.to(tl.float32)
                acc += tl.dot(x, w, input_precision=PRECISION)
                if GEGLU or ROPE:
                    if TMA:
                        wu = WD.load([up_rows + pid_n * BLOCK_N, k0]).T
                    else:
                        wu = tl.load(w_ptr + up_off, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                    if UPCAST:
                        wu = wu.to(tl.float32)
                    acc_up += tl.dot(x, wu, input_precision=PRECISION)
        out_mask = m_ok[:, None] & n_ok[None, :]
        last = True
        if DEFER or SPLIT > 1:
            part = P + rm[:, None] * N + rn[None, :]
            tl.store(part + pid_k * sps, acc, mask=out_mask)
        if DEFER:
            last = False
        elif SPLIT > 1:
            if GEGLU or ROPE:  # the second accumulator's partials follow the first's
                tl.store(part + (SPLIT + pid_k) * sps, acc_up, mask=out_mask)
            tile = pid_m * tl.num_programs(0) + pid_n
            last = last_of_split(C, tile, SPLIT)
            if last:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # fixed order: the result does not depend on who finished last
                    acc += tl.load(part + s * sps, mask=out_mask, other=0.0, cache_modifier=".cg")
                    if GEGLU or ROPE:
                        acc_up += tl.load(part + (SPLIT + s) * sps, mask=out_mask, other=0.0, cache_modifier=".cg")
                reset_ticket(C, tile)
        if last:
            if NORM:
                ch = tl.arange(0, CHUNKS)
                sums = tl.load(SSI + ch[:, None] * M + rm[None, :], mask=(ch < n_chunks)[:, None] & m_ok[None, :],
                               other=0.0)
                rstd = tl.rsqrt(tl.sum(sums, 0) / K + eps)[:, None]
                acc = acc * rstd + tl.load(SW + wr, mask=n_ok, other=0.0)[None, :]
                if GEGLU or ROPE:
                    acc_up = acc_up * rstd + tl.load(SW + up_rows + wr, mask=n_ok, other=0.0)[None, :]
            if ROPE:
                _rope_store(acc, acc_up, rm, rn, m_ok, out_mask, POS, COS, SIN, QO, KO, VO, T, n_positions,
                            q_sb, q_st, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, HQ, HKV, HALF)
            else:
                if HAS_BIAS:
                    acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                if GEGLU:
                    acc = _gelu_tanh(acc) * acc_up
                y_ptr = Y + rm[:, None] * sym + rn[None, :]
                if RESID:
                    if Y.dtype.element_ty != W.dtype.element_ty:  # a wider stream (fp32 flow state): the result is
                        acc = acc.to(W.dtype.element_ty).to(tl.float32)  # rounded as an unfused GEMM would store it
                    acc = tl.load(y_ptr, mask=out_mask, other=0.0).to(tl.float32) + \
                        acc * tl.load(G + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                out = acc.to(Y.dtype.element_ty)
                tl.store(y_ptr, out, mask=out_mask)
                if EMIT:
                    v = tl.where(out_mask, out.to(tl.float32), 0.0)
                    sc = tl.load(SCN + rn, mask=n_ok, other=0.0).to(tl.float32)
                    tl.store(XS + rm[:, None] * N + rn[None, :], (v * (1.0 + sc[None, :])).to(XS.dtype.element_ty),
                             mask=out_mask)
                    squares = tl.sum(tl.reshape(v * v, [BLOCK_M, BLOCK_N // 16, 16]), 2)  # 16 = STAT_CHUNK
                    chunk = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
                    tl.store(SSO + chunk[None, :] * M + rm[:, None], squares,
                             mask=m_ok[:, None] & (chunk < (N + 15) // 16)[None, :])


# A deferred split-K reduction's reader (one program per row) loads S partial rows: 8 at most (32 KB of fp32
# per 1024-wide row), so that read stays short.
DEFER_MAX_SPLITS = 8
STAT_CHUNK = 16  # columns per partial sum of squares in RowStats.sums (every BLOCK_N is a multiple of it)


def stat_chunks(width: int) -> int:
    return -(-width // STAT_CHUNK)


@dataclass(frozen=True)
class RowStats:
    """What a GEMM that produces a row (a residual stream) also writes for the AdaRMS that the next GEMM
    applies to it: `scaled` = result * (1 + scale) in the GEMM's dtype, and `sums` [stat_chunks(N), M] fp32,
    the partial sums of result^2 over each STAT_CHUNK columns (the row's mean square, in a fixed order
    whatever the producer's tiling). The consumer reads `scaled` as its input: see RowNorm."""

    scale: torch.Tensor  # [N]
    scaled: torch.Tensor  # [..., N] contiguous, written
    sums: torch.Tensor  # [stat_chunks(N), M] fp32 contiguous, written


@dataclass(frozen=True)
class RowNorm:
    """AdaRMS rms(x) * (1 + scale) + shift of a GEMM's input rows, fused into the GEMM: the input given is
    x * (1 + scale) and `sums` its rows' sums of squares of x (both written by the producing GEMM, RowStats);
    the product is scaled per row by rsqrt(mean square + eps) and `shift_w` = w @ shift is added (fp32,
    precomputed per weight: [N], for a merged gate|up weight [2F]). No norm kernel, and the GEMM's K loop is
    the plain one (an input transformed on load would leave the software pipeline)."""

    sums: torch.Tensor  # [stat_chunks(K), M] fp32
    shift_w: torch.Tensor  # [N] fp32
    eps: float


@dataclass(frozen=True)
class GatedResidual:
    """A GEMM whose result goes into the residual stream: x += gate * result, in place (x is returned). x may
    also be fp32 under a bf16 / fp16 GEMM (the flow-matching state: x_t += dt * velocity, with the velocity
    rounded to the GEMM's dtype first, as the unfused GEMM would have stored it)."""

    x: torch.Tensor  # [..., N] contiguous, the GEMM's (weight's) dtype or fp32
    gate: torch.Tensor  # [N]


@dataclass(frozen=True)
class QkvRope:
    """The fused QKV projection's split, RoPE and K/V write done in the GEMM's epilogue (what
    `kernels.qkv_rope_cache` does after it otherwise, with cache offset 0): the weight is [(Hq + 2 Hkv) Dh, K]
    (q heads, then k heads, then v heads); q heads are rotated by `positions` [B, T] (rows of the GEMM's input
    are b T + t) into `q` [B, T, Hq, Dh], k heads rotated and v heads copied into `k` / `v` [B, Hkv, >= T, Dh]
    at rows t (any strides, unit last stride). cos / sin: the fp32 [positions, Dh / 2] tables of
    `kernels.rope_cos_sin`. The GEMM call returns `q`."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    num_q_heads: int
    num_kv_heads: int

    def check(self, x, w, b, geglu, residual, emit) -> int:
        """Raise KernelInputError unless this fits the GEMM x [..., K] @ w^T; returns the head dim."""
        heads = self.num_q_heads + 2 * self.num_kv_heads
        m = x.numel() // x.shape[-1]
        if b is not None or geglu or residual is not None or emit is not None:
            raise KernelInputError("skinny_linear: rope= fuses only with norm= (no bias, geglu, residual, emit)")
        if self.num_q_heads < 1 or self.num_kv_heads < 1 or w.shape[0] % heads or (w.shape[0] // heads) % 2:
            raise KernelInputError(f"skinny_linear: rope= needs a weight of (num_q_heads + 2 num_kv_heads) x an even "
                                   f"head dim rows, got {w.shape[0]} rows for {self.num_q_heads} + 2 x "
                                   f"{self.num_kv_heads} heads")
        dh = w.shape[0] // heads
        pos = self.positions
        if pos.dim() != 2 or pos.numel() != m or pos.dtype not in (torch.int32, torch.int64) \
                or not pos.is_contiguous() or pos.device != x.device:
            raise KernelInputError(f"skinny_linear: rope positions must be a contiguous int [B, T] tensor with "
                                   f"B T = {m} rows on {x.device}, got {tuple(pos.shape)} {pos.dtype}")
        bsz, t = pos.shape
        _fp32_table("rope cos", self.cos, (self.cos.shape[0], dh // 2), x.device)
        _fp32_table("rope sin", self.sin, tuple(self.cos.shape), x.device)
        for name, out, shape in (("q", self.q, (bsz, t, self.num_q_heads, dh)),
                                 ("k", self.k, (bsz, self.num_kv_heads, self.k.shape[2], dh)),
                                 ("v", self.v, (bsz, self.num_kv_heads, self.k.shape[2], dh))):
            if tuple(out.shape) != shape or out.dim() != 4 or out.stride(-1) != 1 or out.dtype != x.dtype \
                    or out.device != x.device or out.shape[2] < (t if name != "q" else 0):
                raise KernelInputError(f"skinny_linear: rope {name} must be a {x.dtype} {list(shape)} tensor (unit "
                                       f"last stride, k / v with >= {t} rows) on {x.device}, got "
                                       f"{tuple(out.shape)} {out.dtype}")
        return dh


def _vector(name, t, n, dev):
    if tuple(t.shape) != (n,) or t.device != dev or t.stride(-1) != 1:
        raise KernelInputError(f"skinny_linear: {name} must be a unit-stride [{n}] vector on {dev}, "
                               f"got {tuple(t.shape)}")


def _fp32_table(name, t, shape, dev):
    if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device != dev:
        raise KernelInputError(f"skinny_linear: {name} must be a contiguous fp32 {list(shape)} tensor on {dev}, "
                               f"got {tuple(t.shape)} {t.dtype}")


def _rows_like(name, t, shape, dtype, dev):
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != dev:
        raise KernelInputError(f"skinny_linear: {name} must be a contiguous {dtype} tensor of shape {shape} on "
                               f"{dev}, got {tuple(t.shape)} {t.dtype}")


def _check_defer(op, b, geglu, fusion) -> None:
    """A deferred reduction leaves a plain product's partials: no bias, GeGLU or fusion needs the sum first."""
    if b is not None or geglu or any(f is not None for f in (fusion.norm, fusion.residual, fusion.emit,
                                                               fusion.rope)):
        raise KernelInputError(f"{op}: defer= leaves a plain product's partials (no bias, geglu, norm, residual, "
                               "emit or rope)")


def _check_fusions(x, n, geglu, norm, residual, emit, dtype):
    """dtype: the GEMM's (its weight's); x may be wider (fp32 rows into a bf16 GEMM are rounded on load)."""
    kdim, dev, m = x.shape[-1], x.device, x.numel() // x.shape[-1]
    out_shape = (*x.shape[:-1], n)
    if norm is not None:
        _fp32_table("norm sums", norm.sums, (stat_chunks(kdim), m), dev)
        _fp32_table("norm shift_w", norm.shift_w, ((2 if geglu else 1) * n,), dev)
    if residual is not None:
        _rows_like("the residual", residual.x, out_shape,
                   torch.float32 if residual.x.dtype == torch.float32 else dtype, dev)
        _vector("the residual gate", residual.gate, n, dev)
        if emit is not None and residual.x.dtype != dtype:
            raise KernelInputError("skinny_linear: row stats need the residual stream in the GEMM's dtype")
    if emit is not None:
        _vector("the row stats scale", emit.scale, n, dev)
        _rows_like("the row stats' scaled output", emit.scaled, out_shape, dtype, dev)
        _fp32_table("the row stats' sums", emit.sums, (stat_chunks(n), m), dev)


def skinny_linear(x, w, b=None, *, geglu=False, block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=4,
                  preload=0, tma=False, norm: RowNorm | None = None, residual: GatedResidual | None = None,
                  emit: RowStats | None = None, rope: QkvRope | None = None, defer: bool = False,
                  block_m: int | None = None):
    """F.linear(x, w, b) for x [..., K] with few rows, w [N, K] contiguous. geglu=True: w is [2F, K] = [gate; up]
    and the result is gelu_tanh(x gate^T) * (x up^T) [..., F] (no bias). split_k=0: one BLOCK_K slice per
    program (K / BLOCK_K splits), whose weight tile is loaded before the PDL wait. preload (0 or a power of
    two; split_k >= 1): each program loads its first `preload` BLOCK_K weight tiles before the PDL wait.
    norm: x is an AdaRMS input already scaled by its producer (RowNorm); residual: the result is added into
    it (and it is returned); emit: also write the next AdaRMS's input and row sums (RowStats); rope: w is
    the fused QKV weight, split, rotated and written into q / k / v (QkvRope; q is returned). tma: the weight
    tiles are read through a tensor descriptor (TMA bulk copies; preload 0 or 1, block sizes up to 256, not
    with rope). defer: return the split-K partial products unreduced (`kernels.Partials`, for a reader that
    adds them up: `kernels.gated_residual_ada_rms_norm`); a plain product only (no bias or fusion).
    block_m: rows per program, a power of two >= 16 (default: all rows up to SKINNY_MAX_M in one)."""
    if triton is None:
        raise KernelUnavailableError("skinny_linear: Triton is not installed")
    if split_k < 0:
        raise KernelInputError(f"skinny_linear: split_k must be >= 0, got {split_k}")
    if preload < 0 or preload & (preload - 1):
        raise KernelInputError(f"skinny_linear: preload must be 0 or a power of two, got {preload}")
    if emit is not None and block_n % STAT_CHUNK:
        raise KernelInputError(f"skinny_linear: row stats need a block_n multiple of {STAT_CHUNK}, got {block_n}")
    kdim = x.shape[-1]
    x2 = x.reshape(-1, kdim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if not w.is_contiguous() or w.shape[1] != kdim:
        raise KernelInputError(f"skinny_linear: `w` must be contiguous [N, {kdim}], got {tuple(w.shape)}")
    m = x2.shape[0]
    paired = geglu or rope is not None  # a second accumulator: the up half, or each dim's rotate-half partner
    n = w.shape[0] // 2 if paired else w.shape[0]
    dh = rope.check(x, w, b, geglu, residual, emit) if rope is not None else 2
    if x.dtype != w.dtype and not (x.dtype == torch.float32 and w.dtype in (torch.bfloat16, torch.float16)):
        raise KernelInputError(f"skinny_linear: `x` {x.dtype} with a {w.dtype} weight (only fp32 rows into a "
                               "bf16 / fp16 GEMM are rounded on load)")
    _check_fusions(x, w.shape[0] if rope is not None else n, geglu, norm, residual, emit, w.dtype)
    if tma:
        _check_tma(w, block_n, block_k, preload, rope)
    if defer:
        _check_defer("skinny_linear", b, geglu, Fusion(norm, residual, emit, rope))
    if rope is not None:
        y = rope.q
    elif defer:
        y = w  # (never written)
    else:
        y = residual.x if residual is not None else torch.empty(m, n, device=x.device, dtype=w.dtype)
    interp = interpreting()
    if block_m is None:
        block_m = max(16, triton.next_power_of_2(min(m, SKINNY_MAX_M)))
    elif block_m < 16 or block_m & (block_m - 1):
        raise KernelInputError(f"skinny_linear: block_m must be a power of two >= 16, got {block_m}")
    k_per_split, split = split_layout(kdim, block_k, split_k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    one_step = k_per_split == block_k
    pre_k = block_k if one_step else min(preload * block_k, triton.next_power_of_2(k_per_split))
    if defer:
        part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        tickets = part
    elif split > 1:
        part = torch.empty((2 if paired else 1) * split, m, n, device=x.device, dtype=torch.float32)
        tickets = semaphores(grid[0] * grid[1], x.device)
    else:
        part = tickets = y
    up_rows = dh // 2 if rope is not None else n  # rows between the two accumulators' weights (GEGLU, ROPE)
    rope_args, rope_ints = None, (1, 1) + (0,) * 9
    if rope is not None:
        rope_args = (rope.positions, rope.cos, rope.sin, rope.q, rope.k, rope.v)
        rope_ints = (rope.positions.shape[1], rope.cos.shape[0], *rope.q.stride()[:3], *rope.k.stride()[:3],
                     *rope.v.stride()[:3])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k]) if tma else w
    launch(_skinny_gemm_kernel, grid,
        x2, w, w_desc, b if b is not None else w, y, part, tickets, norm.shift_w if norm is not None else w,
        norm.sums if norm is not None else w, residual.gate if residual is not None else w,
        emit.scale if emit is not None else w, emit.scaled if emit is not None else w,
        emit.sums if emit is not None else w, *(rope_args or (w,) * 6),
        m, n, kdim, k_per_split, x2.stride(0), w.stride(0), n, m * n, up_rows, up_rows * w.stride(0),
        float(norm.eps) if norm is not None else 0.0, stat_chunks(kdim), *rope_ints,
        HAS_BIAS=b is not None, GEGLU=geglu, SPLIT=split, ONE_STEP=one_step,
        NORM=norm is not None, RESID=residual is not None, EMIT=emit is not None, ROPE=rope is not None,
        HQ=rope.num_q_heads if rope is not None else 1, HKV=rope.num_kv_heads if rope is not None else 1,
        HALF=dh // 2,
        CHUNKS=triton.next_power_of_2(stat_chunks(kdim)), UPCAST=interp and w.dtype != torch.float32,
        PRECISION="ieee" if w.dtype == torch.float32 or interp else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRE_K=pre_k, TMA=bool(tma), DEFER=bool(defer), num_warps=num_warps,
        num_stages=1 if interp else num_stages, **pdl_launch(x.device))
    if defer:
        return Partials(part, w.dtype, (*x.shape[:-1], n))
    return y if residual is not None or rope is not None else y.view(*x.shape[:-1], n)


TMA_MAX_BOX = 256  # elements per dimension of one TMA block


def _check_tma(w, block_n, block_k, preload, rope):
    """Raise KernelInputError unless the weight can be read through a TMA descriptor with these tiles."""
    if TensorDescriptor is None:
        raise KernelUnavailableError("skinny_linear: tma needs triton.tools.tensor_descriptor")
    if rope is not None:
        raise KernelInputError("skinny_linear: tma does not fuse with rope= (its weight rows are gathered)")
    if preload > 1:
        raise KernelInputError(f"skinny_linear: tma preloads at most one BLOCK_K tile, got preload={preload}")
    if max(block_n, block_k) > TMA_MAX_BOX:
        raise KernelInputError(f"skinny_linear: tma blocks are at most {TMA_MAX_BOX} per dim, got "
                               f"[{block_n}, {block_k}]")
    if (w.stride(0) * w.element_size()) % 16 or w.data_ptr() % 16:
        raise KernelInputError("skinny_linear: tma needs a 16-byte aligned weight with 16-byte aligned rows")


def row_stats_ref(y: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y * (1 + scale) in y's dtype, [stat_chunks(N), M] fp32 partial sums of y^2): what RowStats holds."""
    v = y.float().reshape(-1, y.shape[-1])
    pad = stat_chunks(v.shape[1]) * STAT_CHUNK - v.shape[1]
    sums = F.pad(v * v, (0, pad)).view(v.shape[0], -1, STAT_CHUNK).sum(-1).t().contiguous()
    return (y.float() * (1.0 + scale.float())).to(y.dtype), sums


def _torch_fused(x, w, b, geglu, norm):
    """The normed GEMM in torch, the same algebra as the kernel: (x * (1 + scale)) w^T * rstd + w shift."""
    rstd = torch.rsqrt(norm.sums.sum(0) / x.shape[-1] + norm.eps).view(*x.shape[:-1], 1)
    y = F.linear(x, w).float() * rstd + norm.shift_w
    if b is not None:
        y = y + b.float()
    if geglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.gelu(gate, approximate="tanh") * up
    return y.to(x.dtype)


def _cublas(x, w, b, geglu, backend, norm=None, residual=None, emit=None, rope=None):
    """The route without the skinny kernel: cuBLAS (-> GeGLU kernel), with a fused norm / residual / row stats
    done by torch ops and the gated-residual kernel around it; rope: the split/rotate kernel after it. fp32 rows
    into a bf16 / fp16 GEMM are rounded first, as the skinny kernel rounds them on load."""
    x = x.to(w.dtype)
    if norm is not None:
        y = _torch_fused(x, w, b, geglu, norm)
    else:
        y = K.geglu(F.linear(x, w), backend=backend) if geglu else F.linear(x, w, b)
    if rope is not None:
        rope.check(x, w, b, geglu, residual, emit)  # what the skinny route refuses, this one does too
        bsz, t = rope.positions.shape
        return K.qkv_rope_cache(y.reshape(bsz, t, -1), rope.positions, rope.cos, rope.sin, rope.k, rope.v, 0,
                                num_q_heads=rope.num_q_heads, num_kv_heads=rope.num_kv_heads, q_out=rope.q,
                                backend=backend)
    if residual is not None and residual.x.dtype != y.dtype:  # an fp32 stream (the flow state): torch, in fp32
        if emit is not None:
            raise KernelInputError("skinny_linear: row stats need the residual stream in the GEMM's dtype")
        y = residual.x.add_(y.to(residual.x.dtype) * residual.gate.to(residual.x.dtype))
    elif residual is not None:
        y = K.gated_residual(residual.x, y, residual.gate, out=residual.x, backend=backend)
    if emit is not None:
        scaled, sums = row_stats_ref(y, emit.scale)
        emit.scaled.copy_(scaled.view(emit.scaled.shape))
        emit.sums.copy_(sums)
    return y


@dataclass(frozen=True)
class Fusion:
    """What a GEMM call fuses besides its product (all optional): see RowNorm, GatedResidual, RowStats."""

    norm: RowNorm | None = None
    residual: GatedResidual | None = None
    emit: RowStats | None = None
    rope: QkvRope | None = None
    defer: bool = False  # the skinny GEMM may leave its split-K partials to the reader (`kernels.Partials`)

    def tags(self, dtype: torch.dtype) -> tuple:
        """Part of the tuning key: each fusion is another kernel specialization, tuned on its own (a residual
        stream in another dtype than the GEMM's `dtype`, the fp32 flow state, is one more)."""
        tags = tuple(name for name in ("norm", "residual", "emit", "rope") if getattr(self, name) is not None)
        if self.defer:
            tags += ("defer",)
        if self.residual is not None and self.residual.x.dtype != dtype:
            tags += (f"residual:{self.residual.x.dtype}",)
        return tags

    def scratch(self) -> "Fusion":
        """The same call writing into copies (tuning trials must not change the engine's buffers)."""
        r, e, q = self.residual, self.emit, self.rope
        return Fusion(self.norm, None if r is None else GatedResidual(r.x.clone(), r.gate),
                      None if e is None else RowStats(e.scale, torch.empty_like(e.scaled), torch.empty_like(e.sums)),
                      None if q is None else dataclasses.replace(q, q=torch.empty_like(q.q), k=q.k.clone(),
                                                                 v=q.v.clone()), self.defer)

    def outputs(self, y) -> list:
        """Everything the call writes, for comparing two routes."""
        if self.rope is not None:  # y is rope.q; k / v: the rows written
            t = self.rope.positions.shape[1]
            return [y, self.rope.k[:, :, :t], self.rope.v[:, :, :t]]
        return [dense(y)] + ([self.emit.scaled, self.emit.sums] if self.emit is not None else [])


NO_FUSION = Fusion()


class LinearPicker:
    """`picker(x, w, b)` = F.linear and `picker.geglu(x, w_gate_up)` = GeGLU(F.linear), each routed per shape to
    the fastest of cuBLAS and the skinny Triton GEMM configurations (timed while `tuning` is True, i.e. in
    the engine's warm-up). Both take `norm=RowNorm(...)` (x is an AdaRMS input scaled by its producer),
    `residual=GatedResidual(...)` (the result added into a residual stream in place) and `emit=RowStats(...)`
    (also write the next AdaRMS's input): fused into the skinny GEMM, or done by torch ops around cuBLAS
    when that measures faster. mode: "auto" (time on CUDA, cuBLAS elsewhere), "torch" or "triton" (always
    the first skinny configuration where M is small: for tests)."""

    def __init__(self, device, mode: str = "auto", cache=None, preload: bool = False, tma: bool = False,
                 mid: bool = False):
        """cache: an `engine_tuning.TuningCache` whose choices are used (after one check against cuBLAS)
        instead of timing the candidates again; new choices are put into it. preload: also offer the
        candidates that request weight tiles before the PDL wait in their K loop (off: their choices are
        cached apart from the full candidate set's, so an A/B engine never reads the other's). tma: also offer
        the candidates that read their weight tiles through TMA descriptors (TMA_CONFIGS; cached apart too).
        mid: GEMMs of SKINNY_MAX_M < M <= MID_MAX_M rows are tuned too, against MID_CONFIGS (else cuBLAS)."""
        if mode not in ("auto", "torch", "triton"):
            raise ValueError(f"gemm: one of auto, torch, triton; got {mode!r}")
        self.device, self.mode, self.tuning, self.cache = torch.device(device), mode, False, cache
        pool = CONFIGS + (TMA_CONFIGS if tma else [])
        self.candidates = [c for c in pool if preload or len(c) < 6 or not c[5]]
        self.cache_name = ("linear_preload" if preload else "linear") + ("_tma" if tma else "")
        self.mid = bool(mid)
        self.choices: dict[tuple, object] = {}  # shape key -> None (cuBLAS) or a CONFIGS entry
        self.timings: dict[tuple, dict] = {}  # shape key -> {candidate: ms}, for benchmark reports

    def __call__(self, x, w, b=None, *, norm=None, residual=None, emit=None, defer=False, backend=None):
        """defer: a skinny GEMM may return its split-K partials unreduced (`kernels.Partials`, for
        `kernels.gated_residual_ada_rms_norm` to add up; cuBLAS returns the product): a plain product only."""
        fusion = Fusion(norm, residual, emit, defer=bool(defer))
        if defer:  # (checked here too: the cuBLAS route would ignore defer)
            _check_defer("LinearPicker", b, False, fusion)
        return self._run(x, w, b, False, backend, fusion)

    def geglu(self, x, w_gate_up, *, norm=None, backend=None):
        return self._run(x, w_gate_up, None, True, backend, Fusion(norm))

    def qkv_rope(self, x, w_qkv, rope: QkvRope, *, norm=None, backend=None):
        """The fused QKV projection with its split / RoPE / K/V write (QkvRope), returning q: in the skinny
        GEMM's epilogue, or cuBLAS and the split/rotate kernel, whichever measures faster."""
        return self._run(x, w_qkv, None, False, backend, Fusion(norm, rope=rope))

    def _run(self, x, w, b, geglu, backend, fusion=NO_FUSION):
        m = x.numel() // x.shape[-1]
        limit = MID_MAX_M if self.mid and not geglu and not fusion.tags(w.dtype) else SKINNY_MAX_M
        skinny = m <= limit and triton is not None and K.available(x.device)
        if self.mode == "torch" or not skinny or backend == "torch":
            return _route(None, x, w, b, geglu, backend, fusion)
        if self.mode == "triton":
            return _route(CONFIGS[0] if m <= SKINNY_MAX_M else MID_CONFIGS[0], x, w, b, geglu, backend, fusion)
        key = (m, tuple(w.shape), b is not None, geglu, x.dtype, *fusion.tags(w.dtype))
        if key not in self.choices:
            if not (self.tuning and x.device.type == "cuda"):
                return _route(None, x, w, b, geglu, backend, fusion)
            self.choices[key] = self._cached(key, x, w, b, geglu, backend, fusion)
        return _route(self.choices[key], x, w, b, geglu, backend, fusion)

    def candidates_for(self, fusion=NO_FUSION, kdim: int | None = None, m: int = 1) -> list:
        """The configurations tried for a call (of inner dimension `kdim`). A deferred reduction (fusion.defer)
        keeps those of at most DEFER_MAX_SPLITS splits: its reader loads every partial of each row, and that
        read is not part of the GEMM's timing. The QKV + RoPE epilogue (fusion.rope) pairs each output
        column with its rotate-half partner, so its BLOCK_N counts pairs and a program reads 2 x BLOCK_N weight
        rows: it also gets every candidate at half the BLOCK_N (16 at least), the fused form of each plain
        tiling (the plain QKV's usual pick, (32, 128, 1, 4, 4, 2), has (16, 128, 1, 4, 4, 2) as its twin).
        Past SKINNY_MAX_M rows (`mid`, plain products only) the candidates are MID_CONFIGS."""
        if m > SKINNY_MAX_M:
            return list(MID_CONFIGS)
        if fusion.defer and kdim is not None:
            return [c for c in self.candidates if splits(c, kdim) <= DEFER_MAX_SPLITS]
        if fusion.rope is None:
            return list(self.candidates)
        plain = [c for c in self.candidates if len(c) < 7 or not c[6]]  # (TMA reads no gathered rows)
        halved = [(c[0] // 2, *c[1:]) for c in plain if c[0] >= 32]
        return list(dict.fromkeys([*plain, *halved]))

    def _cached(self, key, x, w, b, geglu, backend, fusion=NO_FUSION):
        """The cache's choice for this shape if it still computes the same as cuBLAS, else a new tuning."""
        def check(config):
            return _same(_outputs(config, x, w, b, geglu, backend, fusion),
                         _outputs(None, x, w, b, geglu, backend, fusion))
        return reuse_or_tune(self.cache, self.cache_name, key, self.candidates_for(fusion, x.shape[-1], key[0]), check,
                             lambda: self._tune(key, x, w, b, geglu, backend, fusion), self.timings, x.device)

    def _tune(self, key, x, w, b, geglu, backend, fusion=NO_FUSION):
        """Time each candidate and return the fastest. Runs during warm-up (outside capture). Each candidate
        is timed the way a decision runs it: captured in a CUDA graph (no host launch cost, which would
        otherwise favour cuBLAS's cheaper launches), with the weight cycled through enough copies to
        overflow L2 (a decision streams every weight from HBM once per flow step). Fused outputs (residual
        stream, row stats) are never touched here: every trial writes into copies."""
        candidates = {"cublas": None}
        for c in self.candidates_for(fusion, x.shape[-1], key[0]):
            candidates[str(c)] = c
        trial = fusion.scratch()
        # every candidate's kernels compiled in parallel first (compiling is most of a tuning's time)
        precompile([lambda c=config: _route(c, x, w, b, geglu, backend, trial)
                    for config in candidates.values() if config is not None])
        copies = max(2, min(32, -(-ROTATE_BYTES // (w.numel() * w.element_size()))))
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
        return _cublas(x, w, b, geglu, backend, fusion.norm, fusion.residual, fusion.emit, fusion.rope)
    return skinny_linear(x, w, b, geglu=geglu, norm=fusion.norm, residual=fusion.residual, emit=fusion.emit,
                         rope=fusion.rope, defer=fusion.defer, **_kwargs(config))


def _outputs(config, x, w, b, geglu, backend, fusion) -> list:
    """Everything route `config` writes for this call, written into copies (never the engine's buffers)."""
    scratch = fusion.scratch()
    return scratch.outputs(_route(config, x, w, b, geglu, backend, scratch))


def _same(got: list, want: list) -> bool:
    return all(agrees(g, t, MATCH_REL) for g, t in zip(got, want))


def split_layout(kdim: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(K per split, number of splits) of `skinny_linear` at inner dimension kdim: split_k splits asked for
    (0: one per BLOCK_K slice), each covering a whole number of BLOCK_K steps, so no K element is summed twice
    (a ragged K may give fewer splits than asked)."""
    def cdiv(a, b):
        return -(-a // b)
    wanted = cdiv(kdim, block_k) if split_k == 0 else split_k
    k_per_split = cdiv(cdiv(kdim, wanted), block_k) * block_k
    return k_per_split, cdiv(kdim, k_per_split)


def splits(config, kdim: int) -> int:
    """How many K splits (programs per output tile) a CONFIGS entry gives at inner dimension kdim."""
    return split_layout(kdim, config[1], config[2])[1]


def _kwargs(config):
    bn, bk, split, warps, stages, *rest = config
    return {"block_n": bn, "block_k": bk, "split_k": split, "num_warps": warps, "num_stages": stages,
            "preload": rest[0] if rest else 0, "tma": bool(rest[1]) if len(rest) > 1 else False,
            "block_m": rest[2] if len(rest) > 2 else None}
