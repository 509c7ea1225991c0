"""What the kernel test files share: the interpreter switch, the device fixture, seeded inputs, the check.

Import it before flashrt_core.kernels: Triton decides between interpreter and compiler when a kernel module
is first imported. Interpreter by default (TRITON_INTERPRET=1, CPU); with TRITON_INTERPRET=0 on CUDA the
same tests run compiled.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from flashrt_core.kernels._common import interpreting  # noqa: E402


@pytest.fixture(scope="module")
def dev():
    if interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("kernels need TRITON_INTERPRET=1 or CUDA")


def assert_close(out, ref, tol):
    """out == ref within tol[dtype] = (atol, rtol), same dtype and shape."""
    atol, rtol = tol[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def randn(*shape, dtype=torch.float32, dev="cpu", seed=0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).to(dtype).to(dev)
