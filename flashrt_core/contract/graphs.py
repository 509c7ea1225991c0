"""CUDA graphs over the static buffers, cached by plan (the tuple of stages replayed together).

On CPU (or with graphs off) a "graph" is the eager function itself, so the runtime code path is the same.
Capturing needs one eager warm-up, which writes into the live buffers; the cache saves every buffer before
and puts it back after, so capturing a new plan in the middle of a run never changes the state.
`captures` counts real captures (tests read it); with `debug=True` every replay first checks that no buffer
moved since capture, which would make the graph read or write freed memory (`flashrt_core.engine.graphs`).
"""
from __future__ import annotations

from typing import Callable

import torch

from flashrt_core.contract.buffers import BufferSet
from flashrt_core.engine.graphs import GraphSet, warm_up


class GraphCache:
    def __init__(self, buffers: BufferSet, enabled: bool, debug: bool = False):
        self.buffers = buffers
        self.enabled = enabled and buffers.device.type == "cuda"
        self._set = GraphSet(buffers.device, addresses=buffers.addresses, debug=debug)

    @property
    def captures(self) -> int:
        return self._set.captures

    @property
    def debug(self) -> bool:
        return self._set.debug

    def __contains__(self, key) -> bool:
        return tuple(key) in self._set

    def keys(self):
        return self._set.keys()

    def run(self, key: tuple[str, ...], fn: Callable[[], None]) -> None:
        if not self.enabled:
            fn()
            return
        key = tuple(key)
        if key not in self._set:
            self._capture(key, fn)
        self._set.replay(key)

    def _capture(self, key, fn) -> None:
        saved = self.buffers.clone_all()
        warm_up(fn)  # (writes into the live buffers: put back below)
        self._set.capture(key, fn)
        self.buffers.load_all(saved)
        torch.cuda.synchronize()
