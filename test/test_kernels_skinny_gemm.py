"""The skinny Triton GEMM (`kernels.skinny_gemm`) against F.linear and the separate reference ops: every launch
configuration the engine's picker may choose, GeGLU, fp32 rows into a bf16 GEMM, the gated residual added in
place, deferred split-K partials, and the tickets of its in-kernel reduction.
Interpreter by default (TRITON_INTERPRET=1); with TRITON_INTERPRET=0 on CUDA the same tests run compiled."""
from kernel_testing import dev  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_core.kernels._common import KernelInputError, interpreting  # noqa: E402
from flashrt_core.kernels.skinny_gemm import GatedResidual, skinny_linear  # noqa: E402
from flashrt_core.engine.gemm import CONFIGS, LinearPicker, _kwargs, splits  # noqa: E402

TOL = {
    "gemm_fp32": 1e-5,  # skinny GEMM vs F.linear, fp32 (relative to the output's max)
    "fused_gemm_fp32": 2e-5,  # skinny GEMM with the gated residual vs the separate ops, fp32
    "fused_gemm_bf16": 3e-2,  # ... bf16 (the product is rounded before it is added, as the separate ops do)
}


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k,bias,geglu,split,preload", [
    (50, 40, 72, True, False, 1, 0), (7, 33, 129, False, False, 2, 0), (50, 24, 300, True, False, 4, 0),
    (13, 2 * 20, 40, False, True, 1, 0), (1, 16, 8, True, False, 1, 0), (130, 24, 100, True, False, 4, 0),
    (13, 2 * 20, 70, False, True, 2, 0), (50, 24, 96, True, False, 0, 0), (9, 2 * 16, 64, False, True, 0, 0),
    # preload: the first tiles before the PDL wait; more than a split holds (300 / 4 -> 96 = 3 steps < 4),
    # a ragged last split (129 = 2 x 96 - 63), all of a split (2 steps), GEGLU with a loop left after it
    (50, 24, 300, True, False, 4, 4), (7, 33, 129, False, False, 2, 2), (50, 40, 72, True, False, 1, 1),
    (13, 2 * 20, 200, False, True, 1, 2), (19, 24, 128, False, False, 2, 2), (1, 16, 8, True, False, 1, 2)],
    ids=lambda v: str(v))
