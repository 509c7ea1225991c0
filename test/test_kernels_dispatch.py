"""Backend dispatch of flashrt_core.kernels: auto / triton / torch, availability, static output buffers."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first kernel-module import

import pytest  # noqa: E402
import torch  # noqa: E402

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels import reference as R  # noqa: E402
from flashrt_core.kernels._common import KernelInputError, KernelUnavailableError, interpreting  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5)}


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.interpret
@pytest.mark.skipif(not interpreting(), reason="checks the CPU interpreter path")
def test_interpreter_runs_kernels_on_cpu_only_when_asked():
    assert K.available() and K.available("cpu")
    x, w = randn(7, 40, seed=1), randn(40, seed=2)
    # auto stays on the reference for CPU tensors (bit-identical), the interpreter runs on request.
    assert torch.equal(K.rms_norm(x, w), R.rms_norm_ref(x, w))
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(K.rms_norm(x, w, backend="triton"), R.rms_norm_ref(x, w), atol=atol, rtol=rtol)


def test_without_interpreter_cpu_tensors_use_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not K.available("cpu")
    assert K.available("cuda") == torch.cuda.is_available()
    x, w = randn(7, 40, seed=3), randn(40, seed=4)
    # auto falls back to the reference, which is bit-identical to calling it directly.
    assert torch.equal(K.rms_norm(x, w), R.rms_norm_ref(x, w))
    with pytest.raises(KernelUnavailableError, match="rms_norm: backend='triton'"):
        K.rms_norm(x, w, backend="triton")


def test_torch_backend_fills_static_buffers():
    x, res, w = randn(7, 40, seed=5), randn(7, 40, seed=6), randn(40, seed=7)
    out, res_out = torch.empty(7, 40), torch.empty(7, 40)
    new_res, y = K.add_rms_norm(x, res, w, out=out, residual_out=res_out, backend="torch")
    assert new_res.data_ptr() == res_out.data_ptr() and y.data_ptr() == out.data_ptr()
    ref_res, ref_y = R.add_rms_norm_ref(x, res, w)
    assert torch.equal(res_out, ref_res) and torch.equal(out, ref_y)
    gu = randn(5, 48, seed=8)
    buf = torch.empty(5, 24)
    assert torch.equal(K.geglu(gu, out=buf, backend="torch"), R.geglu_ref(gu))


def test_unknown_backend_is_rejected():
    with pytest.raises(KernelInputError, match="`backend` must be one of"):
        K.geglu(randn(5, 48), backend="cuda")


@pytest.mark.interpret
@pytest.mark.skipif(not interpreting(), reason="checks the CPU interpreter path")
def test_every_public_op_runs_on_both_backends():
    """One smoke call per op: both backends agree, so the CPU engine path and the kernel path match."""
    x, h, w, b = randn(2, 5, 24, seed=9), randn(2, 5, 24, seed=10), randn(24, seed=11), randn(24, seed=12)
    mod = randn(2, 72, seed=13)
    scale, shift, gate = mod.chunk(3, -1)
    qkv, pos = randn(2, 5, 4 * 16, seed=14), torch.arange(5).expand(2, 5).contiguous()
    cos, sin = K.rope_cos_sin(16, 16)
    img = torch.randint(0, 256, (1, 11, 19, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(15))
    calls = {
        "rms_norm": lambda be: K.rms_norm(x, w, backend=be),
        "add_rms_norm": lambda be: K.add_rms_norm(x, h, w, backend=be),
        "ada_rms_norm": lambda be: K.ada_rms_norm(x, scale, shift, backend=be),
        "gated_residual": lambda be: K.gated_residual(x, h, gate, backend=be),
        "gated_residual_ada_rms_norm": lambda be: K.gated_residual_ada_rms_norm(x, h, gate, scale, shift, backend=be),
        "geglu": lambda be: K.geglu(x, backend=be),
        "bias_gelu": lambda be: K.bias_gelu(x, b, backend=be),
        "layer_norm": lambda be: K.layer_norm(x, w, b, backend=be),
        "add_layer_norm": lambda be: K.add_layer_norm(x, h, w, b, backend=be),
        "qkv_rope_cache": lambda be: K.qkv_rope_cache(qkv, pos, cos, sin, torch.zeros(2, 1, 9, 16),
                                                      torch.zeros(2, 1, 9, 16), 2, num_q_heads=2,
                                                      num_kv_heads=1, backend=be),
        "attention": lambda be: K.attention(qkv.view(2, 5, 4, 16), qkv.view(2, 5, 4, 16)[:, :, :1].transpose(1, 2),
                                            qkv.view(2, 5, 4, 16)[:, :, 1:2].transpose(1, 2), backend=be),
        "preprocess_images": lambda be: K.preprocess_images(img, 16, backend=be),
    }
    assert set(calls) | {"available", "KernelInputError", "KernelUnavailableError", "rope_cos_sin",
                         "resized_hw", "new_semaphore_workspace", "semaphore_workspace", "pdl_scope",
                         "Partials"} == set(K.__all__)
    for name, call in calls.items():
        got, want = call("triton"), call("torch")
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
