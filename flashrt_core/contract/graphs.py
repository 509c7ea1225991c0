"""CUDA graphs over the static buffers, cached by plan (the tuple of stages replayed together).

On CPU (or with graphs off) a "graph" is the eager function itself, so the runtime code path is the same.
Capturing needs one eager warm-up, which writes into the live buffers; the cache saves every buffer before
and puts it back after, so capturing a new plan in the middle of a run never changes the state.
`captures` counts real captures (tests read it); with `debug=True` every replay first checks that no buffer
moved since capture, which would make the graph read or write freed memory.
"""
from __future__ import annotations

from typing import Callable

import torch

from flashrt_core.contract.buffers import BufferSet


class GraphCache:
    def __init__(self, buffers: BufferSet, enabled: bool, debug: bool = False):
        self.buffers = buffers
        self.enabled = enabled and buffers.device.type == "cuda"
        self.debug = debug
        self.captures = 0
        self._graphs: dict[tuple[str, ...], torch.cuda.CUDAGraph] = {}
        self._addresses: dict[tuple[str, ...], dict[str, int]] = {}
        self._pool = None

    def __contains__(self, key) -> bool:
        return tuple(key) in self._graphs

    def keys(self):
        return list(self._graphs)

    def run(self, key: tuple[str, ...], fn: Callable[[], None]) -> None:
        if not self.enabled:
            fn()
            return
        key = tuple(key)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key, fn)
        elif self.debug:
            self._check_addresses(key)
        graph.replay()

    def _capture(self, key, fn) -> torch.cuda.CUDAGraph:
        saved = self.buffers.clone_all()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up: lazy inits (cuBLAS workspaces, autotuning) must not happen during capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        self.buffers.load_all(saved)
        torch.cuda.synchronize()
        self._graphs[key] = graph
        self._addresses[key] = self.buffers.addresses()
        self.captures += 1
        return graph

    def _check_addresses(self, key) -> None:
        now = self.buffers.addresses()
        moved = [n for n, p in self._addresses[key].items() if now.get(n) != p]
        if moved:
            raise RuntimeError(f"graph {'+'.join(key)}: buffer {moved[0]!r} moved since capture "
                               f"({self._addresses[key][moved[0]]:#x} -> {now.get(moved[0], 0):#x})")
