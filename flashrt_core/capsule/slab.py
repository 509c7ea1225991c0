"""In-memory capsule storage and the copies in and out of it.

A capsule in the device or host tier is one flat allocation (a "slab") holding every buffer at a 256-byte
aligned offset: one allocation per capsule instead of one per buffer. Copies move raw words, not typed
elements: each buffer is seen as int64 words (bytes when its size is not a multiple of 8), so the dozens of
bf16 K/V layers, the fp32 chunk and the uint8 RNG state all go through ONE multi-tensor copy launch
(`torch._foreach_copy_` only fuses lists of a single dtype). That keeps a restore near the copy floor
instead of paying a launch per buffer.

Live buffers allocated with `arena` (what the contract runtime does for its persistent device buffers) sit
at the same aligned offsets as in a slab, so consecutive buffers of a restore or snapshot coalesce into one
span: a plain flat copy. Only memory this module allocated (arenas and slabs, registered in `_OWNED`) is
ever coalesced, because a span also copies the alignment padding between buffers.
"""
from __future__ import annotations

import math
import weakref
from typing import Mapping, Sequence

import torch

from flashrt_core.errors import CapsuleError

_ALIGN = 256  # bytes; keeps every buffer aligned for any dtype and for vectorised copies
_WORD = torch.int64


# storage base address -> the flat uint8 tensor of an arena or slab (gone when that tensor is freed)
_OWNED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _own(flat: torch.Tensor) -> torch.Tensor:
    _OWNED[flat.untyped_storage().data_ptr()] = flat
    return flat


def _owner(t: torch.Tensor) -> torch.Tensor | None:
    return _OWNED.get(t.untyped_storage().data_ptr())


