"""The one CUDA-graph wrapper of the project: every capture (the engines' stages, the contract runtime's plans,
the tuners' timings, adopted methods) goes through `capture`, and keyed sets of graphs through `GraphSet`.

- `warm_up(body)`: run once on a side stream first, so Triton compiles, cuBLAS picks its algorithms and lazy
  workspaces are made outside the capture (none of that may happen inside it); the caller's stream waits for
  the side stream afterwards, also when the body raises.
- `capture(body, pool=...)`: one graph of `body`; a capture that fails ends the allocator's recording into the
  pool and puts the caller's stream back before the error propagates (otherwise every later capture into that
  pool fails with "already recording to mempool").
- `GraphSet`: graphs by key sharing one memory pool (graphs of one owner replay in turn, so they may share it),
  a count of captures, and with `debug=True` a check before each replay that none of the buffers the graphs
  read or write moved since capture (a moved buffer makes a graph read or write freed memory).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Mapping

import torch


def warm_up(body: Callable[[], object], device=None, context: Callable[[], contextlib.AbstractContextManager]
            | None = None) -> None:
    """Run `body()` once on a side stream that waits for the caller's; the caller's waits for it after."""
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)
    try:
        with (context() if context else contextlib.nullcontext()), torch.cuda.stream(side):
            body()
    finally:
        caller.wait_stream(side)


def capture(body: Callable[[], object], *, pool=None, stream=None, device=None,
            context: Callable[[], contextlib.AbstractContextManager] | None = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `body()` (warmed up already: see `warm_up`), recorded into `pool` (None: a private one)
    on `stream` (None: a fresh side stream, as torch does). Raises what the capture raised, after cleaning up."""
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream(device)
    try:
        with (context() if context else contextlib.nullcontext()), torch.cuda.graph(graph, pool=pool, stream=stream):
            body()
    except Exception:
        # A body that raised is followed by torch's capture_end, which ends the capture and the pool's recording
        # and gives the caller's stream back. A capture_end that raised itself skips both: end them here (only
        # then: ending a pool's recording twice breaks the pool for the next capture).
        if torch.cuda.current_stream(device) != caller:
            torch.cuda.set_stream(caller)
            if pool is not None:
                index = torch.device(device).index if device is not None else None
                try:
                    torch._C._cuda_endAllocateToPool(torch.cuda.current_device() if index is None else index, pool)
                except Exception:  # noqa: BLE001 (already ended, or a torch without this hook)
                    pass
        raise
    return graph


class GraphSet:
    """CUDA graphs by key over buffers at fixed addresses, one memory pool for all of them.

    addresses: () -> {buffer name: data_ptr} of what the graphs read and write (None: no checks); debug:
    check them before every replay (they are recorded at each capture either way)."""

    def __init__(self, device, addresses: Callable[[], Mapping[str, int]] | None = None, debug: bool = False):
        self.device = torch.device(device)
        self.addresses = addresses
        self.debug = bool(debug)
        self.captures = 0  # graphs captured and kept (tests and benchmarks read it)
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._recorded: dict[Hashable, dict[str, int]] = {}
        self._pool = None

    def __contains__(self, key) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list:
        return list(self._graphs)

    def get(self, key) -> torch.cuda.CUDAGraph | None:
        return self._graphs.get(key)

    def clear(self) -> None:
        """Drop every graph (the buffers they were captured over are being replaced)."""
        self._graphs.clear()
        self._recorded.clear()

    def capture(self, key, body: Callable[[], object], context=None, keep: bool = True) -> torch.cuda.CUDAGraph:
        """Capture `body` (warmed up already) into the set's pool; keep=False: return the graph without keeping or
        counting it (a graph timed once and dropped)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            graph = capture(body, pool=self._pool, device=self.device, context=context)
        except Exception:
            self._pool = None  # (the next capture records into a fresh pool: this one's state is the failure's)
            raise
        if keep:
            self._graphs[key] = graph
            self.captures += 1
            if self.addresses is not None:
                self._recorded[key] = dict(self.addresses())
        return graph

    def replay(self, key) -> None:
        if self.debug:
            self.check(key)
        self._graphs[key].replay()

    def check(self, key) -> None:
        """Raise if a buffer recorded at the capture of `key` moved since (`addresses`)."""
        if self.addresses is None or key not in self._recorded:
            return
        then, now = self._recorded[key], self.addresses()
        moved = [n for n, p in then.items() if now.get(n) != p]
        if moved:
            name = "+".join(key) if isinstance(key, tuple) else str(key)
            raise RuntimeError(f"graph {name}: buffer {moved[0]!r} moved since capture "
                               f"({then[moved[0]]:#x} -> {now.get(moved[0], 0):#x})")
