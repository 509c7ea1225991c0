"""flashrt_bench.harness.phase_samples: the per-phase split of a call made of several host calls, checked with a
stand-in for CUDA events whose clock each phase advances by a known amount (no GPU, nothing timed)."""
import torch

from flashrt_bench import harness as bench


class FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.t - self.t


def test_phase_samples_splits_a_call_into_its_phases(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []
    costs = {"set_observation": [0.3, 0.2, 0.4, 0.25, 0.3], "observe": [5.9] * 5, "denoise": [6.1, 6.0, 6.2, 6.1, 6.1]}

    def phase(name):
        def run():
            calls.append(name)
            FakeEvent.clock[0] += costs[name][(len(calls) - 1) // 3 - 1]  # (after the warm-up round)
        return run

    got = bench.phase_samples({name: phase(name) for name in costs}, warmup=1, iters=4)
    assert list(got) == ["set_observation", "observe", "denoise"]
    assert calls == ["set_observation", "observe", "denoise"] * 5  # in order, warm-up included
    for name, want in (("set_observation", 0.275), ("observe", 5.9), ("denoise", 6.1)):
        assert abs(got[name] - want) < 1e-9, name
