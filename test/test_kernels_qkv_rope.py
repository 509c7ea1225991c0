"""QKV split + RoPE + K/V cache write vs the torch reference, plus checks of RoPE itself that do not use
the reference (HF's table formula, position 0 is the identity, scores depend on relative position only).

Interpreter by default (TRITON_INTERPRET=1); with TRITON_INTERPRET=0 on CUDA the same tests run compiled.
"""
from kernel_testing import dev, assert_close  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels import reference as R  # noqa: E402
from flashrt_core.kernels._common import KernelInputError, interpreting  # noqa: E402

# (atol, rtol) per dtype. The kernel rotates in fp32 and rounds once, like the reference.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def close(out, ref):
    assert_close(out, ref, TOL)


def randn(*shape, dtype=torch.float32, dev="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(dev)


def make(b, t, hq, hkv, dh, s, dtype, dev, seed=0):
    qkv = randn(b, t, (hq + 2 * hkv) * dh, dtype=dtype, dev=dev, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 300, (b, t), generator=g).to(dev)
    cache = randn(b, hkv, s, dh, dtype=dtype, dev=dev, seed=seed + 2)  # non-zero: untouched rows must stay
    return qkv, positions, cache


def run_both(qkv, positions, cache, offset, hq, hkv, k_layout=None):
    cos, sin = K.rope_cos_sin(320, qkv.shape[-1] // (hq + 2 * hkv), device=qkv.device)
    caches = [cache.clone() for _ in range(4)]
    if k_layout is not None:
        caches = [k_layout(c) for c in caches]
    q = K.qkv_rope_cache(qkv, positions, cos, sin, caches[0], caches[1], offset, num_q_heads=hq,
                         num_kv_heads=hkv, backend="triton")
    q_ref = R.qkv_rope_cache_ref(qkv, positions, cos, sin, caches[2], caches[3], offset, num_q_heads=hq,
                                 num_kv_heads=hkv)
    return q, q_ref, caches


CASES = [  # b, t, hq, hkv, dh, s
    (2, 7, 8, 1, 24, 19),   # pi0.5's GQA ratio (8 q heads share 1 kv head), small head_dim
    (1, 13, 4, 2, 72, 23),  # half = 36: not a power of two
    (3, 5, 2, 2, 16, 11),
]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}t{}hq{}hkv{}dh{}s{}".format(*c))
@pytest.mark.parametrize("offset_kind", ["int", "tensor"])
def test_qkv_rope_cache(dev, dtype, case, offset_kind):
    b, t, hq, hkv, dh, s = case
    qkv, positions, cache = make(b, t, hq, hkv, dh, s, dtype, dev)
    offsets = [(3 * i + 1) % (s - t + 1) for i in range(b)]
    offset = offsets[0] if offset_kind == "int" else torch.tensor(offsets, device=dev)
    if offset_kind == "int":
        offsets = [offset] * b
    q, q_ref, (k, v, k_ref, v_ref) = run_both(qkv, positions, cache, offset, hq, hkv)
    close(q, q_ref)
    close(k, k_ref)
    close(v, v_ref)
    for i, o in enumerate(offsets):  # rows outside [o, o + t) are untouched
        keep = torch.ones(s, dtype=torch.bool)
        keep[o:o + t] = False
        assert torch.equal(k[i][:, keep], cache[i][:, keep]) and torch.equal(v[i][:, keep], cache[i][:, keep])
    # V is copied, not rotated.
    heads = qkv.reshape(b, t, hq + 2 * hkv, dh)
    assert torch.equal(v[0, :, offsets[0]:offsets[0] + t].transpose(0, 1), heads[0, :, hq + hkv:])


def plain_and_early(qkv, positions, cos, sin, cache, offset, hq, hkv):
    """(q, k cache, v cache) of the kernel without and with constant_positions, each into its own cache copy;
    asserts the two are bit for bit the same and returns them."""
    outs = []
    for early in (False, True):
        kc, vc = cache.clone(), cache.clone()
        q = K.qkv_rope_cache(qkv, positions, cos, sin, kc, vc, offset, num_q_heads=hq, num_kv_heads=hkv,
                             constant_positions=early, backend="triton")
        outs.append((q, kc, vc))
    for plain, early in zip(*outs):
        assert torch.equal(plain, early)
    return outs


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}t{}hq{}hkv{}dh{}s{}".format(*c))
def test_constant_positions_read_early_with_the_same_result(dev, dtype, case):
    """constant_positions=True reads positions and table rows before the PDL wait: bit for bit the plain
    kernel's q, k and v (positions outside the tables included: they stay unrotated), and the reference's."""
    b, t, hq, hkv, dh, s = case
    qkv, positions, cache = make(b, t, hq, hkv, dh, s, dtype, dev, seed=11)
    positions[0, 0] = 400  # outside the 320-row tables
    positions[-1, -1] = -3
    cos, sin = K.rope_cos_sin(320, dh, device=dev)
    outs = plain_and_early(qkv, positions, cos, sin, cache, 1, hq, hkv)
    kr, vr = cache.clone(), cache.clone()
    q_ref = R.qkv_rope_cache_ref(qkv, positions, cos, sin, kr, vr, 1, num_q_heads=hq, num_kv_heads=hkv)
    for got, want in zip(outs[1], (q_ref, kr, vr)):
        close(got, want)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_qkv_partials_are_added_up_on_load(dev, dtype, splits):
    """qkv given as a split-K GEMM's unreduced partials (`kernels.Partials`): summed in split order and
    rounded to the result's dtype on load, so q, k and v are bit for bit those from the summed qkv in fp32
    (in bf16 the interpreter's rounding differs from torch's: within the bf16 tolerance), and the reference
    takes partials too."""
    b, t, hq, hkv, dh, s = 2, 5, 3, 1, 20, 9
    data = randn(splits, b * t, (hq + 2 * hkv) * dh, dev=dev, seed=21 + splits)
    parts = K.Partials(data, dtype, (b, t, (hq + 2 * hkv) * dh))
    _, positions, cache = make(b, t, hq, hkv, dh, s, dtype, dev, seed=23)
    cos, sin = K.rope_cos_sin(320, dh, device=dev)
    outs = {}
    for name, qkv in (("partials", parts), ("summed", parts.total())):
        kc, vc = cache.clone(), cache.clone()
        q = K.qkv_rope_cache(qkv, positions, cos, sin, kc, vc, 2, num_q_heads=hq, num_kv_heads=hkv,
                             backend="triton")
        outs[name] = (q, kc, vc)
    kr, vr = cache.clone(), cache.clone()
    q_ref = R.qkv_rope_cache_ref(parts, positions, cos, sin, kr, vr, 2, num_q_heads=hq, num_kv_heads=hkv)
    assert outs["partials"][0].dtype == dtype
    for got, summed, want in zip(outs["partials"], outs["summed"], (q_ref, kr, vr)):
        if dtype == torch.float32:
            assert torch.equal(got, summed)
        close(got, summed)
        close(got, want)


