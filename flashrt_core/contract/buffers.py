"""Every buffer of a contract, allocated once, plus the host side of getting data onto the device.

Buffers never move: stages write into them in place and capsules restore into them in place, which is what
lets CUDA graphs replay over fixed addresses. Inputs placed on the device also keep a host copy that
`set_observation` writes; the device copy is refreshed only when a stage that reads it runs.
"""
from __future__ import annotations

import numpy as np
import torch

from flashrt_core.capsule.slab import arena
from flashrt_core.contract.schedule import Ledger
from flashrt_core.contract.spec import Contract

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}


def host_copy(dst: torch.Tensor, src) -> None:
    """dst <- src (a host tensor or numpy array of dst's shape, of a dtype numpy has; values cast as copy_
    casts them) as one memcpy on the calling thread (numpy), not torch's intra-op parallel copy: above ~32k
    elements that forks onto the thread pool, and its fork/join put stalls of milliseconds into ticks (a
    camera frame pair, 2-thread pool: max 4.8 ms over 30k copies against 0.25 ms for numpy's). Dtypes numpy
    lacks (bfloat16) go through torch."""
    if dst.dtype == torch.bfloat16:
        dst.copy_(src if isinstance(src, torch.Tensor) else torch.from_numpy(src))
        return
    np.copyto(dst.numpy(), src.numpy() if isinstance(src, torch.Tensor) else src, casting="unsafe")  # (as copy_)


class HostToDevice:
    """Copies host tensors into device buffers without a host sync in steady state.

    On CUDA the data goes through a small ring of pinned staging tensors per buffer, so the copy is truly
    asynchronous; a slot is reused only after its previous copy finished (an event wait that only blocks when
    the device is several ticks behind, i.e. back-pressure). On CPU it is a plain copy.
    """

    DEPTH = 3

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._rings: dict[str, list] = {}
        self._next: dict[str, int] = {}

    def copy(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.cuda:
            dst.copy_(src)
            return
        ring = self._rings.get(name)
        if ring is None:
            ring = [[torch.empty(src.shape, dtype=src.dtype, pin_memory=True), None] for _ in range(self.DEPTH)]
            self._rings[name], self._next[name] = ring, 0
        i = self._next[name]
        self._next[name] = (i + 1) % self.DEPTH
        slot = ring[i]
        if slot[1] is not None:
            slot[1].synchronize()
        host_copy(slot[0], src)
        dst.copy_(slot[0], non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record()


class BufferSet:
    """Named tensors of a contract (allocated once) with their ledger (version, step, stamp per buffer)."""

    def __init__(self, contract: Contract, device: torch.device):
        self.contract = contract
        # Asked at every snapshot and restore (between two control ticks): worked out once.
        self._persistent_names = tuple(n for n, b in contract.buffers.items() if b.persistent)
        self.device = device
        self.tensors: dict[str, torch.Tensor] = {}
        self.host_inputs: dict[str, torch.Tensor] = {}  # host copies of device-placed inputs
        self.device_version: dict[str, int] = {}  # version of each device input copy
        pin = device.type == "cuda"
        # Persistent device buffers share one allocation laid out like a capsule slab, so a capsule restore
        # or snapshot of them is one flat copy (see capsule.slab.arena).
        kept = {b.name: (tuple(b.shape), b.dtype) for b in contract.buffers.values()
                if b.persistent and b.place == "device"}
        self._arena, persistent = arena(kept, device) if kept else (None, {})
        for b in contract.buffers.values():
            dt = TORCH_DTYPES[b.dtype]
            where = device if b.place == "device" else torch.device("cpu")
            self.tensors[b.name] = persistent[b.name] if b.name in persistent else \
                torch.zeros(b.shape, dtype=dt, device=where)
            if b.is_input and b.place == "device":
                self.host_inputs[b.name] = torch.zeros(b.shape, dtype=dt, pin_memory=pin)
                self.device_version[b.name] = 0
        self.ledger = Ledger.fresh(contract)
        self.h2d = HostToDevice(device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def host_view(self, name: str) -> torch.Tensor:
        """Where host code writes an input: its host copy, or the buffer itself when it lives on the host."""
        return self.host_inputs.get(name, self.tensors[name])

    def refresh_inputs(self, names) -> None:
        """Bring device copies of the given inputs up to date (only those that changed)."""
        for n in names:
            if n in self.host_inputs and self.device_version[n] != self.ledger.buffers[n].version:
                self.h2d.copy(n, self.tensors[n], self.host_inputs[n])
                self.device_version[n] = self.ledger.buffers[n].version

    def persistent(self) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n] for n in self._persistent_names}

    def layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (tuple(b.shape), b.dtype) for n, b in self.contract.buffers.items()}

    def addresses(self) -> dict[str, int]:
        return {n: t.data_ptr() for n, t in self.tensors.items()}

    def clone_all(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.tensors.items()}

    def load_all(self, saved: dict[str, torch.Tensor]) -> None:
        for n, t in saved.items():
            self.tensors[n].copy_(t)
