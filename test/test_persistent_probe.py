"""The persistent-kernel probe (benchmarks/persistent_probe.py) reads every weight byte exactly once in each
variant, under the Triton interpreter. The interpreter runs programs one after another, so a grid barrier
can only be exercised with one program here (more would wait forever for programs that never run); the GPU
round runs it with one and two programs per SM and checks the same sums."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from benchmark_loading import load_benchmark  # noqa: E402
from kernel_testing import dev  # noqa: E402,F401


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("persistent_probe")


@pytest.mark.interpret
def test_every_variant_sums_each_weight_once(dev, probe):
    bounds = probe.phase_bounds(2, scale=1.3e-3)  # 2 layers, ~20 K elements per layer; tiles past phase ends
    assert bounds == sorted(bounds) and len(bounds) == 2 * len(probe.LAYER_PHASES) + 1
    assert all(b % probe.ALIGN == 0 for b in bounds)
    assert probe.phase_bounds(1)[-1] * 2 == 34603008  # a layer's weights: 34.6 MB
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(bounds[-1], generator=g) + 0.1).to(dev, torch.bfloat16)
    want = w.double().sum()
    bounds_t = torch.tensor(bounds, dtype=torch.int64, device=dev)
    bar = torch.zeros(1, dtype=torch.int64, device=dev)
    acc = torch.zeros(1, dtype=torch.float32, device=dev)
    configs = [(1, 0), (1, 1), (2, 2), (4, 8)]  # (tiles per load, next-phase tiles before the barrier)
    for unroll, prefetch in configs:
        got = probe.run_persistent(w, bounds_t, bar, acc, 1, unroll, prefetch).double().sum()
        assert abs(got - want) <= 1e-4 * w.double().abs().sum(), (unroll, prefetch)
    assert int(bar) == len(configs) * (len(bounds) - 1)  # one arrival per phase and launch
    acc3 = torch.zeros(3, dtype=torch.float32, device=dev)
    for unroll, prefetch in configs:
        got = probe.run_launches(w, bounds, acc3, 3, unroll, prefetch).double().sum()
        assert abs(got - want) <= 1e-4 * w.double().abs().sum(), (unroll, prefetch)


@pytest.mark.interpret
def test_the_barrier_counter_only_grows(dev, probe):
    bar = torch.full((1,), 5, dtype=torch.int64, device=dev)  # left over from earlier launches
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    probe._barrier_kernel[(1,)](bar, out, 7)
    assert int(bar) == 12 and int(out) == 12


def test_persistent_grids_run_only_where_every_program_is_resident(probe, monkeypatch):
    """A persistent grid larger than the SMs hold at once would wait at its first barrier forever: the probe
    counts how many programs fit per SM from the compiled kernel's registers and shared memory."""
    import types

    props = types.SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=228 * 1024)
    monkeypatch.setattr(probe.torch.cuda, "get_device_properties", lambda device: props)

    def kernel(regs, shared=0):
        return types.SimpleNamespace(n_regs=regs, metadata=types.SimpleNamespace(shared=shared))
    assert probe.WARPS == 4
    assert probe.programs_per_sm(kernel(24), "cuda") == 16  # 64 warps per SM at most
    assert probe.programs_per_sm(kernel(56), "cuda") == 9  # 1792 registers per warp
    assert probe.programs_per_sm(kernel(128), "cuda") == 4
    assert probe.programs_per_sm(kernel(209), "cuda") == 2  # 216 registers allocated per thread
    assert probe.programs_per_sm(kernel(255), "cuda") == 2
    assert probe.programs_per_sm(kernel(56, shared=100 * 1024), "cuda") == 2
    assert probe.programs_per_sm(types.SimpleNamespace(), "cuda") == 1  # unknown: one per SM only


def test_prefetch_windows_cover_each_weight_once_in_stream_order(probe):
    """The L2 windows (AHEAD) run ahead of the stream: each starts where the phase (or an earlier window) ends,
    never reaches past the weights nor more than `ahead` past its phase, no weight is prefetched twice, and
    once `ahead` spans the largest phase every weight after the first phase is prefetched."""
    bounds = probe.phase_bounds(2, scale=1.3e-3)
    largest = max(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:]))
    for ahead in (1024, 5000, largest, 10 ** 9):
        windows = probe.prefetch_windows(bounds, ahead)
        assert len(windows) == len(bounds) - 1
        covered = []
        for (start, end), hi in zip(windows, bounds[1:]):
            assert hi <= start <= end <= min(hi + ahead, bounds[-1])
            covered += list(range(start, end))
        assert covered == sorted(set(covered))
        if ahead >= largest:
            assert covered == list(range(bounds[1], bounds[-1]))
        else:
            assert len(covered) < bounds[-1] - bounds[1]
    assert all(start == end for start, end in probe.prefetch_windows(bounds, 0))
