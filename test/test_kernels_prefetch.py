"""L2 prefetch from inside the glue kernels (`kernels._prefetch`): argument checks, byte ranges, and that a
kernel given tensors to prefetch computes exactly what it computes without (interpreter: the prefetch is
off there, so this checks the plumbing; CUDA sm_90+: the compiled PTX prefetch really runs)."""
from kernel_testing import dev, randn  # noqa: F401  (sets TRITON_INTERPRET before the kernel imports)

import pytest  # noqa: E402
import torch  # noqa: E402

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels._common import KernelInputError, interpreting  # noqa: E402
from flashrt_core.kernels._prefetch import MAX_RANGES, byte_range, prefetch_args, prefetch_supported  # noqa: E402


def test_byte_range_covers_the_tensor_on_16_byte_boundaries():
    block = torch.randn(1000, dtype=torch.float32)
    for start, n in ((0, 1000), (3, 17), (5, 1), (999, 1)):
        view = block[start:start + n]
        address, size = byte_range(view)
        assert address % 16 == 0 and size % 16 == 0
        assert address <= view.data_ptr() and address > view.data_ptr() - 16
        end = view.data_ptr() + n * 4
        assert address + size >= end and address + size < end + 16


def test_prefetch_args_check_their_tensors():
    x = torch.randn(8, 8)
    with pytest.raises(KernelInputError, match="at most 2"):
        prefetch_args("op", x.device, [x] * (MAX_RANGES + 1))
    with pytest.raises(KernelInputError, match=r"`prefetch\[0\]` must be a torch.Tensor"):
        prefetch_args("op", x.device, [3])
    with pytest.raises(KernelInputError, match=r"`prefetch\[1\]` must be contiguous"):
        prefetch_args("op", x.device, [x, x.t()])
    if torch.cuda.is_available():
        with pytest.raises(KernelInputError, match="expected cuda"):
            prefetch_args("op", torch.device("cuda", 0), [x])
    # Off where it cannot run: every range zero, PREFETCH False.
    assert prefetch_args("op", x.device, [x]) == {"PF_A0": 0, "PF_N0": 0, "PF_A1": 0, "PF_N1": 0,
                                                  "PREFETCH": False}
    assert prefetch_args("op", x.device, None)["PREFETCH"] is False


def test_prefetch_args_give_each_tensors_range_where_supported(monkeypatch):
    from flashrt_core.kernels import _prefetch

    monkeypatch.setattr(_prefetch, "prefetch_supported", lambda device: True)
    a, b = torch.randn(100), torch.randn(7, dtype=torch.bfloat16)
    args = prefetch_args("op", a.device, [a, b])
    assert args["PREFETCH"] is True
    assert (args["PF_A0"], args["PF_N0"]) == byte_range(a) and (args["PF_A1"], args["PF_N1"]) == byte_range(b)
    one = prefetch_args("op", a.device, [b])
    assert (one["PF_A0"], one["PF_N0"], one["PF_A1"], one["PF_N1"]) == (*byte_range(b), 0, 0)


def test_prefetch_is_off_on_cpu_and_by_environment(monkeypatch):
    assert not prefetch_supported("cpu")
    monkeypatch.setenv("FLASHRT_L2_PREFETCH", "0")
    assert not prefetch_supported("cuda")


@pytest.mark.interpret
def test_glue_kernels_compute_the_same_with_prefetch(dev):
    """ada_rms_norm, gated_residual_ada_rms_norm and qkv_rope_cache on random inputs, with two large tensors
    (one a strided-offset view of a bigger block) to prefetch vs without: identical outputs (and the
    references within the kernels' tolerance; the references ignore `prefetch`)."""
    if dev == "cuda" and not prefetch_supported(dev):
        pytest.skip("bulk L2 prefetch needs sm_90+")
    rows, d = 6, 48
    block = randn(3 << 20 if dev == "cuda" else 4096, dev=dev, seed=9)
    far = (block[1:4097] if dev == "cpu" else block[16:(2 << 20) + 16], randn(64, 33, dev=dev, seed=8))
    x, h = randn(2, rows, d, dev=dev, seed=1), randn(2, rows, d, dev=dev, seed=2)
    gate, scale, shift = (randn(d, dev=dev, seed=s) for s in (3, 4, 5))
    plain = K.ada_rms_norm(x, scale, shift, backend="triton")
    warmed = K.ada_rms_norm(x, scale, shift, prefetch=far, backend="triton")
    assert torch.equal(plain, warmed)
    torch.testing.assert_close(warmed, K.ada_rms_norm(x, scale, shift, prefetch=far, backend="torch"),
                               atol=1e-5, rtol=1e-5)
    new_x, y = K.gated_residual_ada_rms_norm(x, h, gate, scale, shift, backend="triton")
    new_x2, y2 = K.gated_residual_ada_rms_norm(x, h, gate, scale, shift, prefetch=far[:1], backend="triton")
    assert torch.equal(new_x, new_x2) and torch.equal(y, y2)
    hq, hkv, dh, t = 3, 1, 16, 5
    qkv = randn(1, t, (hq + 2 * hkv) * dh, dev=dev, seed=6)
    positions = torch.arange(2, 2 + t, device=dev)[None]
    cos, sin = K.rope_cos_sin(16, dh, 10000.0, device=dev)
    caches = [torch.zeros(1, hkv, 8, dh, device=dev) for _ in range(4)]
    q = K.qkv_rope_cache(qkv, positions, cos, sin, caches[0], caches[1], 1, num_q_heads=hq, num_kv_heads=hkv,
                         backend="triton")
    q2 = K.qkv_rope_cache(qkv, positions, cos, sin, caches[2], caches[3], 1, num_q_heads=hq, num_kv_heads=hkv,
                          prefetch=far, backend="triton")
    assert torch.equal(q, q2) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0  # the caches really were written


@pytest.mark.gpu
def test_prefetch_is_on_for_compiled_kernels_on_sm90():
    if interpreting() or not torch.cuda.is_available():
        pytest.skip("needs compiled kernels on CUDA")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk L2 prefetch needs sm_90+")
    t = torch.empty(1000, device="cuda")
    assert prefetch_args("op", t.device, [t])["PREFETCH"] is True
