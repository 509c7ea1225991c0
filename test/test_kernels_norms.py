"""RMSNorm, residual + RMSNorm, AdaRMS, gated residual (+ AdaRMS), LayerNorm (+ residual) vs torch references.

Runs the Triton kernels in the CPU interpreter (TRITON_INTERPRET=1, the default here) or, with
TRITON_INTERPRET=0 on a CUDA machine, compiled on the GPU at the same small odd shapes.
"""
from kernel_testing import dev, assert_close  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels import reference as R  # noqa: E402
from flashrt_core.kernels._common import KernelInputError, interpreting  # noqa: E402

# (atol, rtol) of a kernel output against its reference, per dtype. bf16/fp16 outputs are rounded once by
# each side, so they may differ by an ulp of the output (2^-8 / 2^-11 relative).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def close(out, ref):
    assert_close(out, ref, TOL)


def randn(*shape, dtype=torch.float32, dev="cpu", seed=0, mean=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) + mean).to(dtype).to(dev)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(7, 40), (3, 5, 72), (13, 24)]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weight_offset", [1.0, 0.0])
def test_rms_norm(dev, dtype, shape, weight_offset):
    x = randn(*shape, dtype=dtype, dev=dev, seed=1)
    w = randn(shape[-1], dev=dev, seed=2)
    out = K.rms_norm(x, w, 1e-6, weight_offset=weight_offset, backend="triton")
    close(out, R.rms_norm_ref(x, w, 1e-6, weight_offset=weight_offset))


@pytest.mark.interpret
def test_rms_norm_prefolded_weight_equals_gemma_form(dev):
    x, w = randn(7, 40, dev=dev, seed=3), randn(40, dev=dev, seed=4)
    folded = K.rms_norm(x, 1.0 + w, weight_offset=0.0, backend="triton")
    close(folded, K.rms_norm(x, w, backend="triton"))
    # Independent of the reference: Gemma's formula written out.
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    close(folded, expect)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rms_norm_and_in_place(dev, dtype):
    x, res = randn(3, 5, 72, dtype=dtype, dev=dev, seed=5), randn(3, 5, 72, dtype=dtype, dev=dev, seed=6)
    w = randn(72, dev=dev, seed=7)
    new_res, y = K.add_rms_norm(x, res, w, backend="triton")
    ref_res, ref_y = R.add_rms_norm_ref(x, res, w)
    close(new_res, ref_res)
    close(y, ref_y)
    out = torch.empty_like(x)
    res_copy = res.clone()
    r2, y2 = K.add_rms_norm(x, res_copy, w, out=out, residual_out=res_copy, backend="triton")
    assert r2.data_ptr() == res_copy.data_ptr() and y2.data_ptr() == out.data_ptr()
    close(res_copy, ref_res)
    close(out, ref_y)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_batch", [True, False], ids=["mod[B,D]", "mod[D]"])
@pytest.mark.parametrize("constant_mod", [False, True], ids=["mod-after-wait", "mod-before-wait"])
def test_ada_rms_norm(dev, dtype, per_batch, constant_mod):
    b, t, d = 3, 5, 40
    x = randn(b, t, d, dtype=dtype, dev=dev, seed=8)
    mshape = (b, d) if per_batch else (d,)
    scale, shift = randn(*mshape, dtype=dtype, dev=dev, seed=9), randn(*mshape, dtype=dtype, dev=dev, seed=10)
    close(K.ada_rms_norm(x, scale, shift, constant_mod=constant_mod, backend="triton"),
          R.ada_rms_norm_ref(x, scale, shift))


@pytest.mark.interpret
def test_ada_rms_norm_reads_strided_views_of_a_modulation_table(dev):
    """scale | shift | gate as chunks of one [B, 3D] dense output, like LeRobot's modulation.chunk(3)."""
    b, t, d = 2, 7, 24
    x, h = randn(b, t, d, dev=dev, seed=11), randn(b, t, d, dev=dev, seed=12)
    mod = randn(b, 3 * d, dev=dev, seed=13)
    scale, shift, gate = mod.chunk(3, dim=-1)
    assert not scale.is_contiguous()
    new_x, y = K.gated_residual_ada_rms_norm(x, h, gate, scale, shift, backend="triton")
    close(new_x, x + h * gate[:, None, :])
    ref = R.ada_rms_norm_ref(x + h * gate[:, None, :], scale, shift)
    close(y, ref)
    # Independent form of AdaRMS.
    xr = x + h * gate[:, None, :]
    close(y, xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + scale[:, None]) + shift[:, None])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_shape", [(3, 5, 40), (3, 40)], ids=str)
@pytest.mark.parametrize("constant_mod", [False, True], ids=["mod-after-wait", "mod-before-wait"])
def test_gated_residual_and_fused(dev, dtype, x_shape, constant_mod):
    d = x_shape[-1]
    x, h = randn(*x_shape, dtype=dtype, dev=dev, seed=14), randn(*x_shape, dtype=dtype, dev=dev, seed=15)
    gate, scale, shift = (randn(3, d, dtype=dtype, dev=dev, seed=s) for s in (16, 17, 18))
    close(K.gated_residual(x, h, gate, backend="triton"), R.gated_residual_ref(x, h, gate))
    close(K.gated_residual(x, h, gate[0], backend="triton"), R.gated_residual_ref(x, h, gate[0]))
    new_x, y = K.gated_residual_ada_rms_norm(x, h, gate, scale, shift, constant_mod=constant_mod, backend="triton")
    ref_x, ref_y = R.gated_residual_ada_rms_norm_ref(x, h, gate, scale, shift)
    close(new_x, ref_x)
    close(y, ref_y)
    inplace = x.clone()
    K.gated_residual(inplace, h, gate, out=inplace, backend="triton")
    close(inplace, ref_x)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm(dev, dtype, shape):
    x = randn(*shape, dtype=dtype, dev=dev, seed=19, mean=3.0)  # a large mean exercises the variance
    w, b = randn(shape[-1], dev=dev, seed=20), randn(shape[-1], dev=dev, seed=21)
    close(K.layer_norm(x, w, b, backend="triton"), R.layer_norm_ref(x, w, b))


