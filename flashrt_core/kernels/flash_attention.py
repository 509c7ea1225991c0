"""Flash-style (online softmax) attention with a key padding mask, GQA, and an optional second key set.

Two uses in pi0.5:
  * prefix / SigLIP: q over k, v of the same tokens; `key_mask` drops padded prefix tokens (bidirectional,
    no causal mask); SigLIP passes no mask.
  * action expert: the 50 suffix queries over [cached prefix K/V (with its pad mask)] + [suffix K/V]
    passed as k2 / v2, so the cache is never concatenated or copied. One key loop walks both sets as one
    sequence (a tile may hold keys of each; the second set is addressed relative to k / v), so a key split
    never walks the prefix's last tile and then the suffix's one after the other.
Layouts: q and out [B, T, Hq, Dh] (token-major, what the QKV split writes and o_proj reads); k, v, k2, v2
[B, Hkv, S, Dh] with any strides (a token-major [B, S, H, Dh] tensor passes as `.transpose(1, 2)`), unit
stride in the last dim. GQA packs the Hq / Hkv query heads that share one kv head into the rows of one
program, so each K/V tile is loaded once per group instead of once per query head.
Softmax runs in fp32 with exp2; P is cast to the value dtype for the second dot (as in FlashAttention).
A query whose keys are all masked returns zeros. Keys split over programs (flash-decoding) are merged by
the last program of each row block.
Reference: `reference.attention_ref`.
"""
import math

import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import (MASK_DTYPES, KernelInputError, check, check_out, interpreting, launch,
                                         next_pow2, pdl_launch, semaphores)
from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait
from flashrt_core.kernels._tickets import last_of_split, reset_ticket

_LOG2E = 1.4426950408889634


