"""The skinny GEMM: Y = X W^T for few rows (the action expert's 50 tokens) against large weights.

The action expert multiplies 50 tokens by 0.6 GB of weights per flow step: memory-bound GEMMs with M = 50,
where cuBLAS reaches only 0.7-1.4 TB/s (docs/gpu-machine.md). This kernel tiles only N and (optionally) K,
keeps the whole M in one tile, and streams weight tiles through a deep software pipeline; with PDL it
requests its first weight tiles before waiting for the kernel before it (weights never depend on it).
Besides the plain product it can
  * apply SiLU to it (silu=True: pi0's action-time MLP);
  * multiply the gate and up halves of a merged [gate; up] weight side by side and write
    gelu_tanh(gate) * up directly (geglu=True: the GeGLU kernel and its intermediate disappear);
  * add its result into a residual stream in place (`GatedResidual`; the flow step's Euler update into the
    fp32 state);
  * leave its split-K partials unreduced for the kernel that reads the result (defer=True, `Partials`).
`flashrt_core.engine.gemm.LinearPicker` chooses between cuBLAS and this kernel's launch configurations per shape.
Importable without Triton (CPU-only installs): `skinny_linear` then raises KernelUnavailableError.
Reference: `F.linear` (and `kernels.geglu` / `kernels.gated_residual` after it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt_core.kernels._common import (KernelInputError, KernelUnavailableError, interpreting, launch, pdl_launch,
                                         semaphores)
from flashrt_core.kernels.partials import Partials
from flashrt_core.kernels.mx4 import BLOCK as MX4_BLOCK, K_TILE as MX4_K_TILE, MX4Weight
from flashrt_core.kernels.w4 import W4Weight

SKINNY_MAX_M = 128  # rows per program at most (the picker offers this kernel up to this many rows)

try:  # Triton is optional on CPU-only installs; the picker then never offers this kernel
    import triton
    import triton.language as tl

    from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait
    from flashrt_core.kernels._tickets import last_of_split, reset_ticket
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _gelu_tanh(g):
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 sqrt(2/pi) (g + 0.044715 g^3)
        e = tl.exp(-tl.abs(z))
        return g * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    @triton.jit
    def _w4_bf16(p, scale):
        """Packed 4-bit bytes p (uint8) and each byte's bf16 scale (same shape) -> (low, high nibble) weights in
        bf16, (q - 8) * scale rounded once, as `W4Weight.dequantize`. Four bytes per PTX call: each byte pair is
        spread into two 16-bit lanes (prmt), a nibble or'd into the bits of bf16 128.0 gives 128 + n exactly
        (lop3), and two bf16x2 FMAs (sm_80+) take off 136 (exact) and multiply by the scale (one rounding)."""
        return tl.inline_asm_elementwise(
            """
            {
            .reg .b32 t<4>, one, off, nz;
            mov.b32 one, 0x3f803f80;
            mov.b32 off, 0xc308c308;
            mov.b32 nz, 0x80008000;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            shr.u32 t2, t0, 4;
            shr.u32 t3, t1, 4;
            lop3.b32 t0, t0, 0x000f000f, 0x43004300, 0xea;
            lop3.b32 t1, t1, 0x000f000f, 0x43004300, 0xea;
            lop3.b32 t2, t2, 0x000f000f, 0x43004300, 0xea;
            lop3.b32 t3, t3, 0x000f000f, 0x43004300, 0xea;
            fma.rn.bf16x2 t0, t0, one, off;
            fma.rn.bf16x2 t1, t1, one, off;
            fma.rn.bf16x2 t2, t2, one, off;
            fma.rn.bf16x2 t3, t3, one, off;
            fma.rn.bf16x2 $0, t0, $5, nz;
            fma.rn.bf16x2 $1, t1, $6, nz;
            fma.rn.bf16x2 $2, t2, $5, nz;
            fma.rn.bf16x2 $3, t3, $6, nz;
            }
            """,
            "=r,=r,=r,=r,r,r,r", [p, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)

    @triton.jit
    def _w4_tile(W, S, rn, k0, k_end, n_ok, K, swn, sgn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, UPCAST: tl.constexpr):
        """The 4-bit weight's rows rn over inputs k0:k0 + BLOCK_K (`kernels.w4`: byte j of a row holds inputs
        2j and 2j + 1 in its low and high nibble; scales S [K / GROUP, sgn], group-major), dequantized as
        `W4Weight.dequantize` does (q * scale rounded to the scales' dtype): (even, odd) inputs, each
        [BLOCK_K / 2, BLOCK_N] = W^T. Inputs at or past k_end (the split's end) or K are zeros. Depends on the
        weights only, so a program can do this before its PDL wait. UPCAST (the CPU interpreter): the rounded
        values as fp32."""
        DT = S.dtype.element_ty
        NG: tl.constexpr = BLOCK_K // GROUP
        jb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        j_ok = (jb < K // 2) & (jb < k_end // 2)
        p = tl.load(W + rn[None, :].to(tl.int64) * swn + jb[:, None], mask=n_ok[None, :] & j_ok[:, None],
                    other=136)  # (136: two zeros)
        # (a group past K, in a tile that overhangs it, multiplies zeros: its scale row is clamped)
        g = tl.minimum(k0 // GROUP + tl.arange(0, NG), K // GROUP - 1)
        scale = tl.load(S + g[:, None] * sgn + rn[None, :], mask=n_ok[None, :], other=0.0)[:, None, :]
        if DT == tl.bfloat16 and not UPCAST:  # (bytes and scales in, both halves out: `_w4_bf16`)
            scale = tl.reshape(tl.broadcast_to(scale, [NG, GROUP // 2, BLOCK_N]), [BLOCK_K // 2, BLOCK_N])
            lo, hi = _w4_bf16(p, scale)
        else:
            if UPCAST:  # (the interpreter: fp32 products, rounded to the scales' dtype, as fp32)
                scale = scale.to(tl.float32)
                lo = ((p.to(tl.int32) & 15) - 8).to(tl.float32)
                hi = ((p.to(tl.int32) >> 4) - 8).to(tl.float32)
            else:
                lo = ((p.to(tl.int32) & 15) - 8).to(DT)
                hi = ((p.to(tl.int32) >> 4) - 8).to(DT)
            # (q * scale: one rounding of an exact product, the same as W4Weight.dequantize's)
            lo = tl.reshape(tl.reshape(lo, [NG, GROUP // 2, BLOCK_N]) * scale, [BLOCK_K // 2, BLOCK_N]).to(DT)
            hi = tl.reshape(tl.reshape(hi, [NG, GROUP // 2, BLOCK_N]) * scale, [BLOCK_K // 2, BLOCK_N]).to(DT)
        if UPCAST:
            lo, hi = lo.to(tl.float32), hi.to(tl.float32)
        return lo, hi

    @triton.jit
    def _w4_mul(acc, x, lo, hi, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """acc + x [BLOCK_M, BLOCK_K] (the compute dtype, fp32 under UPCAST) times a dequantized 4-bit tile
        (`_w4_tile`): the even inputs times `lo`, the odd ones times `hi` (x is split in registers)."""
        xe, xo = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
        acc = tl.dot(xe, lo, acc, input_precision=PRECISION)
        return tl.dot(xo, hi, acc, input_precision=PRECISION)

    @triton.jit
    def _mx4_dot(acc, X, W, S, rm, rn, k0, m_ok, n_ok, K, sxm, swn, sgn, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        """acc + X[rm, k0:k0 + BLOCK_K] times an MXFP4 weight's rows rn there (`kernels.mx4`: e2m1 pairs along K,
        e8m0 scales [N, K / 32]) through Triton's scaled dot, X in MX e4m3 (each row's 32-input block scaled by a
        power of two to at most 448, `kernels.mx4.mx_rows_ref`): both operands block-scaled, which Blackwell's
        tensor cores multiply natively (W4A8). UPCAST (the CPU interpreter, whose fp32 -> e4m3 conversion loses a
        rounding's carry): X's e4m3 values rounded by arithmetic and passed as bf16 (exact)."""
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :],
                    other=0.0).to(tl.float32)
        xb = tl.reshape(x, [BLOCK_M, BLOCK_K // 32, 32])
        e = tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(xb), axis=2), 1e-30) / 448.0))
        e = tl.minimum(tl.maximum(e, -127.0), 127.0)
        v = xb / tl.exp2(e)[:, :, None]
        jb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p = tl.load(W + rn[None, :].to(tl.int64) * swn + jb[:, None], mask=n_ok[None, :] & (jb < K // 2)[:, None],
                    other=0)
        sb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(S + rn[:, None] * sgn + sb[None, :], mask=n_ok[:, None] & (sb < K // 32)[None, :], other=127)
        if UPCAST:
            a = tl.abs(v)
            step = tl.exp2(tl.floor(tl.log2(tl.maximum(a, 0.015625))) - 3.0)  # 3 mantissa bits; 2^-9 below 2^-6
            t = a / step  # (exact: a power of two) -> the nearest integer, ties to even as the GPU's conversion
            r = tl.floor(t + 0.5)
            r = tl.where((r - t == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)
            q = tl.minimum(r * step, 448.0)
            xd = tl.reshape(tl.where(v < 0, -q, q) * tl.exp2(e)[:, :, None], [BLOCK_M, BLOCK_K])
            return tl.dot_scaled(xd.to(tl.bfloat16), None, "bf16", p, s, "e2m1", acc)
        xq = tl.reshape(v, [BLOCK_M, BLOCK_K]).to(tl.float8e4nv)
        return tl.dot_scaled(xq, (e + 127.0).to(tl.uint8), "e4m3", p, s, "e2m1", acc)

    @triton.jit
    def _skinny_gemm_kernel(X, W, B, Y, P, C, G, S, M, N, K, k_per_split, sxm, swn, sgn, sym, sps, up_off, s_up_off,
                            W4: tl.constexpr, MX4: tl.constexpr, GROUP: tl.constexpr,
                            CDT: tl.constexpr,
                            HAS_BIAS: tl.constexpr, GEGLU: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr,
                            ONE_STEP: tl.constexpr, RESID: tl.constexpr, UPCAST: tl.constexpr,
                            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, DEFER: tl.constexpr, PDL: tl.constexpr):
        """Y[M, N] = X[M, K] @ W[N, K]^T (+ bias), X converted to the compute dtype CDT on load (an fp32 X into a
        bf16 GEMM is rounded, a bf16 X into an fp32 GEMM widened);
        GEGLU: Y = gelu(X Wg^T) * (X Wu^T) with Wu the weight rows up_off elements further.
        SPLIT > 1: split-K; each program stores its fp32 partial(s) in P and the last of a tile's SPLIT programs
        to finish (ticket C[tile]) adds them up in split order and writes Y.
        DEFER (any SPLIT, plain product only): each program stores its fp32 partial in P [SPLIT, M, N] and
        stops there; the kernel that reads the result adds them up (`kernels.Partials`). No ticket, no Y.
        PRE_K > 0: the first PRE_K weight columns of the program's K range are loaded as one tile before
        waiting for the previous kernel (PDL), so the weight stream overlaps that kernel's tail; the K loop
        covers the rest. ONE_STEP (each program covers exactly one BLOCK_K slice, PRE_K = BLOCK_K): no loop.
        RESID: Y holds the residual stream and is updated in place, Y += G[n] * result.
        W4: W holds 4-bit weights, 2 per byte [N, K / 2], with scales S [K / GROUP, N] (`kernels.w4`); BLOCK_K a
        multiple of GROUP; each tile dequantized in registers (`_w4_tile`: before the PDL wait for the PRE_K
        tile), then multiplied as the bf16 weights are (`_w4_mul`).
        MX4: W holds MXFP4 weights [N, K / 2] with e8m0 scales S [N, K / 32] (`kernels.mx4`, `_mx4_dot`): every
        K tile after the PDL wait, X in MX e4m3 (W4A8)."""
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
        k_end = k_lo + k_per_split
        if MX4:
            pdl_wait(PDL)
            for k0 in range(k_lo, k_end, BLOCK_K):
                acc = _mx4_dot(acc, X, W, S, rm, rn, k0, m_ok, n_ok, K, sxm, swn, sgn, BLOCK_M, BLOCK_K, UPCAST)
                if GEGLU:
                    acc_up = _mx4_dot(acc_up, X, W + up_off, S + s_up_off, rm, rn, k0, m_ok, n_ok, K, sxm, swn, sgn,
                                      BLOCK_M, BLOCK_K, UPCAST)
        elif PRE_K > 0:  # weights never depend on the previous kernel: request them before waiting for it
            kp = k_lo + tl.arange(0, PRE_K)
            kp_ok = (kp < K) & (kp < k_end)
            if W4:  # (dequantized before the wait too)
                wp, wo = _w4_tile(W, S, rn, k_lo, k_end, n_ok, K, swn, sgn, BLOCK_N, PRE_K, GROUP, UPCAST)
                wpu, wou = wp, wo
                if GEGLU:
                    wpu, wou = _w4_tile(W + up_off, S + s_up_off, rn, k_lo, k_end, n_ok, K, swn, sgn, BLOCK_N, PRE_K,
                                        GROUP, UPCAST)
            else:
                wp_ptr = W + rn[None, :].to(tl.int64) * swn + kp[:, None]
                wp = tl.load(wp_ptr, mask=n_ok[None, :] & kp_ok[:, None], other=0.0)
                wpu = wp
                if GEGLU:
                    wpu = tl.load(wp_ptr + up_off, mask=n_ok[None, :] & kp_ok[:, None], other=0.0)
                if UPCAST:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: compute in fp32 there
                    wp = wp.to(tl.float32)
                    wpu = wpu.to(tl.float32)
            pdl_wait(PDL)
            xp = tl.load(X + rm[:, None] * sxm + kp[None, :], mask=m_ok[:, None] & kp_ok[None, :],
                         other=0.0).to(CDT)
            if UPCAST:
                xp = xp.to(tl.float32)
            if W4:
                acc = _w4_mul(acc, xp, wp, wo, BLOCK_M, PRE_K, PRECISION)
                if GEGLU:
                    acc_up = _w4_mul(acc_up, xp, wpu, wou, BLOCK_M, PRE_K, PRECISION)
            else:
                acc += tl.dot(xp, wp, input_precision=PRECISION)
                if GEGLU:
                    acc_up += tl.dot(xp, wpu, input_precision=PRECISION)
        else:
            pdl_wait(PDL)
        if not MX4 and not ONE_STEP:  # (one step: PRE_K = BLOCK_K = the whole split, loaded above)
            for k0 in range(k_lo + PRE_K, k_end, BLOCK_K):
                kk = k0 + rk
                k_ok = kk < K
                x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0).to(CDT)
                if UPCAST:
                    x = x.to(tl.float32)
                if W4:
                    wl, wh = _w4_tile(W, S, rn, k0, k_end, n_ok, K, swn, sgn, BLOCK_N, BLOCK_K, GROUP, UPCAST)
                    acc = _w4_mul(acc, x, wl, wh, BLOCK_M, BLOCK_K, PRECISION)
                    if GEGLU:
                        wl, wh = _w4_tile(W + up_off, S + s_up_off, rn, k0, k_end, n_ok, K, swn, sgn, BLOCK_N,
                                          BLOCK_K, GROUP, UPCAST)
                        acc_up = _w4_mul(acc_up, x, wl, wh, BLOCK_M, BLOCK_K, PRECISION)
                else:
                    w_ptr = W + rn[None, :].to(tl.int64) * swn + kk[:, None]
                    w = tl.load(w_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] = W^T
                    if UPCAST:
                        w = w.to(tl.float32)
                    acc += tl.dot(x, w, input_precision=PRECISION)
                    if GEGLU:
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
            if GEGLU:  # the second accumulator's partials follow the first's
                tl.store(part + (SPLIT + pid_k) * sps, acc_up, mask=out_mask)
            tile = pid_m * tl.num_programs(0) + pid_n
            last = last_of_split(C, tile, SPLIT)
            if last:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # fixed order: the result does not depend on who finished last
                    acc += tl.load(part + s * sps, mask=out_mask, other=0.0, cache_modifier=".cg")
                    if GEGLU:
                        acc_up += tl.load(part + (SPLIT + s) * sps, mask=out_mask, other=0.0, cache_modifier=".cg")
                reset_ticket(C, tile)
        if last:
            if HAS_BIAS:
                acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GEGLU:
                acc = _gelu_tanh(acc) * acc_up
            if SILU:  # of the product as stored (rounded to the compute dtype), as F.silu after the GEMM
                acc = acc.to(CDT).to(tl.float32)
                acc = acc / (1.0 + tl.exp(-acc))
            y_ptr = Y + rm[:, None] * sym + rn[None, :]
            if RESID:
                if Y.dtype.element_ty != CDT:  # a wider stream (fp32 flow state): the result is rounded as an
                    acc = acc.to(CDT).to(tl.float32)  # unfused GEMM stores it
                acc = tl.load(y_ptr, mask=out_mask, other=0.0).to(tl.float32) + \
                    acc * tl.load(G + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class GatedResidual:
    """A GEMM whose result goes into the residual stream: x += gate * result, in place (x is returned). x may
    also be fp32 under a bf16 / fp16 GEMM (the flow-matching state: x_t += dt * velocity, with the velocity
    rounded to the GEMM's dtype first, as the unfused GEMM would have stored it)."""

    x: torch.Tensor  # [..., N] contiguous, the GEMM's (weight's) dtype or fp32
    gate: torch.Tensor  # [N]


def split_layout(kdim: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(K per split, number of splits) of `skinny_linear` at inner dimension kdim: split_k splits asked for
    (0: one per BLOCK_K slice), each covering a whole number of BLOCK_K steps, so no K element is summed twice
    (a ragged K may give fewer splits than asked)."""
    def cdiv(a, b):
        return -(-a // b)
    wanted = cdiv(kdim, block_k) if split_k == 0 else split_k
    k_per_split = cdiv(cdiv(kdim, wanted), block_k) * block_k
    return k_per_split, cdiv(kdim, k_per_split)


def _check_residual(x, n, residual: GatedResidual, dtype) -> None:
    """The residual stream [..., n] (the GEMM's dtype, or fp32) and its gate [n], on x's device."""
    shape, dev = (*x.shape[:-1], n), x.device
    want = torch.float32 if residual.x.dtype == torch.float32 else dtype
    r, g = residual.x, residual.gate
    if tuple(r.shape) != shape or r.dtype != want or not r.is_contiguous() or r.device != dev:
        raise KernelInputError(f"skinny_linear: the residual must be a contiguous {want} tensor of shape {shape} "
                               f"on {dev}, got {tuple(r.shape)} {r.dtype}")
    if tuple(g.shape) != (n,) or g.device != dev or g.stride(-1) != 1:
        raise KernelInputError(f"skinny_linear: the residual gate must be a unit-stride [{n}] vector on {dev}, "
                               f"got {tuple(g.shape)}")


def skinny_linear(x, w, b=None, *, geglu=False, block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=4,
                  preload=0, residual: GatedResidual | None = None, defer: bool = False, silu: bool = False):
    """F.linear(x, w, b) for x [..., K] with few rows, w [N, K] contiguous. geglu=True: w is [2F, K] = [gate; up]
    and the result is gelu_tanh(x gate^T) * (x up^T) [..., F] (no bias). split_k=0: one BLOCK_K slice per
    program (K / BLOCK_K splits), whose weight tile is loaded before the PDL wait. preload (0 or a power of
    two; split_k >= 1): each program loads its first `preload` BLOCK_K weight tiles before the PDL wait.
    residual: the result is added into it (and it is returned). defer: return the split-K partial products
    unreduced (`kernels.Partials`, for a reader that adds them up: `kernels.gated_residual_ada_rms_norm`,
    `kernels.qkv_rope_cache`); a plain product only (no bias, GeGLU or residual). Rows past SKINNY_MAX_M
    are spread over programs of SKINNY_MAX_M rows. silu: the result is silu(x w^T + b) (F.silu of the stored
    product; not with GeGLU, a residual or defer). w may be a `kernels.w4.W4Weight` (4-bit weights, computed in
    its scales' dtype) or a `kernels.mx4.MX4Weight` (MXFP4 through Triton's scaled dot, activations in MX e4m3:
    W4A8)."""
    if triton is None:
        raise KernelUnavailableError("skinny_linear: Triton is not installed")
    if split_k < 0:
        raise KernelInputError(f"skinny_linear: split_k must be >= 0, got {split_k}")
    if preload < 0 or preload & (preload - 1):
        raise KernelInputError(f"skinny_linear: preload must be 0 or a power of two, got {preload}")
    kdim = x.shape[-1]
    x2 = x.reshape(-1, kdim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    quant = isinstance(w, W4Weight)
    mx4 = isinstance(w, MX4Weight)
    wt = w.packed if quant or mx4 else w  # what the kernel reads as W
    scales = w.scales if quant or mx4 else wt
    if mx4 and (w.shape[1] % MX4_BLOCK or block_k % MX4_K_TILE or tuple(w.scales.shape) != (
            w.shape[0], w.shape[1] // MX4_BLOCK) or not w.scales.is_contiguous()):
        raise KernelInputError(f"skinny_linear: an MXFP4 weight [{w.shape[0]}, {w.shape[1]}] needs K and block_k "
                               f"multiples of {MX4_BLOCK} and {MX4_K_TILE} and contiguous scales "
                               f"[{w.shape[0]}, {w.shape[1] // MX4_BLOCK}], got block_k {block_k}, scales "
                               f"{tuple(w.scales.shape)}")
    if quant and (tuple(w.scales.shape) != (w.shape[1] // w.group, w.shape[0]) or not w.scales.is_contiguous()
                  or w.shape[1] % w.group):
        raise KernelInputError(f"skinny_linear: a 4-bit weight [{w.shape[0]}, {w.shape[1]}] in groups of {w.group} "
                               f"needs contiguous scales [{w.shape[1] // w.group}, {w.shape[0]}], got "
                               f"{tuple(w.scales.shape)}")
    if quant and block_k % w.group:
        raise KernelInputError(f"skinny_linear: block_k {block_k} must be a multiple of the 4-bit group {w.group}")
    if not wt.is_contiguous() or w.shape[1] != kdim:
        raise KernelInputError(f"skinny_linear: `w` must be contiguous [N, {kdim}], got {tuple(w.shape)}")
    m = x2.shape[0]
    n = w.shape[0] // 2 if geglu else w.shape[0]
    half = (torch.bfloat16, torch.float16)
    if x.dtype != w.dtype and not (x.dtype == torch.float32 and w.dtype in half) and not (
            x.dtype in half and w.dtype == torch.float32):
        raise KernelInputError(f"skinny_linear: `x` {x.dtype} with a {w.dtype} weight (only fp32 rows into a "
                               "bf16 / fp16 GEMM, rounded on load, or bf16 / fp16 rows into an fp32 GEMM, widened "
                               "on load)")
    if residual is not None:
        _check_residual(x, n, residual, w.dtype)
    if silu and (geglu or residual is not None or defer):
        raise KernelInputError("skinny_linear: silu= is an epilogue of a plain product (+ bias) only")
    if defer and (b is not None or geglu or residual is not None):
        raise KernelInputError("skinny_linear: defer= leaves a plain product's partials (no bias, geglu or "
                               "residual)")
    if defer:
        y = wt  # (never written)
    else:
        y = residual.x if residual is not None else torch.empty(m, n, device=x.device, dtype=w.dtype)
    interp = interpreting()
    # (MXFP4: 128-row tiles, the M of Blackwell's block-scaled MMA; a smaller tile is widened to bf16 instead)
    block_m = SKINNY_MAX_M if mx4 else max(16, triton.next_power_of_2(min(m, SKINNY_MAX_M)))
    k_per_split, split = split_layout(kdim, block_k, split_k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    one_step = k_per_split == block_k
    pre_k = block_k if one_step else min(preload * block_k, triton.next_power_of_2(k_per_split))
    if defer:
        part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        tickets = part
    elif split > 1:
        part = torch.empty((2 if geglu else 1) * split, m, n, device=x.device, dtype=torch.float32)
        tickets = semaphores(grid[0] * grid[1], x.device)
    else:
        part = tickets = y
    launch(_skinny_gemm_kernel, grid,
        x2, wt, b if b is not None else wt, y, part, tickets, residual.gate if residual is not None else wt, scales,
        m, n, kdim, k_per_split, x2.stride(0), wt.stride(0), scales.stride(0), n, m * n, n * wt.stride(0),
        n * scales.stride(0) if mx4 else n if quant else 0, W4=quant, MX4=mx4,
        GROUP=w.group if quant else 1, CDT=_TL_DTYPES[w.dtype],
        HAS_BIAS=b is not None, GEGLU=geglu, SILU=bool(silu), SPLIT=split,
        ONE_STEP=one_step, RESID=residual is not None,
        UPCAST=interp and (w.dtype != torch.float32 or mx4),
        PRECISION="ieee" if w.dtype == torch.float32 or interp else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRE_K=pre_k, DEFER=bool(defer), num_warps=num_warps,
        num_stages=1 if interp else num_stages, **pdl_launch(x.device))
    if defer:
        return Partials(part, w.dtype, (*x.shape[:-1], n))
    return y if residual is not None else y.view(*x.shape[:-1], n)
