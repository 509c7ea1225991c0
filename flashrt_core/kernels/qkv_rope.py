"""QKV split + RoPE + K/V cache write, straight from the fused QKV GEMM output.

qkv [B, T, (Hq + 2 Hkv) * Dh] holds, per token, the q heads, then the k heads, then the v heads (the
concatenated q_proj | k_proj | v_proj weights). One program handles one (token, head) pair: q heads are
rotated into q_out [B, T, Hq, Dh] (the layout the attention kernel and o_proj read without transposes),
k heads are rotated and v heads copied into caches [B, Hkv, S, Dh] at row cache_offset + t.

RoPE uses the rotate-half convention of HF Gemma with cos/sin gathered from fp32 tables (`rope_cos_sin`),
because an in-kernel sin/cos of angles up to ~1000 rad would be less accurate than torch's.
Positions (and per-batch offsets) are device tensors, so they are not checked on the host (that would be a
sync): a position outside the tables leaves its row unrotated, and a cache row outside [0, S) is not written,
so a bad value can give wrong numbers but never touches memory outside the buffers.
qkv may also be `Partials`, the unreduced result of a split-K QKV GEMM (`skinny_gemm.skinny_linear(defer=True)`):
each value's partials are summed in split order in fp32 and rounded to the result's dtype on load, the value
the GEMM's in-kernel reduction would have stored.
Reference: `reference.qkv_rope_cache_ref`.
"""
import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import INT_DTYPES, KernelInputError, check, check_out, next_pow2, pdl_launch
from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait
from flashrt_core.kernels.partials import Partials


