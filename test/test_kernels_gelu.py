"""GeGLU (Gemma MLP) and bias + GELU (SigLIP fc1) kernels vs torch references.

Interpreter by default (TRITON_INTERPRET=1); with TRITON_INTERPRET=0 on CUDA the same tests run compiled.
"""
import kernel_testing
from kernel_testing import dev, assert_close  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels import reference as R  # noqa: E402
from flashrt_core.kernels._common import KernelInputError, interpreting  # noqa: E402

# (atol, rtol) per dtype: one output rounding on each side for bf16 / fp16.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def close(out, ref):
    assert_close(out, ref, TOL)


def randn(*shape, std=2.0, **kwargs):
    return kernel_testing.randn(*shape, std=std, **kwargs)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(13, 48), (2, 7, 80), (3, 2050)], ids=str)
def test_geglu(dev, dtype, shape):
    gu = randn(*shape, dtype=dtype, dev=dev, seed=1)
    out = K.geglu(gu, backend="triton")
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    close(out, R.geglu_ref(gu))


@pytest.mark.interpret
def test_geglu_gate_comes_first_and_saturates(dev):
    f = 24
    gate = torch.linspace(-40.0, 40.0, f, device=dev)  # far tails: gelu -> 0 and -> identity, no NaN/inf
    up = randn(f, dev=dev, seed=2)
    out = K.geglu(torch.cat([gate, up])[None], backend="triton")[0]
    close(out, F.gelu(gate, approximate="tanh") * up)
    assert torch.isfinite(out).all()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_bias_gelu(dev, dtype, with_bias):
    x = randn(7, 3, 72, dtype=dtype, dev=dev, seed=3)
    bias = randn(72, dtype=dtype, dev=dev, seed=4) if with_bias else None
    close(K.bias_gelu(x, bias, backend="triton"), R.bias_gelu_ref(x, bias))


@pytest.mark.interpret
def test_out_buffers(dev):
    gu = randn(7, 48, dev=dev, seed=5)
    out = torch.empty(7, 24, device=dev)
    assert K.geglu(gu, out=out, backend="triton").data_ptr() == out.data_ptr()
    close(out, R.geglu_ref(gu))


@pytest.mark.interpret
def test_launcher_errors_name_the_argument(dev):
    with pytest.raises(KernelInputError, match="`gate_up` last dim 47 must be even"):
        K.geglu(randn(7, 47, dev=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`gate_up` must be contiguous"):
        K.geglu(randn(48, 7, dev=dev).t(), backend="triton")
    with pytest.raises(KernelInputError, match="`out`"):
        K.geglu(randn(7, 48, dev=dev), out=torch.empty(7, 48, device=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`bias`"):
        K.bias_gelu(randn(7, 72, dev=dev), randn(71, dev=dev), backend="triton")
    with pytest.raises(KernelInputError, match="`x` has dtype"):
        K.bias_gelu(torch.ones(7, 72, dtype=torch.int64, device=dev), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(interpreting(), reason="full shapes are too slow for the Triton interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_full_shapes_on_cuda(dtype):
    for rows, f in ((560, 16384), (50, 4096)):  # prefix and action-expert MLPs
        gu = randn(1, rows, 2 * f, dtype=dtype, dev="cuda", seed=rows)
        close(K.geglu(gu, backend="triton"), R.geglu_ref(gu))
    x = randn(2, 256, 4304, dtype=dtype, dev="cuda", seed=7)  # SigLIP fc1 output
    bias = randn(4304, dtype=dtype, dev="cuda", seed=8)
    close(K.bias_gelu(x, bias, backend="triton"), R.bias_gelu_ref(x, bias))