@pytest.mark.interpret
def test_qkv_partials_that_do_not_fit_are_refused(dev):
    b, t, hq, hkv, dh = 1, 4, 2, 1, 8
    cos, sin = K.rope_cos_sin(32, dh, device=dev)
    positions = torch.zeros(b, t, dtype=torch.int64, device=dev)
    cache = torch.zeros(b, hkv, 6, dh, device=dev)
    width = (hq + 2 * hkv) * dh
    flat = K.Partials(torch.randn(2, b * t, width, device=dev), torch.float32, (b * t, width))
    wrong_rows = K.Partials(torch.randn(2, 3, width, device=dev), torch.float32, (b, t, width))
    for parts in (flat, wrong_rows):
        with pytest.raises(KernelInputError, match="partials"):
            K.qkv_rope_cache(parts, positions, cos, sin, cache, cache.clone(), 0, num_q_heads=hq,
                             num_kv_heads=hkv, backend="triton")
    parts = K.Partials(torch.randn(2, b * t, width, device=dev), torch.bfloat16, (b, t, width))
    with pytest.raises(KernelInputError, match="partials"):
        K.qkv_rope_cache(parts, positions, cos, sin, cache.bfloat16(), cache.bfloat16(), 0, num_q_heads=hq,
                         num_kv_heads=hkv, q_out=torch.empty(b, t, hq, dh, device=dev), backend="triton")


