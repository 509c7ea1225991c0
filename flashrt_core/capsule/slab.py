"""In-memory capsule storage and the copies in and out of it.

A capsule in the device or host tier is one flat allocation (a "slab") with a typed view per buffer: one
cudaMalloc / one pinned host allocation per capsule instead of one per buffer, and a single multi-tensor
copy instead of one launch per buffer, so snapshot and restore cost close to the bytes they move.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from flashrt_core.errors import CapsuleError

_ALIGN = 256  # bytes; keeps every view aligned for any dtype and for vectorised copies


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CapsuleError(f"unknown dtype {name!r} in capsule layout")
    return dtype


class SlabPlan:
    """Where each buffer of a layout sits in a slab; computed once per store, reused by every capsule."""

    def __init__(self, layout: Mapping[str, tuple]):
        self.entries, offset, payload = [], 0, 0
        for name, (shape, dtype) in layout.items():
            dt = torch_dtype(dtype)
            nbytes = math.prod(shape) * dt.itemsize
            self.entries.append((name, offset, nbytes, dt, tuple(shape)))
            offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            payload += nbytes
        self.total_bytes = offset  # with alignment padding
        self.payload_bytes = payload  # what budgets and `list()` count


class Slab:
    """One flat allocation holding every buffer of a layout; `views[name]` is that buffer's tensor."""

    def __init__(self, plan: SlabPlan, device: torch.device, pinned: bool = False):
        self.device = torch.device(device)
        self.flat = torch.empty(max(plan.total_bytes, 1), dtype=torch.uint8, device=self.device,
                                pin_memory=pinned and self.device.type == "cpu")
        self.views = {name: self.flat[o:o + n].view(dt).view(shape) for name, o, n, dt, shape in plan.entries}
        self.ready = None  # CUDA event recorded after the copy that filled it, when one was async

    def wait_host(self) -> None:
        """Block the host until the slab's last async copy landed (before the CPU reads its bytes)."""
        if self.ready is not None:
            self.ready.synchronize()


def _copy_lists(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    same = [(d, s) for d, s in zip(dst, src) if d.device == s.device]
    if same:
        # One multi-tensor kernel instead of one launch per buffer (dozens of K/V layers).
        torch._foreach_copy_([d for d, _ in same], [s for _, s in same], non_blocking=True)
    for d, s in zip(dst, src):  # host-placed buffers of a CUDA runtime: a copy each
        if d.device != s.device:
            d.copy_(s, non_blocking=True)


def _cuda_device(tensors: Sequence[torch.Tensor]):
    for t in tensors:
        if t.is_cuda:
            return t.device
    return None


class Copier:
    """Copies on a side CUDA stream (snapshot, move, fork) or on the caller's stream (restore)."""

    def __init__(self):
        self._side = {}

    def _side_stream(self, device):
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device=device)
        return self._side[device]

    def side_copy(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]):
        """Copy src -> dst on a side stream; returns the completion event (None on CPU).

        The side stream first waits for the work already queued on the caller's stream (so it copies the
        finished state), and the caller's stream then waits for the copy on the GPU (so the next stage
        cannot overwrite a buffer mid-copy). The host never blocks: the control loop is held back by at
        most the copy itself.
        """
        device = _cuda_device(list(dst) + list(src))
        if device is None:
            _copy_lists(dst, src)
            return None
        main = torch.cuda.current_stream(device)
        side = self._side_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _copy_lists(dst, src)
            done = torch.cuda.Event()
            done.record(side)
        main.wait_event(done)
        return done

    @staticmethod
    def inline_copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], after=None) -> None:
        """Copy on the caller's stream, ordered after the event `after` (restore into live buffers)."""
        device = _cuda_device(list(dst) + list(src))
        if device is not None and after is not None:
            torch.cuda.current_stream(device).wait_event(after)
        _copy_lists(dst, src)