@pytest.mark.interpret
def test_add_layer_norm(dev):
    x, res = randn(13, 72, dev=dev, seed=22), randn(13, 72, dev=dev, seed=23)
    w, b = randn(72, dev=dev, seed=24), randn(72, dev=dev, seed=25)
    new_res, y = K.add_layer_norm(x, res, w, b, backend="triton")
    close(new_res, res + x)
    close(y, torch.nn.functional.layer_norm(res + x, (72,), w, b, 1e-6))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_layer_norm_with_a_repeating_residual(dev, dtype):
    """A residual of x's trailing shape (SigLIP's position table under its images' patches) repeats over x's
    leading dims, as torch broadcasting adds it; the sum comes back in x's shape, rounded to the residual's
    dtype before the norm (what a separate add then a LayerNorm give). Odd shapes: 3 images x 5 patches x 72."""
    x, pos = randn(3, 5, 72, dtype=dtype, dev=dev, seed=26), randn(5, 72, dtype=dtype, dev=dev, seed=27, mean=1.0)
    w, b = randn(72, dev=dev, seed=28), randn(72, dev=dev, seed=29)
    new_res, y = K.add_layer_norm(x, pos, w, b, backend="triton")
    want = (x.float() + pos.float()).to(dtype)
    assert new_res.shape == x.shape and new_res.dtype == dtype
    close(new_res, want)
    close(y, R.layer_norm_ref(want, w, b).to(dtype))
    torch_res, torch_y = K.add_layer_norm(x, pos, w, b, backend="torch")
    close(torch_res, want)
    close(torch_y, y)
    for bad in (randn(4, 72, dev=dev, dtype=dtype), randn(2, 3, 5, 72, dev=dev, dtype=dtype)):
        with pytest.raises(KernelInputError, match="trailing part"):
            K.add_layer_norm(x, bad, w, b, backend="triton")


@pytest.mark.interpret
def test_launcher_errors_name_the_argument(dev):
    x, w = randn(7, 40, dev=dev), randn(40, dev=dev)
    with pytest.raises(KernelInputError, match="`weight`"):
        K.rms_norm(x, randn(39, dev=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`x` has dtype"):
        K.rms_norm(x.to(torch.int32), w, backend="triton")
    with pytest.raises(KernelInputError, match="`x` must be contiguous"):
        K.rms_norm(randn(40, 7, dev=dev).t(), w, backend="triton")
    with pytest.raises(KernelInputError, match="`residual`"):
        K.add_rms_norm(x, randn(7, 41, dev=dev), w, backend="triton")
    with pytest.raises(KernelInputError, match="`out`"):
        K.rms_norm(x, w, out=torch.empty(7, 41, device=dev), backend="triton")
    x3 = randn(3, 5, 40, dev=dev)
    with pytest.raises(KernelInputError, match="`scale`.*batch 3"):
        K.ada_rms_norm(x3, randn(2, 40, dev=dev), randn(3, 40, dev=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`gate`"):
        K.gated_residual(x3, x3, randn(3, 41, dev=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`bias`"):
        K.layer_norm(x, w, randn(41, dev=dev), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(interpreting(), reason="full shapes are too slow for the Triton interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_full_shapes_on_cuda(dtype):
    prefix = randn(1, 560, 2048, dtype=dtype, dev="cuda", seed=30)
    w = randn(2048, dev="cuda", seed=31) * 0.1
    close(K.rms_norm(prefix, w, backend="triton"), R.rms_norm_ref(prefix, w))
    new_res, y = K.add_rms_norm(prefix, prefix * 0.5, w, backend="triton")
    ref_res, ref_y = R.add_rms_norm_ref(prefix, prefix * 0.5, w)
    close(new_res, ref_res)
    close(y, ref_y)
    x, h = randn(1, 50, 1024, dtype=dtype, dev="cuda", seed=32), randn(1, 50, 1024, dtype=dtype, dev="cuda", seed=33)
    mod = randn(1, 3 * 1024, dtype=dtype, dev="cuda", seed=34)
    scale, shift, gate = mod.chunk(3, dim=-1)
    new_x, y = K.gated_residual_ada_rms_norm(x, h, gate, scale, shift, backend="triton")
    ref_x, ref_y = R.gated_residual_ada_rms_norm_ref(x, h, gate, scale, shift)
    close(new_x, ref_x)
    close(y, ref_y)
    siglip = randn(2, 256, 1152, dtype=dtype, dev="cuda", seed=35)
    lw, lb = randn(1152, dev="cuda", seed=36), randn(1152, dev="cuda", seed=37)
    close(K.layer_norm(siglip, lw, lb, backend="triton"), R.layer_norm_ref(siglip, lw, lb))