@pytest.mark.interpret
def test_token_major_cache_view_and_q_out(dev):
    """k/v caches may be any strided [B, Hkv, S, Dh] view, e.g. a token-major buffer transposed."""
    b, t, hq, hkv, dh, s = 2, 7, 4, 2, 24, 19
    qkv, positions, cache = make(b, t, hq, hkv, dh, s, torch.float32, dev, seed=5)
    token_major = cache.transpose(1, 2).contiguous()
    q, q_ref, (k, v, k_ref, v_ref) = run_both(qkv, positions, token_major, 4, hq, hkv,
                                              k_layout=lambda c: c.transpose(1, 2))
    close(k, k_ref)
    close(v, v_ref)
    q_out = torch.empty(b, t, hq, dh, device=dev)
    cos, sin = K.rope_cos_sin(320, dh, device=dev)
    kc, vc = cache.clone(), cache.clone()
    got = K.qkv_rope_cache(qkv, positions, cos, sin, kc, vc, 4, num_q_heads=hq, num_kv_heads=hkv,
                           q_out=q_out, backend="triton")
    assert got.data_ptr() == q_out.data_ptr()
    close(q_out, q_ref)


def test_rope_tables_match_hf_gemma_formula():
    """HF computes freqs as inv_freq[:, None] @ positions[None, :] in fp32 and cos/sin of cat(freqs, freqs)."""
    dh, n = 72, 600
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))
    freqs = (inv_freq[None, :, None] @ torch.arange(n).float()[None, None, :]).transpose(1, 2)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = K.rope_cos_sin(n, dh)
    torch.testing.assert_close(torch.cat((cos, cos), -1), emb.cos(), atol=0, rtol=0)
    torch.testing.assert_close(torch.cat((sin, sin), -1), emb.sin(), atol=0, rtol=0)


@pytest.mark.interpret
def test_positions_outside_the_tables_are_left_unrotated(dev):
    """A position outside the tables (a bad device value the host never sees) leaves its token unrotated, in
    the kernel and in the reference alike; the other tokens rotate as usual."""
    qkv, positions, cache = make(1, 5, 2, 1, 16, 7, torch.float32, dev, seed=11)
    positions[0, 1], positions[0, 3] = 320, -2  # the tables below have 320 rows
    q, q_ref, (k, v, k_ref, v_ref) = run_both(qkv, positions, cache, 1, 2, 1)
    close(q, q_ref)
    close(k, k_ref)
    close(v, v_ref)
    for t in (1, 3):
        close(q[0, t].flatten(), qkv[0, t, :32])
        close(k[0, 0, 1 + t], qkv[0, t, 32:48])


@pytest.mark.interpret
def test_rope_properties_without_the_reference(dev):
    """Position 0 is the identity, other positions rotate, and every rotation preserves the norm."""
    dh = 24
    qkv = randn(1, 1, 3 * dh, dev=dev, seed=9).expand(1, 4, 3 * dh).contiguous()  # one vector, 4 positions
    cos, sin = K.rope_cos_sin(64, dh, device=dev)
    kc, vc = torch.zeros(1, 1, 8, dh, device=dev), torch.zeros(1, 1, 8, dh, device=dev)
    q = K.qkv_rope_cache(qkv, torch.tensor([[0, 5, 17, 40]], device=dev), cos, sin, kc, vc, 0,
                         num_q_heads=1, num_kv_heads=1, backend="triton")[0, :, 0]
    close(q[0], qkv[0, 0, :dh])
    close(kc[0, 0, 0], qkv[0, 0, dh:2 * dh])
    assert not torch.allclose(q[1], q[0], atol=1e-3)
    close(q.norm(dim=-1), qkv[0, :, :dh].norm(dim=-1))