def test_skinny_linear_matches_f_linear(dev, m, n, k, bias, geglu, split, preload):
    g = torch.Generator().manual_seed(m * n + k + preload)
    x = torch.randn(m, k, generator=g).to(dev)
    w = torch.randn(n, k, generator=g).to(dev)
    b = torch.randn(n, generator=g).to(dev) if bias else None
    got = skinny_linear(x[None], w, b, geglu=geglu, block_n=16, block_k=32, split_k=split, preload=preload)
    want = F.linear(x, w, b)
    if geglu:
        gate, up = want.chunk(2, dim=-1)
        want = F.gelu(gate, approximate="tanh") * up
    assert got.shape == (1, *want.shape)
    assert (got[0] - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()


@pytest.mark.interpret
@pytest.mark.parametrize("geglu", [False, True], ids=["linear", "geglu"])
def test_every_gemm_candidate_computes_f_linear(dev, geglu):
    """Each launch configuration the GEMM picker may choose (looped K, split-K, one K slice per program, weight
    tiles requested before the PDL wait) gives
    F.linear (GeGLU after it) on a small odd shape: the picker checks a candidate against cuBLAS before
    timing it, this keeps unusable ones out of the list."""
    g = torch.Generator().manual_seed(7 + geglu)
    m, n, k = 11, 40, 1096  # k: more than one step of every BLOCK_K, with a ragged last step
    x = torch.randn(m, k, generator=g).to(dev)
    w = torch.randn((2 if geglu else 1) * n, k, generator=g).to(dev)
    b = None if geglu else torch.randn(n, generator=g).to(dev)
    want = F.linear(x, w, b)
    if geglu:
        gate, up = want.chunk(2, dim=-1)
        want = F.gelu(gate, approximate="tanh") * up
    for config in CONFIGS:
        got = skinny_linear(x, w, b, geglu=geglu, **_kwargs(config))
        assert (got - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max(), config


@pytest.mark.interpret
@pytest.mark.parametrize("one_step", [False, True])
def test_skinny_linear_takes_fp32_rows_and_an_fp32_residual_under_a_bf16_weight(dev, one_step):
    """The flow step's two GEMMs in a bf16 engine: fp32 rows into a bf16 GEMM are rounded to bf16 on load
    (action in; vs F.linear of the rounded rows), and an fp32 residual stream gets x += gate * bf16(x w^T + b)
    (action out with the Euler update: the velocity exactly as the plain call stores it). bf16 rows under an
    fp32 weight (pi0's fp32 action out over the bf16 final norm) are widened on load, exactly; fp16 rows under
    a bf16 weight are refused."""
    g = torch.Generator().manual_seed(12)
    m, k, n = 7, 48, 24
    x = (torch.randn(m, k, generator=g) + 0.3).to(dev)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, torch.bfloat16)
    b = torch.randn(n, generator=g).to(dev, torch.bfloat16)
    kw = dict(block_n=16, block_k=16, split_k=0 if one_step else 2)
    y = skinny_linear(x, w, b, **kw)
    want = F.linear(x.to(torch.bfloat16).float(), w.float(), b.float())
    assert y.dtype == torch.bfloat16
    assert (y.float() - want).abs().max() <= TOL["fused_gemm_bf16"] * want.abs().max()
    state = torch.randn(m, n, generator=g).to(dev)
    dt = torch.full((n,), -0.1, device=dev)
    # the update adds the velocity as this kernel stores it in bf16 (y above), in fp32 (one FMA's rounding)
    expected = state + dt * y.float()
    got = skinny_linear(x, w, b, residual=GatedResidual(state, dt), **kw)
    assert got is state and got.dtype == torch.float32
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()
    xb, w32 = x.to(torch.bfloat16), w.float() + 1e-3  # (an fp32 weight off the bf16 grid)
    wide = skinny_linear(xb, w32, b.float(), **kw)
    want = F.linear(xb.float(), w32, b.float())
    assert wide.dtype == torch.float32 and (wide - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()
    with pytest.raises(KernelInputError, match="rounded on load"):
        skinny_linear(x.to(torch.float16), w, **kw)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split", [1, 2, 0])
def test_skinny_linear_silu_epilogue_is_f_silu_of_the_stored_product(dev, dtype, split):
    """silu=True (pi0's action-time MLP): silu of the product + bias as the plain call stores it, the same as
    F.silu after the GEMM (one rounding of the result in bf16); through the picker too; refused with GeGLU, a
    residual or deferred partials."""
    g = torch.Generator().manual_seed(21 + split)
    m, k, n = 11, 72, 40
    x = torch.randn(m, k, generator=g).to(dev, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype)
    b = torch.randn(n, generator=g).to(dev, dtype)
    kw = dict(block_n=16, block_k=16 if split == 0 else 32, split_k=split)
    got = skinny_linear(x, w, b, silu=True, **kw)
    want = F.silu(skinny_linear(x, w, b, **kw))
    tol = TOL["gemm_fp32"] if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    picker = LinearPicker(dev, mode="triton")
    assert (picker(x, w, b, silu=True).float() - want.float()).abs().max() <= tol * want.float().abs().max()
    plain = LinearPicker(dev, mode="torch")(x, w, b, silu=True)
    assert (plain.float() - F.silu(F.linear(x, w, b)).float()).abs().max() == 0
    with pytest.raises(KernelInputError, match="silu"):
        skinny_linear(x, torch.cat((w, w)), silu=True, geglu=True, **kw)
    with pytest.raises(KernelInputError, match="silu"):
        skinny_linear(x, w, silu=True, defer=True, **kw)
    with pytest.raises(KernelInputError, match="silu"):
        picker(x, w, silu=True, defer=True)


@pytest.mark.gpu
@pytest.mark.skipif(interpreting(), reason="the interpreter truncates fp32 -> bf16 instead of rounding")
def test_fp32_rows_are_rounded_on_load_like_the_bf16_rows_on_cuda():
    """The compiled kernel's rounding of fp32 rows under a bf16 weight is the cast's (round to nearest even):
    every candidate gives bit for bit the result of the same call on x.bfloat16(), at the flow step's two
    shapes (action in: K = 32, N = 1024; action out: K = 1024, N = 32, with the fp32 state as residual). A
    candidate whose fp32 row tiles do not fit in shared memory is refused at launch (the tuning skips it)."""
    from triton.runtime.errors import OutOfResources

    g = torch.Generator().manual_seed(21)
    for k, n in ((32, 1024), (1024, 32)):
        x = (torch.randn(50, k, generator=g) + 0.3).cuda()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
        b = torch.randn(n, generator=g).to("cuda", torch.bfloat16)
        dt = torch.full((n,), -0.1, device="cuda")
        state = torch.randn(50, n, generator=g).cuda()
        truncated = (x.view(torch.int32) & -65536).view(torch.float32)  # what a truncating cast would give
        assert (truncated != x.bfloat16().float()).float().mean() > 0.3
        ran = 0
        for config in CONFIGS:
            kw = _kwargs(config)
            try:  # (the bf16 form, whose row tiles are staged in shared memory, may be the one refused)
                got, want = skinny_linear(x, w, b, **kw), skinny_linear(x.bfloat16(), w, b, **kw)
                got_r = skinny_linear(x, w, b, residual=GatedResidual(state.clone(), dt), **kw)
                want_r = skinny_linear(x.bfloat16(), w, b, residual=GatedResidual(state.clone(), dt), **kw)
            except OutOfResources:
                continue
            ran += 1
            assert torch.equal(got, want) and torch.equal(got_r, want_r), config
        assert ran >= len(CONFIGS) // 2, (k, n, ran)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k,bias,split,preload", [
    (50, 40, 72, False, 1, 0), (7, 33, 100, True, 4, 0), (13, 24, 64, False, 0, 0), (50, 33, 40, False, 1, 0),
    (7, 33, 200, True, 2, 2)], ids=lambda v: str(v))
