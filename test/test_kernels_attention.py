"""Flash attention (key padding mask, GQA, second always-valid key set) vs the torch reference; the reference
itself is checked against torch's scaled_dot_product_attention.

Interpreter by default (TRITON_INTERPRET=1); with TRITON_INTERPRET=0 on CUDA the same tests run compiled.
"""
import math
from kernel_testing import dev, assert_close, randn  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels import reference as R  # noqa: E402
from flashrt_core.kernels._common import KernelInputError, interpreting  # noqa: E402

# (atol, rtol) per dtype. bf16/fp16: inputs are rounded identically on both sides; the kernel's online
# softmax (and on GPU its bf16 P tile) adds well under one output ulp of error for these magnitudes.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


def close(out, ref):
    assert_close(out, ref, TOL)


def pad_mask(b, s, dev, seed=0):
    """Random key padding mask with some keys dropped in every batch row, and at least one kept."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, s, generator=g) > 0.35
    m[:, 0] = True
    m[:, -1] = False
    return m.to(dev)


CASES = [  # b, t, hq, hkv, dh, s: T == S is the prefix, the rest are over a cache of another length
    (2, 19, 8, 1, 16, 19),
    (1, 13, 8, 1, 256, 23),
    (2, 7, 4, 2, 72, 19),
    (1, 9, 3, 3, 40, 40),
]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}t{}hq{}hkv{}dh{}s{}".format(*c))
def test_prefix_attention_with_pad_mask(dev, dtype, case):
    b, t, hq, hkv, dh, s = case
    q = randn(b, t, hq, dh, dtype=dtype, dev=dev, seed=1, std=2.0)  # std 2: peaky softmax rows
    k, v = randn(b, hkv, s, dh, dtype=dtype, dev=dev, seed=2), randn(b, hkv, s, dh, dtype=dtype, dev=dev, seed=3)
    mask = pad_mask(b, s, dev, seed=4)
    close(K.attention(q, k, v, mask, backend="triton"), R.attention_ref(q, k, v, mask))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_siglip_attention_no_mask_token_major_kv(dev, dtype):
    """SigLIP: head_dim 72, no mask, k / v straight from a token-major QKV output via transpose views."""
    b, t, h, dh = 2, 19, 3, 72
    qkv = randn(b, t, 3, h, dh, dtype=dtype, dev=dev, seed=5)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    close(K.attention(q, k, v, backend="triton"), R.attention_ref(q, k, v))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dh", [16, 256])
def test_suffix_over_cached_prefix_and_suffix_kv(dev, dtype, dh):
    """Action expert: suffix queries over [prefix cache with pad mask] + [suffix K/V], GQA 8:1."""
    b, sp, ts, hq = 2, 23, 7, 8
    q = randn(b, ts, hq, dh, dtype=dtype, dev=dev, seed=6, std=2.0)
    kp, vp = randn(b, 1, sp, dh, dtype=dtype, dev=dev, seed=7), randn(b, 1, sp, dh, dtype=dtype, dev=dev, seed=8)
    ks, vs = randn(b, 1, ts, dh, dtype=dtype, dev=dev, seed=9), randn(b, 1, ts, dh, dtype=dtype, dev=dev, seed=10)
    mask = pad_mask(b, sp, dev, seed=11)
    out = K.attention(q, kp, vp, mask, ks, vs, backend="triton")
    close(out, R.attention_ref(q, kp, vp, mask, ks, vs))
    # Same thing as one concatenated key set with the suffix marked valid.
    cat_mask = torch.cat((mask, torch.ones(b, ts, dtype=torch.bool, device=dev)), dim=1)
    close(out, K.attention(q, torch.cat((kp, ks), 2), torch.cat((vp, vs), 2), cat_mask, backend="triton"))


@pytest.mark.interpret
def test_masked_keys_do_not_matter_and_empty_rows_are_zero(dev):
    b, t, hq, hkv, dh, s = 2, 7, 8, 1, 16, 19
    q, k, v = randn(b, t, hq, dh, dev=dev, seed=12), randn(b, hkv, s, dh, dev=dev, seed=13), \
        randn(b, hkv, s, dh, dev=dev, seed=14)
    mask = pad_mask(b, s, dev, seed=15)
    mask[1] = False  # batch 1 has no valid key at all
    out = K.attention(q, k, v, mask, backend="triton")
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    k2, v2 = k.clone(), v.clone()
    k2[~mask[:, None, :].expand_as(k2[..., 0])] = 1e4  # garbage in masked slots must not leak
    v2[~mask[:, None, :].expand_as(v2[..., 0])] = -1e4
    close(K.attention(q, k2, v2, mask, backend="triton"), out)
    close(out, R.attention_ref(q, k, v, mask))


@pytest.mark.interpret
def test_scale_override_mask_dtypes_and_out_buffer(dev):
    b, t, hq, hkv, dh, s = 1, 7, 2, 1, 24, 13
    q, k, v = randn(b, t, hq, dh, dev=dev, seed=16), randn(b, hkv, s, dh, dev=dev, seed=17), \
        randn(b, hkv, s, dh, dev=dev, seed=18)
    mask = pad_mask(b, s, dev, seed=19)
    ref = R.attention_ref(q, k, v, mask, scale=0.3)
    for m in (mask, mask.to(torch.int32), mask.to(torch.uint8)):
        close(K.attention(q, k, v, m, scale=0.3, backend="triton"), ref)
    out = torch.empty_like(q)
    assert K.attention(q, k, v, mask, scale=0.3, out=out, backend="triton").data_ptr() == out.data_ptr()
    close(out, ref)


def test_reference_matches_torch_sdpa():
    """The reference against an independent implementation: SDPA with a boolean mask and repeated kv heads."""
    b, t, hq, hkv, dh, s = 2, 7, 8, 2, 24, 19
    q, k, v = randn(b, t, hq, dh, seed=20), randn(b, hkv, s, dh, seed=21), randn(b, hkv, s, dh, seed=22)
    mask = pad_mask(b, s, "cpu", seed=23)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
        attn_mask=mask[:, None, None, :], scale=1 / math.sqrt(dh)).transpose(1, 2)
    torch.testing.assert_close(R.attention_ref(q, k, v, mask), want, atol=1e-5, rtol=1e-5)


@pytest.mark.interpret
def test_launcher_errors_name_the_argument(dev):
    b, t, hq, hkv, dh, s = 1, 7, 8, 1, 16, 13
    q, k, v = randn(b, t, hq, dh, dev=dev), randn(b, hkv, s, dh, dev=dev), randn(b, hkv, s, dh, dev=dev)
    with pytest.raises(KernelInputError, match="not a multiple of the 3 kv heads"):
        K.attention(q, randn(b, 3, s, dh, dev=dev), randn(b, 3, s, dh, dev=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`key_mask` has shape"):
        K.attention(q, k, v, torch.ones(b, s + 1, dtype=torch.bool, device=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`key_mask` has dtype"):
        K.attention(q, k, v, torch.ones(b, s, device=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`k2` and `v2`"):
        K.attention(q, k, v, None, k, backend="triton")
    with pytest.raises(KernelInputError, match="`v` has shape"):
        K.attention(q, k, randn(b, hkv, s + 2, dh, dev=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`k` has dtype"):
        K.attention(q, k.double(), v, backend="triton")
    with pytest.raises(KernelInputError, match="`k` has shape"):
        K.attention(q, randn(b, hkv, s, dh + 8, dev=dev), v, backend="triton")
    with pytest.raises(KernelInputError, match="`q` must have 4 dims"):
        K.attention(q[0], k, v, backend="triton")
    with pytest.raises(KernelInputError, match="`out` has shape"):
        K.attention(q, k, v, out=torch.empty(b, t, hq, dh + 1, device=dev), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(interpreting(), reason="full shapes are too slow for the Triton interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_full_shapes_on_cuda(dtype):
    # Gemma prefix: 560 tokens (two 256-token views + a 48-token prompt), 8:1 GQA, head_dim 256.
    q = randn(1, 560, 8, 256, dtype=dtype, dev="cuda", seed=30)
    k = randn(1, 1, 560, 256, dtype=dtype, dev="cuda", seed=31)
    v = randn(1, 1, 560, 256, dtype=dtype, dev="cuda", seed=32)
    mask = pad_mask(1, 560, "cuda", seed=33)
    close(K.attention(q, k, v, mask, backend="triton"), R.attention_ref(q, k, v, mask))
    # Action expert: 50 suffix queries over the prefix cache + 50 suffix keys.
    qs = randn(1, 50, 8, 256, dtype=dtype, dev="cuda", seed=34)
    ks = randn(1, 1, 50, 256, dtype=dtype, dev="cuda", seed=35)
    vs = randn(1, 1, 50, 256, dtype=dtype, dev="cuda", seed=36)
    close(K.attention(qs, k, v, mask, ks, vs, backend="triton"), R.attention_ref(qs, k, v, mask, ks, vs))
    # the act stage's launches (bf16 picks; fp32 tiles of 128 keys x 256 dims exceed shared memory: the
    # picker skips such a candidate, the heuristic fits)
    for config in (None, (16, 128, 8, 8), (16, 64, 4, 8, 2), (32, 64, 2, 8)) if dtype == torch.bfloat16 else (None,):
        from flashrt_core.kernels.flash_attention import attention as attention_kernel
        close(attention_kernel(qs, k, v, mask, ks, vs, config=config, constant_kv=True),
              R.attention_ref(qs, k, v, mask, ks, vs))
    # SigLIP: 2 views x 256 tokens, 16 heads of 72, no mask.
    qkv = randn(2, 256, 3, 16, 72, dtype=dtype, dev="cuda", seed=37)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    close(K.attention(q, k, v, backend="triton"), R.attention_ref(q, k, v))


@pytest.mark.interpret
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_key_tiles_that_hold_both_key_sets_with_their_own_strides(dev, splits):
    """One key loop walks [first set | second set]: a tile holding keys of both reads each column from its own
    tensor. With the second set's rows at another stride than the first's (a strided view), the columns pick
    whole offsets instead of a base; both must give the reference, split or not."""
    from flashrt_core.kernels.flash_attention import attention as attention_kernel

    b, sp, ts, hq, dh = 2, 21, 6, 4, 16
    q = randn(b, ts, hq, dh, dev=dev, seed=50, std=2.0)
    kp, vp = randn(b, 1, sp, dh, dev=dev, seed=51), randn(b, 1, sp, dh, dev=dev, seed=52)
    wide = randn(b, 1, ts, 3 * dh, dev=dev, seed=53)
    ks, vs = wide[..., :dh], wide[..., 2 * dh:]  # rows 3 dh apart, not dh
    assert ks.stride(2) != kp.stride(2)
    mask = pad_mask(b, sp, dev, seed=54)
    want = R.attention_ref(q, kp, vp, mask, ks, vs)
    close(attention_kernel(q, kp, vp, mask, ks, vs, config=(16, 16, splits, 4)), want)
    close(attention_kernel(q, kp, vp, mask, ks.contiguous(), vs.contiguous(), config=(16, 16, splits, 4)), want)


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_keys_flash_decoding(dev, splits, dtype):
    """Keys split across programs and merged in-kernel by the last program of each row block (the heuristic
    splits on GPU for the expert's few queries); splits straddle the prefix / suffix boundary and fully
    masked slices. The tickets of a shared workspace are all zero again after each call."""
    from flashrt_core.kernels._common import new_semaphore_workspace, semaphore_workspace
    from flashrt_core.kernels.flash_attention import attention as attention_kernel

    b, sp, ts, hq, dh = 2, 37, 7, 8, 24
    q = randn(b, ts, hq, dh, dtype=dtype, dev=dev, seed=40, std=2.0)
    kp, vp = randn(b, 1, sp, dh, dtype=dtype, dev=dev, seed=41), randn(b, 1, sp, dh, dtype=dtype, dev=dev, seed=42)
    ks, vs = randn(b, 1, ts, dh, dtype=dtype, dev=dev, seed=43), randn(b, 1, ts, dh, dtype=dtype, dev=dev, seed=44)
    mask = pad_mask(b, sp, dev, seed=45)
    mask[0, :16] = False  # batch 0: the whole first split is masked
    ref = R.attention_ref(q, kp, vp, mask, ks, vs)
    tickets = new_semaphore_workspace(dev, 256)
    with semaphore_workspace(tickets):
        first = attention_kernel(q, kp, vp, mask, ks, vs, config=(16, 16, splits, 4))
        assert int(tickets.abs().sum()) == 0
        # A pipeline depth in the config (a fifth entry) changes the schedule, not the result.
        close(attention_kernel(q, kp, vp, mask, ks, vs, config=(16, 16, splits, 4, 3)), first)
        assert torch.equal(attention_kernel(q, kp, vp, mask, ks, vs, config=(16, 16, splits, 4)), first)
    close(first, ref)
    empty = mask.clone()
    empty[1] = False  # prefix fully masked: only the suffix keys count
    close(attention_kernel(q, kp, vp, empty, ks, vs, config=(16, 16, splits, 4)),
          R.attention_ref(q, kp, vp, empty, ks, vs))
    nothing = torch.zeros_like(mask)
    out = attention_kernel(q, kp, vp, nothing, config=(16, 16, splits, 4))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.interpret
def test_every_tuning_candidate_computes_the_expert_attention(dev):
    """Each launch configuration the engine's attention picker may choose gives the reference result on an
    expert-like shape (8 query heads over one kv head, padded cached prefix + the queries' own keys): the
    picker also checks a choice before timing it, this keeps unusable candidates out of the list."""
    from flashrt_core.kernels.flash_attention import attention as attention_kernel
    from flashrt_core.engine.attention import CANDIDATES

    b, sp, ts, hq, dh = 1, 45, 9, 8, 16
    q = randn(b, ts, hq, dh, dev=dev, seed=50, std=2.0)
    kp, vp = randn(b, 1, sp, dh, dev=dev, seed=51), randn(b, 1, sp, dh, dev=dev, seed=52)
    ks, vs = randn(b, 1, ts, dh, dev=dev, seed=53), randn(b, 1, ts, dh, dev=dev, seed=54)
    mask = pad_mask(b, sp, dev, seed=55)
    ref = R.attention_ref(q, kp, vp, mask, ks, vs)
    for config in CANDIDATES:
        close(attention_kernel(q, kp, vp, mask, ks, vs, config=config), ref)


def test_the_alignment_hint_counts_the_token_and_key_strides_even_for_one_token():
    """The kernel's row-offset hint (the largest power of two up to 16 dividing the strides it multiplies) must
    hold on the tiles' padding lanes too, which step along the token / key dims even when there is one token
    or key; a batch or head dim of size 1 is never stepped along."""
    from flashrt_core.kernels.flash_attention import _row_alignment

    base = torch.zeros(1, 1, 4, 40)
    one_key = base[:, :, :1, :16]  # [1, 1, 1, 16], key stride 40: 8 divides it, 16 does not
    assert _row_alignment((one_key, 2)) == 8
    wide_batch = torch.zeros(3, 1, 2, 16)[:1]  # batch of one: its stride (32) never enters an offset
    assert _row_alignment((wide_batch.as_strided((1, 1, 2, 16), (7, 5, 16, 1)), 2)) == 16
    q = torch.zeros(1, 1, 2, 24)  # one token, token stride 48, head stride 24
    assert _row_alignment((q, 1)) == 8


def test_reference_attention_zeros_rows_without_keys_but_keeps_nan_from_the_data():
    """A batch item whose keys are all masked gives zeros (the documented convention); a NaN in a valid key
    comes out as NaN, as the kernel gives it, instead of being turned into a finite-looking result."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 4, 8, generator=g) + 0.1
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    out = R.attention_ref(q, k, v, mask)
    assert torch.isfinite(out[0]).all() and out[0].abs().max() > 0 and torch.equal(out[1], torch.zeros_like(out[1]))
    k[0, 1, 3, 2] = float("nan")  # a valid key of kv head 1: its query heads 2 and 3 see it
    out = R.attention_ref(q, k, v, mask)
    assert torch.isnan(out[0, :, 2:]).all() and torch.isfinite(out[0, :, :2]).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.interpret
@pytest.mark.parametrize("config", [(16, 16, 1, 4), (16, 16, 2, 4), (16, 16, 3, 4), (16, 32, 4, 4)],
                         ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_constant_kv_reads_the_first_tile_before_the_wait(dev, dtype, config):
    """constant_kv (the act stage's cached prefix): each program's first key tile of the first set is loaded
    before the PDL wait and folded before the key loop. Splits of one tile and of several, first tiles that
    hold keys of both sets (second set at its own stride) or of the second set only, a padded prefix, GQA 8:1
    and 2:1: the same as the reference."""
    from flashrt_core.kernels.flash_attention import attention as attention_kernel

    for b, sp, ts, hq, hkv, dh in ((2, 37, 7, 8, 1, 24), (1, 13, 5, 4, 2, 16)):
        q = randn(b, ts, hq, dh, dtype=dtype, dev=dev, seed=60, std=2.0)
        kp, vp = randn(b, hkv, sp, dh, dtype=dtype, dev=dev, seed=61), randn(b, hkv, sp, dh, dtype=dtype, dev=dev, seed=62)
        wide = randn(b, hkv, ts, 3 * dh, dtype=dtype, dev=dev, seed=63)
        ks, vs = wide[..., :dh], wide[..., 2 * dh:]
        mask = pad_mask(b, sp, dev, seed=64)
        want = R.attention_ref(q, kp, vp, mask, ks, vs)
        close(attention_kernel(q, kp, vp, mask, ks, vs, config=config, constant_kv=True), want)
        close(attention_kernel(q, kp, vp, None, ks.contiguous(), vs.contiguous(), config=config, constant_kv=True),
              R.attention_ref(q, kp, vp, None, ks, vs))
        close(attention_kernel(q, kp, vp, mask, config=config, constant_kv=True), R.attention_ref(q, kp, vp, mask))
        # pi0's first flow step: the state row and the action rows in two launches into one buffer (strided views)
        both = torch.full((b, ts, hq, dh), float("nan"), dtype=dtype, device=dev)
        attention_kernel(q[:, :1], kp, vp, mask, ks[:, :, :1], vs[:, :, :1], config=config, constant_kv=True,
                         out=both[:, :1])
        attention_kernel(q[:, 1:], kp, vp, mask, ks, vs, config=config, constant_kv=True, out=both[:, 1:])
        close(both[:, :1], R.attention_ref(q[:, :1], kp, vp, mask, ks[:, :, :1], vs[:, :, :1]))
        close(both[:, 1:], R.attention_ref(q[:, 1:], kp, vp, mask, ks, vs))