@triton.jit
def _scores(q, k, valid, m_i, l_i, qk_scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile's softmax step: (p, alpha, new max, new sum) for k [D, N] and its columns' validity."""
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    # m_i starts finite (-1e30), so a fully masked tile gives exp2(-inf) = 0, never inf - inf = NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate(acc, p, alpha, v, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        v = v.to(tl.float32)
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@triton.jit
def _attend(acc, m_i, l_i, q, K, V, k_base, v_base, k2_base, v2_base, M, k_ss, v_ss, k2_ss, v2_ss, S, lo, hi,
            qk_scale, d, d_mask, HAS_MASK: tl.constexpr, HAS_SECOND: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr, UPCAST: tl.constexpr, ALIGN: tl.constexpr, SAME_STRIDE: tl.constexpr):
    """Fold keys [lo, hi) of one (batch, kv head) into the running (acc, max, sum) of the rows. Key n < S is
    row n of the first set, at K + k_base + n k_ss (V alike; valid where M[n] != 0 with HAS_MASK); key n >= S
    (HAS_SECOND) is row n - S of the second set, at K + k2_base + (n - S) k2_ss (k2_base: the second set's
    address relative to K, in elements; V alike), always valid.
    One key tile may hold keys of both sets (each column reads its own rows), so a split never walks the
    first set's last tile and then the second set's as two serial steps. The columns pick an integer row
    offset, not a pointer (a select of pointers loses the alignment and contiguity Triton needs for 16-byte
    and cp.async loads); row offsets are multiples of ALIGN elements and carry that hint. SAME_STRIDE: the two
    sets' rows have the same strides (k2_ss == k_ss, v2_ss == v_ss), so a column only picks its base."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_range = n < hi
        if HAS_SECOND:
            first = n < S
            n2 = tl.maximum(n - S, 0)
            if SAME_STRIDE:  # a select of two bases, not of two offsets: ~50 registers fewer per thread
                k_rows = K + tl.multiple_of(n * k_ss + tl.where(first, k_base, k2_base - S * k_ss), ALIGN)
            else:
                k_rows = K + tl.multiple_of(tl.where(first, k_base + n.to(tl.int64) * k_ss, k2_base + n2 * k2_ss),
                                            ALIGN)
            mask_keys = in_range & first
        else:
            k_rows = K + tl.multiple_of(k_base + n * k_ss, ALIGN)
            mask_keys = in_range
        valid = in_range
        if HAS_MASK:  # keys of the second set are always valid (other=1)
            valid = valid & (tl.load(M + n, mask=mask_keys, other=1) != 0)
        k = tl.load(k_rows[None, :] + d[:, None], mask=in_range[None, :] & d_mask[:, None], other=0.0)
        p, alpha, m_i, l_i = _scores(q, k, valid, m_i, l_i, qk_scale, PRECISION, UPCAST)
        if HAS_SECOND:  # (computed here, not with k_rows: fewer registers live across the first dot)
            if SAME_STRIDE:
                v_rows = V + tl.multiple_of(n * v_ss + tl.where(n < S, v_base, v2_base - S * v_ss), ALIGN)
            else:
                v_rows = V + tl.multiple_of(tl.where(n < S, v_base + n.to(tl.int64) * v_ss,
                                                     v2_base + tl.maximum(n - S, 0) * v2_ss), ALIGN)
        else:
            v_rows = V + tl.multiple_of(v_base + n * v_ss, ALIGN)
        v = tl.load(v_rows[:, None] + d[None, :], mask=in_range[:, None] & d_mask[None, :], other=0.0)
        acc = _accumulate(acc, p, alpha, v, PRECISION, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _merge_splits(PART, ML, row0, rows_per_split, ok, io_mask, d, DH, NSPLIT: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """The normalized output of rows `row0` (their index in split 0; `ok` masks them) from the NSPLIT split
    partials: PART [splits, rows, DH] unnormalized fp32, ML [2, splits, rows] (running max in log2 units, sum).
    Every split is rescaled to the global max and summed in split order, so the result never depends on
    which program merges. Loads bypass L1 (.cg): other programs of the same kernel may have written them."""
    m_all = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    for i in tl.static_range(NSPLIT):
        m_all = tl.maximum(m_all, tl.load(ML + i * rows_per_split + row0, mask=ok, other=-1.0e30,
                                          cache_modifier=".cg"))
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    l_all = tl.zeros([ROWS], dtype=tl.float32)
    for i in tl.static_range(NSPLIT):
        wgt = tl.exp2(tl.load(ML + i * rows_per_split + row0, mask=ok, other=-1.0e30, cache_modifier=".cg") - m_all)
        l_all += wgt * tl.load(ML + (NSPLIT + i) * rows_per_split + row0, mask=ok, other=0.0, cache_modifier=".cg")
        acc += wgt[:, None] * tl.load(PART + (i * rows_per_split + row0)[:, None] * DH + d[None, :], mask=io_mask,
                                      other=0.0, cache_modifier=".cg")
    return acc / tl.where(l_all > 0.0, l_all, 1.0)[:, None]


@triton.jit
def _attention_kernel(Q, K, V, M, k2_delta, v2_delta, O, PART, ML, C, B, T, S, S2, HQ, HKV, qk_scale,
                      keys_per_split, n_rows,
                      q_sb, q_st, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, m_sb,
                      k2_sb, k2_sh, k2_ss, v2_sb, v2_sh, v2_ss, o_sb, o_st, o_sh,
                      GROUP: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SECOND: tl.constexpr,
                      NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr, DH: tl.constexpr, ALIGN: tl.constexpr,
                      SAME_STRIDE: tl.constexpr, PRE_KV: tl.constexpr, ONE_TILE: tl.constexpr, PDL: tl.constexpr):
    """ALIGN: every stride (and so every row offset) is a multiple of it, in elements (host-checked); DH is a
    compile-time constant, so the head-dim mask is known in 8-element pieces: with both, a head dim such as
    SigLIP's 72 loads in 16-byte vectors (cp.async) instead of one element at a time.
    PRE_KV: the first key set (K, V and its mask M) is written by no kernel of this launch's PDL chain (the
    action expert's cached prefix), so the first-set keys of the program's first key tile are loaded before the
    PDL wait; its second-set keys (written just before) and the queries after it. ONE_TILE (PRE_KV with at most
    BLOCK_N keys per split): that tile is all, no key loop."""
    pdl_trigger(PDL)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)  # which slice of the (S + S2) keys this program folds
    b = (bh // HKV).to(tl.int64)
    kvh = bh % HKV
    d = tl.arange(0, BLOCK_D)
    d_mask = d < DH
    k_base = b * k_sb + kvh * k_sh
    v_base = b * v_sb + kvh * v_sh
    lo = tl.minimum(split * keys_per_split, S + S2)
    hi = tl.minimum(split * keys_per_split + keys_per_split, S + S2)
    if PRE_KV:  # the first tile's first-set keys, before the wait (zeros where a key is of the second set)
        n0 = lo + tl.arange(0, BLOCK_N)
        pre = (n0 < hi) & (n0 < S)
        k0 = tl.load(K + tl.multiple_of(k_base + n0 * k_ss, ALIGN)[None, :] + d[:, None],
                     mask=pre[None, :] & d_mask[:, None], other=0.0)
        v0 = tl.load(V + tl.multiple_of(v_base + n0 * v_ss, ALIGN)[:, None] + d[None, :],
                     mask=pre[:, None] & d_mask[None, :], other=0.0)
        valid0 = n0 < hi
        if HAS_MASK:
            valid0 = valid0 & (tl.load(M + b * m_sb + n0, mask=pre, other=1) != 0)
    pdl_wait(PDL)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (token, head within the group) rows
    t = r // GROUP
    head = kvh * GROUP + r % GROUP
    io_mask = (t < T)[:, None] & d_mask[None, :]
    q_rows = Q + tl.multiple_of(b * q_sb + t * q_st + head * q_sh, ALIGN)[:, None]
    q = tl.load(q_rows + d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k2_base = k2_delta + b * k2_sb + kvh * k2_sh
    v2_base = v2_delta + b * v2_sb + kvh * v2_sh
    if PRE_KV:  # the first tile: its second-set keys added in, then folded; the loop takes the rest
        if HAS_SECOND:
            n2 = tl.maximum(n0 - S, 0)
            own = (n0 < hi) & (n0 >= S)
            k0 = tl.load(K + tl.multiple_of(k2_base + n2 * k2_ss, ALIGN)[None, :] + d[:, None],
                         mask=own[None, :] & d_mask[:, None], other=k0)
            v0 = tl.load(V + tl.multiple_of(v2_base + n2 * v2_ss, ALIGN)[:, None] + d[None, :],
                         mask=own[:, None] & d_mask[None, :], other=v0)
        p, alpha, m_i, l_i = _scores(q, k0, valid0, m_i, l_i, qk_scale, PRECISION, UPCAST)
        acc = _accumulate(acc, p, alpha, v0, PRECISION, UPCAST)
        lo = tl.minimum(lo + BLOCK_N, hi)
    if not ONE_TILE:
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, K, V, k_base, v_base, k2_base, v2_base, M + b * m_sb,
                                k_ss, v_ss, k2_ss, v2_ss, S, lo, hi, qk_scale,
                                d, d_mask, HAS_MASK, HAS_SECOND, BLOCK_N, PRECISION, UPCAST, ALIGN, SAME_STRIDE)
    if NSPLIT > 1:
        # Unnormalized partials PART [splits, B, T, HQ, DH] fp32 and ML [2, splits, B, T, HQ] (each row's running
        # max in log2 units, and sum). The last of the NSPLIT programs of this row block (ticket C) merges them:
        # every split rescaled to the global max, summed in split order, normalized.
        row = ((split.to(tl.int64) * B + b) * T + t) * HQ + head
        tl.store(PART + row[:, None] * DH + d[None, :], acc, mask=io_mask)
        tl.store(ML + row, m_i, mask=t < T)
        tl.store(ML + n_rows + row, l_i, mask=t < T)
        tile = pid_m * tl.num_programs(1) + bh
        if last_of_split(C, tile, NSPLIT):
            rows_per_split = n_rows // NSPLIT
            row0 = row - split.to(tl.int64) * rows_per_split  # the same rows in split 0
            out = _merge_splits(PART, ML, row0, rows_per_split, t < T, io_mask, d, DH, NSPLIT, BLOCK_M, BLOCK_D)
            tl.store(O + tl.multiple_of(b * o_sb + t * o_st + head * o_sh, ALIGN)[:, None] + d[None, :],
                     out.to(O.dtype.element_ty), mask=io_mask)
            reset_ticket(C, tile)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(O + tl.multiple_of(b * o_sb + t * o_st + head * o_sh, ALIGN)[:, None] + d[None, :],
                 out.to(O.dtype.element_ty), mask=io_mask)


def _blocks(rows, batch_heads, keys, block_d):
    """(BLOCK_M, BLOCK_N, splits, num_warps). Shrink BLOCK_M, then split the keys (flash-decoding), until
    the grid roughly fills an H200's 132 SMs: the expert's 50-token suffix would otherwise run on a handful
    of programs, each walking all ~610 keys serially."""
    if interpreting():
        return 16, 16, 1, 1
    block_n = 64 if block_d <= 128 else 32
    block_m = 64
    while block_m > 16 and triton.cdiv(rows, block_m) * batch_heads < 132:
        block_m //= 2
    programs = triton.cdiv(rows, block_m) * batch_heads
    splits = 1
    while programs * splits < 132 and triton.cdiv(keys, splits * 2) >= 2 * block_n:
        splits *= 2
    return block_m, block_n, splits, 4 if block_d <= 128 else 8


def _row_alignment(*tensors) -> int:
    """The largest power of two up to 16 that divides every batch / token / head stride of the tensors
    (q / out [B, T, H, D], k / v [B, H, S, D]), in elements: a hint that lets the kernel load a row's head dim
    in 16-byte pieces (base pointers are specialized on 16-byte alignment by Triton itself). A batch or head
    dim of size 1 is only indexed at 0, so its stride never enters an offset; the token / key dims always
    count, because the tiles' padding lanes (beyond T or S) compute offsets along them too."""
    g = 16
    for t, seq_dim in tensors:
        for dim, (size, st) in enumerate(zip(t.shape[:3], t.stride()[:3])):
            if size > 1 or dim == seq_dim:
                g = math.gcd(g, int(st))
    return g


def _kv(op, name, t, b, hkv, dh, dtype, device, s=None):
    check(op, name, t, ndim=4, dtypes=(dtype,), shape=(b, hkv, s, dh), device=device)
    return t


def attention(q, k, v, key_mask=None, k2=None, v2=None, *, scale=None, out=None, config=None,
              constant_kv=False):
    """Softmax(q k^T * scale) v over keys k/v [B, Hkv, S, Dh] valid where key_mask [B, S] != 0 (all when
    None), then the always-valid keys k2/v2 [B, Hkv, S2, Dh]. q [B, T, Hq, Dh], Hq a multiple of Hkv.
    scale defaults to 1 / sqrt(Dh). Returns [B, T, Hq, Dh] in q's dtype (or fills `out`, which may be strided
    with a unit-stride last dim).
    constant_kv: k, v and key_mask are written by no kernel of this launch's PDL chain (the action expert's
    cached prefix, during the act stage), so each program loads its first tile of them before its PDL wait.
    `config` = (BLOCK_M, BLOCK_N, splits, num_warps[, num_stages]) overrides the heuristic (tuning sweeps;
    num_stages defaults to 2)."""
    op = "attention"
    check(op, "q", q, ndim=4)
    b, t, hq, dh = q.shape
    check(op, "k", k, ndim=4, dtypes=(q.dtype,), device=q.device)
    hkv, s = k.shape[1], k.shape[2]
    if hkv < 1 or hq % hkv:
        raise KernelInputError(f"{op}: `q` has {hq} heads, not a multiple of the {hkv} kv heads of `k`")
    _kv(op, "k", k, b, hkv, dh, q.dtype, q.device)
    _kv(op, "v", v, b, hkv, dh, q.dtype, q.device, s)
    if key_mask is not None:
        check(op, "key_mask", key_mask, dtypes=MASK_DTYPES, shape=(b, s), device=q.device)
        if key_mask.dtype == torch.bool:
            key_mask = key_mask.view(torch.uint8)  # same bytes; Triton loads bytes more reliably than i1
    if (k2 is None) != (v2 is None):
        raise KernelInputError(f"{op}: `k2` and `v2` must be given together")
    s2 = 0
    if k2 is not None:
        _kv(op, "k2", k2, b, hkv, dh, q.dtype, q.device)
        s2 = k2.shape[2]
        _kv(op, "v2", v2, b, hkv, dh, q.dtype, q.device, s2)
    # (out may be a strided view, e.g. some tokens of a larger buffer: the kernel writes through its strides)
    out = check(op, "out", out, shape=tuple(q.shape), device=q.device) if out is not None else q.new_empty(q.shape)
    if out.dtype != q.dtype:
        raise KernelInputError(f"{op}: `out` has dtype {out.dtype}, expected {q.dtype} like `q`")
    if b * t == 0:
        return out
    scale = 1.0 / math.sqrt(dh) if scale is None else float(scale)
    group = hq // hkv
    block_d = next_pow2(dh, 16)
    block_m, block_n, splits, warps, *rest = config or _blocks(t * group, b * hkv, s + s2, block_d)
    stages = rest[0] if rest else 2
    keys_per_split = triton.cdiv(triton.cdiv(max(s + s2, 1), splits), block_n) * block_n
    splits = triton.cdiv(max(s + s2, 1), keys_per_split)  # no empty trailing split
    n_rows = splits * b * t * hq
    grid = (triton.cdiv(t * group, block_m), b * hkv, splits)
    if splits > 1:  # per-call scratch: the caching allocator (and a CUDA graph's pool) makes it cheap
        part = torch.empty(n_rows * dh, dtype=torch.float32, device=q.device)
        ml = torch.empty(2 * n_rows, dtype=torch.float32, device=q.device)
        tickets = semaphores(grid[0] * grid[1], q.device)
    else:
        part = ml = tickets = q
    m_arg = key_mask if key_mask is not None else q
    k2_arg, v2_arg = (k2, v2) if k2 is not None else (k, v)
    # The second key set is addressed from k / v: its offset in elements (one flat address space; a multiple
    # of the alignment below when both are 16-byte aligned, else the hint drops to what holds).
    k2_delta = (k2_arg.data_ptr() - k.data_ptr()) // k.element_size()
    v2_delta = (v2_arg.data_ptr() - v.data_ptr()) // v.element_size()
    upcast = interpreting() and q.dtype != torch.float32
    align = math.gcd(_row_alignment((q, 1), (out, 1), (k, 2), (v, 2), (k2_arg, 2), (v2_arg, 2)), k2_delta, v2_delta)
    launch(_attention_kernel, grid,
        q, k, v, m_arg, k2_delta, v2_delta, out, part, ml, tickets, b, t, s, s2, hq, hkv,
        scale * _LOG2E, keys_per_split, n_rows,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), key_mask.stride(0) if key_mask is not None else 0,
        k2_arg.stride(0), k2_arg.stride(1), k2_arg.stride(2), v2_arg.stride(0), v2_arg.stride(1), v2_arg.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, HAS_MASK=key_mask is not None, HAS_SECOND=k2 is not None, NSPLIT=splits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # fp32 inputs get exact (not TF32) dots. Triton's CPU interpreter multiplies bf16 tiles wrongly
        # (triton 3.9), so there the tiles are upcast first; on GPU bf16/fp16 tiles go to the tensor cores.
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        DH=dh, ALIGN=align,
        SAME_STRIDE=k2_arg.stride(2) == k.stride(2) and v2_arg.stride(2) == v.stride(2), PRE_KV=bool(constant_kv),
        ONE_TILE=bool(constant_kv) and keys_per_split <= block_n,
        num_warps=warps, num_stages=stages, **pdl_launch(q.device))
    return out