def test_skinny_linear_adds_into_the_residual_stream(dev, dtype, m, n, k, bias, split, preload):
    """residual=GatedResidual: res += gate * result in place (and res is returned), against F.linear and the
    separate add, over every split mode (one program per K, split-K, one BLOCK_K slice per program, tiles
    preloaded)."""
    g = torch.Generator().manual_seed(m + 7 * n + k)
    x = (torch.randn(1, m, k, generator=g) * 3 + 0.5).to(dev, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype)
    res, gate = torch.randn(1, m, n, generator=g).to(dev, dtype), torch.randn(n, generator=g).to(dev, dtype)
    b = torch.randn(n).to(dev, dtype) if bias else None
    want = res.float() + F.linear(x.float(), w.float(), None if b is None else b.float()) * gate.float()
    got = skinny_linear(x, w, b, block_n=16, block_k=32, split_k=split, preload=preload,
                        residual=GatedResidual(res, gate))
    assert got is res  # updated in place
    tol = TOL["fused_gemm_fp32" if dtype == torch.float32 else "fused_gemm_bf16"]
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.interpret
def test_skinny_linear_rejects_a_mismatched_residual(dev):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 5, 32, generator=g).to(dev), torch.randn(16, 32, generator=g).to(dev)
    res, gate = torch.randn(1, 5, 16, generator=g).to(dev), torch.randn(16, generator=g).to(dev)
    with pytest.raises(KernelInputError, match="residual must be"):
        skinny_linear(x, w, residual=GatedResidual(res[:, :-1], gate))
    with pytest.raises(KernelInputError, match="gate"):
        skinny_linear(x, w, residual=GatedResidual(res, gate[:-1]))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k,split", [(50, 40, 72, 1), (7, 48, 129, 2), (13, 24, 300, 4), (5, 16, 96, 0),
                                         (19, 40, 200, 3)], ids=str)
