"""SwiGLU (Llama / SmolVLA MLP: silu(gate) * up) kernel vs its torch reference.

Interpreter by default (TRITON_INTERPRET=1); with TRITON_INTERPRET=0 on CUDA the same tests run compiled.
"""
import kernel_testing
from kernel_testing import dev, assert_close  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels._common import KernelInputError  # noqa: E402

# (atol, rtol) per dtype: one output rounding on each side for bf16 / fp16.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(13, 48), (2, 7, 80), (3, 2050)], ids=str)
def test_swiglu_matches_reference(dev, dtype, shape):
    gu = kernel_testing.randn(*shape, dtype=dtype, dev=dev, seed=1, std=3.0)
    out = K.swiglu(gu, backend="triton")
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(out, K.swiglu_ref(gu), TOL)


@pytest.mark.interpret
def test_swiglu_gate_comes_first_and_saturates(dev):
    f = 24
    gate = torch.linspace(-90.0, 90.0, f, device=dev)  # far tails: silu -> 0 and -> identity, no NaN / inf
    up = kernel_testing.randn(f, dev=dev, seed=2)
    out = K.swiglu(torch.cat([gate, up])[None], backend="triton")[0]
    assert_close(out, F.silu(gate) * up, TOL)
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, F.silu(up) * gate)  # the halves are not interchangeable


@pytest.mark.interpret
def test_swiglu_out_buffer_and_refusals(dev):
    gu = kernel_testing.randn(5, 40, dev=dev, seed=3)
    out = torch.empty(5, 20, device=dev)
    assert K.swiglu(gu, out=out, backend="triton") is out
    assert_close(out, K.swiglu_ref(gu), TOL)
    with pytest.raises(KernelInputError, match="even"):
        K.swiglu(gu[:, :39].contiguous(), backend="triton")
    torch_out = torch.empty(5, 20, device=dev)
    assert K.swiglu(gu, out=torch_out, backend="torch") is torch_out
