"""The two gates every swap must pass: parity (cosine and max relative error) and a paired A/B timing.

Parity compares every floating tensor of two outputs. Relative error is max |new - ref| / max |ref| over a
tensor (normalising by the largest reference value keeps it meaningful where the reference crosses zero).
Timing alternates original and fused rounds (ABBA order, so drift and warm caches hit both alike) and keeps
the median of the per-round ratios; the timer is injectable: `timer(fn) -> seconds per call of fn`.
Two built-in timers: `DefaultTimer` times eager calls; `GraphTimer` times replays of a CUDA graph of the calls,
which is what a unit costs inside a captured method, where a kernel's host launch cost (tens of us for a
Triton launch) is gone.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from flashrt_core.adopt.signature import tensors_in
from flashrt_core.engine.timing import graph_ms

# Default bound on the max relative error, by the lowest floating precision a unit computes in.
MAX_REL_ERR = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


class ParityMismatch(Exception):
    """Two outputs differ in structure (tensor count, shapes, None positions)."""


@dataclass(frozen=True)
class Parity:
    cosine: float
    max_rel_err: float

    def passes(self, cos_min: float, rel_max: float) -> bool:
        return self.cosine >= cos_min and self.max_rel_err <= rel_max


def compute_dtype(*sources) -> torch.dtype:
    """The lowest floating precision among tensors and module parameters: it sets the error bound."""
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    worst = torch.float64
    for src in sources:
        tensors = list(src.parameters()) if isinstance(src, torch.nn.Module) else tensors_in(src)
        for t in tensors:
            if t.dtype in order and order.index(t.dtype) > order.index(worst):
                worst = t.dtype
    return worst


def _structure(value):
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape))
    if isinstance(value, (tuple, list)):
        return tuple(_structure(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _structure(v)) for k, v in sorted(value.items()))
    if hasattr(value, "to_tuple"):
        return _structure(value.to_tuple())
    return None if value is None else type(value).__name__


def parity(reference, candidate) -> Parity:
    """Worst cosine and worst relative error over all floating tensors of two same-structured outputs."""
    if _structure(reference) != _structure(candidate):
        raise ParityMismatch(f"output structure differs: {_structure(reference)} vs {_structure(candidate)}")
    pairs = [(r, c) for r, c in zip(tensors_in(reference), tensors_in(candidate)) if r.is_floating_point()]
    if not pairs:
        raise ParityMismatch("no floating tensor in the output to compare")
    cosines, rels = [], []
    for r, c in pairs:
        r64, c64 = r.detach().double().flatten(), c.detach().double().flatten()
        denom = r64.norm() * c64.norm()
        cos = (r64 @ c64 / denom) if denom > 0 else torch.tensor(1.0 if torch.equal(r64, c64) else 0.0)
        cosines.append(max(-1.0, min(1.0, float(cos))))  # rounding can step just past 1
        rels.append(float((r64 - c64).abs().max() / r64.abs().max().clamp_min(1e-30)) if r64.numel() else 0.0)
    return Parity(min(cosines), max(rels))


class TimedCall:
    """A callable handed to the timer; `variant` ("original"/"fused", "eager"/"adopted", "graph") and `unit`
    tell an injected timer what it is timing."""

    def __init__(self, fn, variant: str, unit: str):
        self.fn, self.variant, self.unit = fn, variant, unit

    def __call__(self):
        return self.fn()


class DefaultTimer:
    """CUDA events on CUDA, perf_counter on CPU; repeats fn until about `target_s` per measurement."""

    mode = "eager"

    def __init__(self, device: torch.device, target_s: float = 0.004, max_reps: int = 200):
        self.cuda = device.type == "cuda"
        self.target_s, self.max_reps = target_s, max_reps

    def _once(self, fn, reps: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    def __call__(self, fn) -> float:
        first = self._once(fn, 1)  # also the warm-up
        reps = max(1, min(self.max_reps, int(self.target_s / max(first, 1e-7))))
        return self._once(fn, reps)


class GraphTimer:
    """Seconds per call of fn inside a CUDA graph: fn is warmed up once on a side stream, then `reps` calls
    (default: about `target_s` of eager work, which bounds the capture's own cost too) are captured in one graph,
    replayed `replays` times under CUDA events, and the median replay divided by `reps` is returned; the graph
    is freed before returning.

    Where fn cannot be captured (a host sync, an upload from the host, ...) the call is timed by the eager
    `fallback` timer instead, and the unit (`fn.unit`) is remembered: its later calls are timed eagerly too,
    so both sides of a paired timing are measured the same way (`paired_timing` redoes a unit's rounds when
    its mode changed part-way). `eager_only` maps such units to the capture error.
    """

    mode = "graph"

    def __init__(self, device: torch.device, reps: int | None = None, target_s: float = 0.001,
                 max_reps: int = 256, replays: int = 3, fallback=None):
        if torch.device(device).type != "cuda":
            raise ValueError(f"GraphTimer needs a CUDA device, got {device}")
        self.device = torch.device(device)
        self.reps, self.target_s, self.max_reps, self.replays = reps, target_s, max_reps, max(1, replays)
        self.fallback = fallback or DefaultTimer(self.device)
        self.eager_only: dict[str, str] = {}
        self.captures = 0  # graphs captured and timed (a test can read it)

    def mode_of(self, unit: str | None) -> str:
        return "eager" if unit in self.eager_only else "graph"

    def __call__(self, fn) -> float:
        unit = getattr(fn, "unit", None)
        if unit is not None and unit in self.eager_only:
            return self.fallback(fn)
        caller = torch.cuda.current_stream(self.device)
        try:
            seconds = self._graph_seconds(fn, caller)
        except Exception as exc:  # caught outside torch.cuda.graph, whose exit has ended the capture
            recover_from_failed_capture(caller, self.device)
            if unit is not None:
                self.eager_only[unit] = f"{type(exc).__name__}: {str(exc)[:200]}"
            return self.fallback(fn)
        self.captures += 1
        return seconds

    def _count(self, fn, stream) -> int:
        if self.reps:
            return self.reps
        t0 = time.perf_counter()
        fn()
        stream.synchronize()
        return max(1, min(self.max_reps, int(self.target_s / max(time.perf_counter() - t0, 1e-7))))

    def _graph_seconds(self, fn, caller) -> float:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                fn()  # warm-up: Triton compiles, cuBLAS picks its algorithm, lazy state is built, outside capture
                reps = self._count(fn, side)
        finally:
            caller.wait_stream(side)
        return graph_ms(lambda _: fn(), [None] * reps, rounds=self.replays, device=self.device) / 1e3


def recover_from_failed_capture(caller, device) -> None:
    """After a CUDA-graph capture raised: a failing capture_end can skip the stream context's own exit, so make
    `caller` current again and let the device finish what the failed capture left."""
    torch.cuda.set_stream(caller)
    torch.cuda.synchronize(device)


def timer_mode(timer, unit: str | None = None) -> str:
    """How `timer` measures (`unit`): "graph", "eager", or "injected" for a timer of the caller's own."""
    if hasattr(timer, "mode_of"):
        return timer.mode_of(unit)
    return getattr(timer, "mode", "injected")


@dataclass(frozen=True)
class Timing:
    before_s: float  # median seconds of the original
    after_s: float  # median seconds of the fused form
    gain: float  # median over rounds of before/after, minus 1

    def passes(self, min_gain: float) -> bool:
        return self.gain >= min_gain


def paired_timing(timer, original: TimedCall, fused: TimedCall, rounds: int) -> Timing:
    mode = timer_mode(timer, original.unit)
    timing = _alternate(timer, original, fused, rounds)
    if timer_mode(timer, original.unit) != mode:  # a capture failed part-way: some rounds mixed two modes
        timing = _alternate(timer, original, fused, rounds)
    return timing


def _alternate(timer, original: TimedCall, fused: TimedCall, rounds: int) -> Timing:
    before, after, ratios = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            a = timer(original)
            b = timer(fused)
        else:
            b = timer(fused)
            a = timer(original)
        before.append(a)
        after.append(b)
        ratios.append(a / b if b > 0 else float("inf"))
    return Timing(statistics.median(before), statistics.median(after), statistics.median(ratios) - 1.0)