def test_deferred_partials_add_up_to_the_reduced_gemm_bit_for_bit(dev, dtype, m, n, k, split):
    """skinny_linear(defer=True) leaves its split-K partials; summed by the gated residual + AdaRMS kernel (and
    by its torch reference) they give exactly what the GEMM's own in-kernel reduction stores, and the
    norm's outputs are then bit-identical to those after the reduced GEMM."""
    from flashrt_core import kernels as K

    g = torch.Generator().manual_seed(m + n + k + split)
    x = torch.randn(2, m, k, generator=g).to(dev, dtype)
    w = (0.2 * torch.randn(n, k, generator=g)).to(dev, dtype)
    res = torch.randn(2, m, n, generator=g).to(dev, dtype)
    gate, scale, shift = (torch.randn(n, generator=g).to(dev, dtype) for _ in range(3))
    kw = dict(block_n=16, block_k=32, split_k=split)
    parts = skinny_linear(x, w, defer=True, **kw)
    reduced = skinny_linear(x, w, **kw)
    assert isinstance(parts, K.Partials) and parts.splits == splits((16, 32, split), k)
    assert parts.splits == (-(-k // 32) if split == 0 else split) or k % 32  # (a ragged K may need fewer)
    assert parts.data.abs().min(0).values.max() > 0  # every split contributed
    # The Triton kernels round fp32 -> bf16 alike (the interpreter truncates, the GPU rounds to nearest;
    # torch rounds to nearest): bit for bit between the two kernel paths, in fp32 with torch too.
    exact = dtype == torch.float32 or not interpreting()
    tol = TOL["gemm_fp32"] if dtype == torch.float32 else 2e-2
    total = parts.total()
    assert torch.equal(total, reduced) if exact else (total.float() - reduced.float()).abs().max() <= \
        2 ** -7 * reduced.float().abs().max()
    want = F.linear(x.float(), w.float())
    assert (total.float() - want).abs().max() <= tol * want.abs().max()
    for backend in ("triton", "torch"):
        got = K.gated_residual_ada_rms_norm(res, parts, gate, scale, shift, 1e-6, backend=backend)
        ref = K.gated_residual_ada_rms_norm(res, reduced, gate, scale, shift, 1e-6, backend=backend)
        if backend == "triton" or exact:
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), backend
        else:
            for a, b in zip(got, ref):
                assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
    assert torch.equal(K.gated_residual(res, parts, gate, backend="triton"),
                       K.gated_residual(res, reduced, gate, backend="triton"))


@pytest.mark.interpret
def test_deferred_partials_refuse_what_they_cannot_carry(dev):
    """defer= is for a plain product (a bias, GeGLU or a residual would need the sum first), and a reader
    refuses partials that do not fit its rows, with a KernelInputError naming the problem."""
    from flashrt_core import kernels as K

    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(6, 64, generator=g).to(dev), torch.randn(32, 64, generator=g).to(dev), \
        torch.randn(32, generator=g).to(dev)
    with pytest.raises(KernelInputError, match="defer"):
        skinny_linear(x, w, b, defer=True)
    with pytest.raises(KernelInputError, match="defer"):
        skinny_linear(x, w.repeat(2, 1), geglu=True, defer=True)
    with pytest.raises(KernelInputError, match="defer"):
        skinny_linear(x, w, defer=True, residual=GatedResidual(torch.zeros(6, 32, device=dev), b))
    with pytest.raises(KernelInputError, match="defer"):
        LinearPicker(dev)(x, w, b, defer=True)
    parts = skinny_linear(x, w, defer=True, block_n=16, block_k=16, split_k=2)
    res, vec = torch.randn(6, 32, generator=g).to(dev), torch.randn(32, generator=g).to(dev)
    for wrong in (torch.randn(7, 32).to(dev), res.half(), torch.randn(6, 16).to(dev)):
        with pytest.raises(KernelInputError, match="partials"):
            K.gated_residual_ada_rms_norm(wrong, parts, vec, vec, vec, backend="triton")
    bad = K.Partials(parts.data.to(torch.bfloat16), parts.dtype, parts.shape)
    with pytest.raises(KernelInputError, match="partials"):
        K.gated_residual_ada_rms_norm(res, bad, vec, vec, vec, backend="triton")


@pytest.mark.interpret
def test_split_k_tickets_are_reset_so_a_workspace_serves_call_after_call(dev):
    """The last program of each tile reduces the split partials and resets its ticket: a shared workspace
    is all zero again after every call, and repeated calls give bit-identical results."""
    from flashrt_core.kernels._common import new_semaphore_workspace, semaphore_workspace

    g = torch.Generator().manual_seed(7)
    x, w, b = (torch.randn(*s, generator=g).to(dev) for s in ((37, 96), (40, 96), (40,)))
    tickets = new_semaphore_workspace(dev, 64)
    with semaphore_workspace(tickets):
        first = skinny_linear(x, w, b, block_n=16, block_k=16, split_k=3)
        assert int(tickets.abs().sum()) == 0
        second = skinny_linear(x, w, b, block_n=16, block_k=16, split_k=3)
    assert int(tickets.abs().sum()) == 0
    assert torch.equal(first, second)
    want = F.linear(x, w, b)
    assert (first - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()
