"""CUDA timing of the engines' launch choices: the GEMM and attention pickers time their candidates with
`graph_ms` during warm-up, and the act-graph ranking replays whole graphs with `cuda_samples`.

Both time on the GPU with CUDA events and never inside a capture: `graph_ms` captures its calls on a side
stream of its own, so a caller may be in the middle of an engine's warm-up. The benchmarks time with the
same functions (`flashrt_bench.harness` re-exports them).
"""
from __future__ import annotations

import statistics

import torch

from flashrt_core.engine.graphs import capture


def cuda_samples(fn, warmup: int = 3, iters: int = 20) -> list[float]:
    """CUDA-event latency in ms of each call, in call order (a sync after each, so calls never overlap)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return ms


def graph_ms(fn, items, rounds: int = 3, device=None) -> float:
    """ms per call of fn(item) for each of `items` in turn, captured once as a CUDA graph and replayed (median
    of `rounds` replays): the cost inside a decision, without host launch overhead. Capture happens on a side
    stream, so this also works inside the engine's warm-up; the caller's stream waits for it even when the
    capture fails (the error propagates)."""
    stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)

    def calls():
        for item in items:
            fn(item)
    graph = None
    try:
        with torch.cuda.stream(side):
            calls()  # warm-up: Triton compiles and cuBLAS picks its algorithm outside the capture
            graph = capture(calls, stream=side, device=device)
            graph.replay()
            times = []
            for _ in range(rounds):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(side)
                graph.replay()
                end.record(side)
                end.synchronize()
                times.append(start.elapsed_time(end) / len(items))
    finally:
        stream.wait_stream(side)
        del graph
    return statistics.median(times)