def arena(layout: Mapping[str, tuple], device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Zeroed tensors for `layout` {name: (shape, dtype name)} in one flat allocation laid out like a slab of
    the same buffers (256-byte aligned, in name order as a capsule fingerprint orders its layout). Returns
    (flat, views); keep `flat` alive as long as the views are used, so that capsule copies keep coalescing."""
    plan = SlabPlan({name: layout[name] for name in sorted(layout)})
    flat = _own(torch.zeros(max(plan.total_bytes, _ALIGN), dtype=torch.uint8, device=device))
    return flat, {name: flat[o:o + n].view(dt).view(shape) for name, o, n, dt, shape in plan.entries}


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CapsuleError(f"unknown dtype {name!r} in capsule layout")
    return dtype


class SlabPlan:
    """Where each buffer of a layout sits in a slab; computed once per store, reused by every capsule."""

    def __init__(self, layout: Mapping[str, tuple]):
        self.entries, self.split, offset, payload = [], [], 0, 0
        for name, (shape, dtype) in layout.items():
            dt = torch_dtype(dtype)
            nbytes = math.prod(shape) * dt.itemsize
            block = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            self.entries.append((name, offset, nbytes, dt, tuple(shape)))
            words = (nbytes + 7) // 8
            self.split += [words, block // 8 - words]  # [payload words, padding words] per buffer
            offset += block
            payload += nbytes
        self.names = [e[0] for e in self.entries]
        self.total_bytes = offset  # with alignment padding
        self.payload_bytes = payload  # what budgets and `list()` count


class Slab:
    """One flat allocation for a layout: `words` (raw copy views) and `views` (typed, built on demand)."""

    def __init__(self, plan: SlabPlan, device: torch.device, pinned: bool = False):
        self.plan = plan
        self.device = torch.device(device)
        self.flat = _own(torch.empty(max(plan.total_bytes, _ALIGN), dtype=torch.uint8, device=self.device,
                                     pin_memory=pinned and self.device.type == "cpu"))
        pieces = self.flat[:plan.total_bytes].view(_WORD).split_with_sizes(plan.split)  # one call, all views
        self.words = []
        for (name, _, nbytes, _, _), piece in zip(plan.entries, pieces[0::2]):
            self.words.append(piece if nbytes % 8 == 0 else piece.view(torch.uint8)[:nbytes])
        self._views = None
        self.planned = {}  # the Copier's cached copy lists to (True) / from (False) the live buffers
        self.ready = None  # CUDA event recorded after the copy that filled it, when one was async
        # On a CUDA slab: host copies of the buffers whose live tensors are on the host (a contract's
        # `place: host` buffers), so a restore writes them with a host memcpy instead of a device-to-host
        # copy, which would wait for all the work queued on the GPU (a deferred stage: milliseconds)
        self.mirror: dict[int, torch.Tensor] = {}

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """Typed tensors per buffer (for export, disk writes and odd live tensors)."""
        if self._views is None:
            self._views = {name: self.flat[o:o + n].view(dt).view(shape)
                           for name, o, n, dt, shape in self.plan.entries}
        return self._views

    def wait_host(self) -> None:
        """Block the host until the slab's last async copy landed (before the CPU reads its bytes)."""
        if self.ready is not None:
            self.ready.synchronize()


def _group(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
    """Split (dst, src) pairs into fused lists, one per (dtype, device), and single cross-device copies."""
    groups: dict = {}
    singles = []
    for d, s in pairs:
        if d.device == s.device and d.dtype == s.dtype:
            dst, src = groups.setdefault((d.dtype, d.device), ([], []))
            dst.append(d)
            src.append(s)
        else:  # host-placed buffers of a CUDA runtime, host <-> device tiers
            singles.append((d, s))
    return list(groups.values()), singles


def _coalesce(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """Merge consecutive (dst, src) pairs that lie back to back (up to alignment padding) in an arena or slab
    on both sides, at the same relative offsets, into one byte-span pair; others pass through unchanged."""
    out, run = [], None  # run: [dst flat, src flat, dst start, src start, bytes, pairs merged]

    def flush():
        if run is None:
            return
        dflat, sflat, d0, s0, n, merged = run
        if len(merged) == 1:
            out.append(merged[0])
            return
        d = dflat[d0 - dflat.data_ptr():d0 - dflat.data_ptr() + n]
        s = sflat[s0 - sflat.data_ptr():s0 - sflat.data_ptr() + n]
        if n % 8 == 0 and d0 % 8 == 0 and s0 % 8 == 0:
            d, s = d.view(_WORD), s.view(_WORD)
        out.append((d, s))

    for d, s in pairs:
        nbytes = d.numel() * d.element_size()
        if nbytes == 0 and s.numel() == 0:
            continue  # nothing to copy (and an empty view's address means nothing)
        dflat, sflat = _owner(d), _owner(s)
        if (dflat is None or sflat is None or d.device != s.device or not d.is_contiguous()
                or not s.is_contiguous() or nbytes != s.numel() * s.element_size()):
            flush()
            run = None
            out.append((d, s))
            continue
        dp, sp = d.data_ptr(), s.data_ptr()
        if (run is not None and run[0] is dflat and run[1] is sflat and dp - run[2] == sp - run[3]
                and 0 <= dp - (run[2] + run[4]) < _ALIGN):
            run[4] = dp + nbytes - run[2]
            run[5].append((d, s))
            continue
        flush()
        run = [dflat, sflat, dp, sp, nbytes, [(d, s)]]
    flush()
    return out


def _run(groups: list, singles: list) -> None:
    for d, s in singles:
        d.copy_(s, non_blocking=True)
    for dst, src in groups:
        if len(dst) == 1:  # one span (a coalesced arena): a plain copy is a memcpy, faster than the fused kernel
            dst[0].copy_(src[0], non_blocking=True)
        else:
            torch._foreach_copy_(dst, src, non_blocking=True)


def _copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (dst, src): one fused launch per (dtype, device) group, single copies across devices."""
    _run(*_group(pairs))


class LiveWords:
    """Raw-word views of the live buffers, rebuilt only when the store's checked live tensors change.

    A runtime hands over the same persistent tensors on every call, so building 40 views per restore would
    cost more host time than the copy itself. The store bumps `gen` whenever the tensors it validated are
    other objects or moved, resized or retyped (see CapsuleStore._check_buffers).
    """

    def __init__(self):
        self._gen = None
        self._words: list = []

    def get(self, plan: SlabPlan, live: Sequence[torch.Tensor], gen: int) -> list:
        if gen != self._gen:
            self._words = [_as_words(t, n) for t, (_, _, n, _, _) in zip(live, plan.entries)]
            self._gen = gen
        return self._words


def _as_words(t: torch.Tensor, nbytes: int):
    """The tensor's bytes as int64 words (or bytes), or None when it is not one aligned dense block."""
    if not t.is_contiguous():
        return None
    flat = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    if nbytes % 8 == 0 and t.data_ptr() % 8 == 0:
        return flat.view(_WORD)
    return None if nbytes % 8 == 0 else flat


def _mirrored(slab: Slab, live: Sequence[torch.Tensor]) -> list[int]:
    """Entries a restore takes from the slab's host mirror: live on the host, slab on a GPU."""
    if slab.device.type != "cuda":
        return []
    return [i for i, t in enumerate(live) if t.device.type == "cpu"]


def _live_pairs(slab: Slab, live: Sequence[torch.Tensor], words: list, to_slab: bool) -> list:
    pairs = []
    skip = set() if to_slab else set(_mirrored(slab, live))
    for i, (name, _, _, _, _) in enumerate(slab.plan.entries):
        if i in skip:
            continue
        w = words[i]
        if w is None:  # odd live tensor: typed copy of this one buffer
            pair = (slab.views[name], live[i]) if to_slab else (live[i], slab.views[name])
        else:
            pair = (slab.words[i], w) if to_slab else (w, slab.words[i])
        pairs.append(pair)
    return pairs


def _cuda_device(pairs) -> torch.device | None:
    for d, s in pairs:
        if d.is_cuda:
            return d.device
        if s.is_cuda:
            return s.device
    return None


class Copier:
    """Copies on a side CUDA stream (snapshot, move, fork) or on the caller's stream (restore).

    Copies between a slab and the live buffers are planned once per (slab, direction, live generation)
    and kept on the slab, so a repeated restore (or a time-travel ring slot refilled every decision)
    only replays the fused copy lists.
    """

    def __init__(self):
        self._side = {}
        self._live = LiveWords()

    def _side_stream(self, device):
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device=device)
        return self._side[device]

    def _side_copy(self, groups: list, singles: list, device) -> None | torch.cuda.Event:
        """Copy on a side stream; returns the completion event (None on CPU).

        The side stream first waits for the work already queued on the caller's stream (so it copies the
        finished state), and the caller's stream then waits for the copy on the GPU (so the next stage
        cannot overwrite a buffer mid-copy). The host never blocks: the control loop is held back by at
        most the copy itself.
        """
        if device is None:
            _run(groups, singles)
            return None
        main = torch.cuda.current_stream(device)
        side = self._side_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _run(groups, singles)
            done = torch.cuda.Event()
            done.record(side)
        main.wait_event(done)
        return done

    def _side_pairs(self, pairs) -> None | torch.cuda.Event:
        return self._side_copy(*_group(pairs), _cuda_device(pairs))

    def _planned(self, slab: Slab, live: Sequence[torch.Tensor], gen: int, to_slab: bool) -> tuple:
        """(groups, singles, cuda device) for copies between `slab` and the live tensors of generation `gen`."""
        cached = slab.planned.get(to_slab)
        if cached is None or cached[0] != gen:
            pairs = _coalesce(_live_pairs(slab, live, self._live.get(slab.plan, live, gen), to_slab))
            cached = slab.planned[to_slab] = (gen, (*_group(pairs), _cuda_device(pairs)))
        return cached[1]

    def live_to_slab(self, slab: Slab, live: Sequence[torch.Tensor], gen: int) -> None:
        slab.mirror = {i: live[i].clone() for i in _mirrored(slab, live)}  # (host state: as of now)
        slab.ready = self._side_copy(*self._planned(slab, live, gen, to_slab=True))

    def slab_to_slab(self, dst: Slab, src: Slab) -> None:
        """Fork or move: slabs of one plan share their layout, so the whole allocation is one flat copy (a
        memcpy, padding included) rather than a multi-tensor launch over every buffer."""
        dst.mirror = {i: t.clone() for i, t in src.mirror.items()} if dst.device.type == "cuda" else {}
        dst.ready = self._side_pairs([(dst.flat, src.flat)])

    def plan_restore(self, slab: Slab, live: Sequence[torch.Tensor], gen: int) -> None:
        """Work out (and keep on the slab) the copy lists of a restore from it, without copying."""
        self._planned(slab, live, gen, to_slab=False)

    def tensors_to_slab(self, slab: Slab, tensors: Mapping[str, torch.Tensor]) -> None:
        """From verified CPU tensors (a disk capsule) into a memory slab."""
        slab.mirror = {}  # (a restore then copies its host entries from the slab itself)
        slab.ready = self._side_pairs([(slab.views[n], tensors[n]) for n in slab.plan.names])

    def slab_to_live(self, live: Sequence[torch.Tensor], gen: int, slab: Slab) -> None:
        """Restore: on the caller's stream, after the copy that filled the slab; the host-placed buffers from
        the slab's host mirror (a host memcpy), or, for a slab filled without one, from the slab itself."""
        groups, singles, device = self._planned(slab, live, gen, to_slab=False)
        if device is not None and slab.ready is not None:
            torch.cuda.current_stream(device).wait_event(slab.ready)
        _run(groups, singles)
        for i in _mirrored(slab, live):
            src = slab.mirror.get(i)
            live[i].copy_(src if src is not None else slab.views[slab.plan.names[i]])

    @staticmethod
    def tensors_to_live(live: Sequence[torch.Tensor], names: Sequence[str],
                        tensors: Mapping[str, torch.Tensor]) -> None:
        _copy_pairs([(t, tensors[n]) for t, n in zip(live, names)])