@pytest.mark.interpret
def test_relative_position_invariance(dev):
    dh = 24
    vec = randn(3 * dh, dev=dev, seed=11)
    cos, sin = K.rope_cos_sin(128, dh, device=dev)

    def qk(pq, pk):
        qkv = vec.expand(1, 2, 3 * dh).contiguous()
        kc, vc = torch.zeros(1, 1, 2, dh, device=dev), torch.zeros(1, 1, 2, dh, device=dev)
        q = K.qkv_rope_cache(qkv, torch.tensor([[pq, pk]], device=dev), cos, sin, kc, vc, 0,
                             num_q_heads=1, num_kv_heads=1, backend="triton")
        return (q[0, 0, 0] @ kc[0, 0, 1]).item()

    assert qk(10, 3) == pytest.approx(qk(60, 53), rel=1e-4, abs=1e-4)
    assert qk(3, 10) == pytest.approx(qk(100, 107), rel=1e-4, abs=1e-4)
    assert qk(3, 10) != pytest.approx(qk(10, 3), rel=1e-3)  # not symmetric: the rotation is real


@pytest.mark.interpret
def test_launcher_errors_name_the_argument(dev):
    b, t, hq, hkv, dh, s = 2, 7, 8, 1, 24, 19
    qkv, positions, cache = make(b, t, hq, hkv, dh, s, torch.float32, dev)
    cos, sin = K.rope_cos_sin(320, dh, device=dev)

    def call(**kw):
        args = dict(qkv=qkv, positions=positions, cos=cos, sin=sin, k_cache=cache.clone(),
                    v_cache=cache.clone(), cache_offset=0, num_q_heads=hq, num_kv_heads=hkv, backend="triton")
        args.update(kw)
        return K.qkv_rope_cache(**args)

    with pytest.raises(KernelInputError, match="`qkv` last dim"):
        call(num_q_heads=7)
    with pytest.raises(KernelInputError, match="head_dim 23 must be even"):
        call(qkv=randn(b, t, 10 * 23, dev=dev), cos=cos[:, :11].contiguous(), sin=sin[:, :11].contiguous())
    with pytest.raises(KernelInputError, match="`positions` has dtype"):
        call(positions=positions.float())
    with pytest.raises(KernelInputError, match="`positions` has shape"):
        call(positions=positions[:, :3].contiguous())
    with pytest.raises(KernelInputError, match="`cache_offset` 13"):
        call(cache_offset=13)
    with pytest.raises(KernelInputError, match="`k_cache`"):
        call(k_cache=torch.zeros(b, 2, s, dh, device=dev))
    with pytest.raises(KernelInputError, match="`v_cache`"):
        call(v_cache=torch.zeros(b, hkv, s + 1, dh, device=dev))
    with pytest.raises(KernelInputError, match="`cos`"):
        call(cos=cos[:, :5].contiguous())
    with pytest.raises(KernelInputError, match="`cache_offset`"):
        call(cache_offset=torch.zeros(3, dtype=torch.int64, device=dev))


@pytest.mark.gpu
@pytest.mark.skipif(interpreting(), reason="full shapes are too slow for the Triton interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_full_shapes_on_cuda(dtype):
    for t, s, offset in ((560, 610, 0), (50, 610, 560)):  # prefix fill, then suffix behind it
        qkv, positions, cache = make(1, t, 8, 1, 256, s, dtype, "cuda", seed=t)
        q, q_ref, (k, v, k_ref, v_ref) = run_both(qkv, positions, cache, offset, 8, 1)
        close(q, q_ref)
        close(k, k_ref)
        close(v, v_ref)


@pytest.mark.gpu
@pytest.mark.skipif(interpreting(), reason="full shapes are too slow for the Triton interpreter")
def test_constant_positions_are_bit_identical_at_the_expert_shape_on_cuda():
    """The compiled early form (positions and cos / sin rows before the PDL wait) at the expert's shape (50
    tokens behind a 560-token prefix, 8 q heads, 1 kv head, head dim 256): bit for bit the plain kernel's q,
    k and v."""
    qkv, _, cache = make(1, 50, 8, 1, 256, 610, torch.bfloat16, "cuda", seed=7)
    positions = (530 + torch.arange(50, device="cuda"))[None]
    cos, sin = K.rope_cos_sin(610, 256, device="cuda")
    plain_and_early(qkv, positions, cos, sin, cache, 0, 8, 1)