@triton.jit(do_not_specialize=["offset"])  # one compiled kernel for every offset
def _qkv_rope_cache_kernel(QKV_ptr, POS_ptr, COS_ptr, SIN_ptr, OFF_ptr, Q_ptr, K_ptr, V_ptr,
                           T, n_positions, offset,
                           q_sb, q_st, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, S, part_stride,
                           HQ: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, OFFSET_TENSOR: tl.constexpr,
                           BLOCK_HALF: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, PARTS: tl.constexpr):
    """EARLY: positions and the cos / sin tables are written by no kernel of this PDL chain, so every program
    reads its token's position and table rows before waiting for the previous kernel.
    PARTS > 0: QKV holds PARTS fp32 partials of qkv, part_stride elements apart, summed in order and rounded
    to Q's dtype (the result's: checked on the host)."""
    pdl_trigger(PDL)
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    head = tl.program_id(1)
    b = token // T
    t = token % T
    half = DH // 2  # constexpr arithmetic stays constexpr
    i = tl.arange(0, BLOCK_HALF)
    mask = i < half
    if EARLY:  # (the v heads' programs read them too, unused: one branch-free load pattern)
        pos_e = tl.load(POS_ptr + token).to(tl.int64) + tl.zeros([BLOCK_HALF], dtype=tl.int64)
        pos_ok_e = mask & (pos_e >= 0) & (pos_e < n_positions)  # out-of-table positions do not rotate
        c_e = tl.load(COS_ptr + pos_e * half + i, mask=pos_ok_e, other=1.0)
        s_e = tl.load(SIN_ptr + pos_e * half + i, mask=pos_ok_e, other=0.0)
    pdl_wait(PDL)
    src = QKV_ptr + token * ((HQ + 2 * HKV) * DH) + head * DH
    if PARTS > 0:
        x1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        x2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        for p in tl.static_range(PARTS):  # fixed order, from zero: as the GEMM's own reduction adds them
            x1 += tl.load(src + p * part_stride + i, mask=mask, other=0.0)
            x2 += tl.load(src + p * part_stride + half + i, mask=mask, other=0.0)
        x1 = x1.to(Q_ptr.dtype.element_ty).to(tl.float32)
        x2 = x2.to(Q_ptr.dtype.element_ty).to(tl.float32)
    else:
        x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + i, mask=mask, other=0.0).to(tl.float32)
    if OFFSET_TENSOR:
        row = tl.load(OFF_ptr + b).to(tl.int64) + t
    else:
        row = offset + t
    row_v = row + tl.zeros([BLOCK_HALF], dtype=tl.int64)  # masks are built from vectors, not scalars
    ok = mask & (row_v >= 0) & (row_v < S)
    if head < HQ + HKV:
        if EARLY:
            c = c_e
            s = s_e
        else:
            pos = tl.load(POS_ptr + token).to(tl.int64)
            pos_v = pos + tl.zeros([BLOCK_HALF], dtype=tl.int64)
            pos_ok = mask & (pos_v >= 0) & (pos_v < n_positions)  # out-of-table positions do not rotate
            c = tl.load(COS_ptr + pos_v * half + i, mask=pos_ok, other=1.0)
            s = tl.load(SIN_ptr + pos_v * half + i, mask=pos_ok, other=0.0)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        if head < HQ:
            dst = Q_ptr + b * q_sb + t * q_st + head * q_sh
            tl.store(dst + i, y1.to(Q_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + half + i, y2.to(Q_ptr.dtype.element_ty), mask=mask)
        else:
            dst = K_ptr + b * k_sb + (head - HQ) * k_sh + row * k_ss
            tl.store(dst + i, y1.to(K_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + half + i, y2.to(K_ptr.dtype.element_ty), mask=ok)
    else:
        dst = V_ptr + b * v_sb + (head - HQ - HKV) * v_sh + row * v_ss
        tl.store(dst + i, x1.to(V_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + half + i, x2.to(V_ptr.dtype.element_ty), mask=ok)


def qkv_rope_cache(qkv, positions, cos, sin, k_cache, v_cache, cache_offset, *, num_q_heads, num_kv_heads,
                   q_out=None, constant_positions=False):
    """Split fused qkv [B, T, (Hq + 2 Hkv) * Dh], rotate q and k by `positions` [B, T] (int), write k / v
    into k_cache / v_cache [B, Hkv, S, Dh] (any strides, unit last stride) at rows cache_offset + t, where
    cache_offset is an int or an int tensor [B]. Returns q [B, T, Hq, Dh] (or fills q_out).
    constant_positions: positions, cos and sin are written by no kernel of this launch's PDL chain (the act
    stage's positions, computed by torch ops before its first Triton kernel): they are read before the wait.
    qkv may be `Partials` of a [B, T, width] result (added up on load)."""
    op = "qkv_rope_cache"
    parts = part_stride = 0
    if isinstance(qkv, Partials):
        qkv.check(op)
        if len(qkv.shape) != 3:
            raise KernelInputError(f"{op}: partials of a [B, T, width] result expected, got shape {qkv.shape}")
        parts, part_stride, dtype, shape, qkv = qkv.splits, qkv.data.stride(0), qkv.dtype, tuple(qkv.shape), qkv.data
    else:
        check(op, "qkv", qkv, ndim=3, contiguous=True)
        dtype, shape = qkv.dtype, tuple(qkv.shape)
    b, t, width = shape
    heads = num_q_heads + 2 * num_kv_heads
    if num_q_heads < 1 or num_kv_heads < 1 or width % heads:
        raise KernelInputError(
            f"{op}: `qkv` last dim {width} is not (num_q_heads + 2 * num_kv_heads) * head_dim "
            f"for num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    dh = width // heads
    if dh % 2:
        raise KernelInputError(f"{op}: head_dim {dh} must be even for rotate-half RoPE")
    check(op, "positions", positions, dtypes=INT_DTYPES, shape=(b, t), contiguous=True, device=qkv.device)
    check(op, "cos", cos, dtypes=(torch.float32,), ndim=2, shape=(None, dh // 2), contiguous=True,
          device=qkv.device)
    check(op, "sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape), contiguous=True, device=qkv.device)
    check(op, "k_cache", k_cache, ndim=4, shape=(b, num_kv_heads, None, dh), device=qkv.device)
    check(op, "v_cache", v_cache, shape=tuple(k_cache.shape), device=qkv.device)
    if isinstance(cache_offset, torch.Tensor):
        check(op, "cache_offset", cache_offset, dtypes=INT_DTYPES, ndim=1, shape=(b,), contiguous=True,
              device=qkv.device)
        offsets, offset = cache_offset, 0
    else:
        if not 0 <= int(cache_offset) <= k_cache.shape[2] - t:
            raise KernelInputError(
                f"{op}: `cache_offset` {cache_offset} + {t} tokens does not fit a cache of {k_cache.shape[2]} rows")
        offsets, offset = positions, int(cache_offset)  # OFF_ptr unused: any valid pointer will do
    q_shape = (b, t, num_q_heads, dh)
    q_out = check_out(op, "q_out", q_out, q_shape, qkv.device) if q_out is not None else \
        torch.empty(q_shape, dtype=dtype, device=qkv.device)
    if parts and q_out.dtype != dtype:
        raise KernelInputError(f"{op}: q_out is {q_out.dtype}, but the partials hold a {dtype} result")
    if b * t:
        _qkv_rope_cache_kernel[(b * t, heads)](
            qkv, positions, cos, sin, offsets, q_out, k_cache, v_cache, t, cos.shape[0], offset,
            *q_out.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], k_cache.shape[2],
            part_stride=part_stride, HQ=num_q_heads, HKV=num_kv_heads, DH=dh,
            OFFSET_TENSOR=isinstance(cache_offset, torch.Tensor), BLOCK_HALF=next_pow2(dh // 2, 16),
            EARLY=bool(constant_positions), PARTS=parts,
            num_warps=1 if dh <= 128 else 2, **pdl_launch(qkv.device))
    return q_out
