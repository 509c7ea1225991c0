"""CapsuleStore: named copies of a runtime's persistent buffers in device, host or disk tiers.

Every capsule of a store shares the store's fingerprint (and so its buffer layout). Restore validates
everything it can before the first byte moves, so a refused restore leaves the live tensors untouched;
copies land in place, so CUDA graphs captured over the live buffers stay valid. Budgets bound each tier;
when one is full the store either refuses or evicts the oldest capsules one tier down (device -> host ->
disk), and never drops a capsule on its own.
"""
from __future__ import annotations

import dataclasses
import pathlib
import secrets
import shutil
import threading
import time
import weakref
from typing import Callable, Mapping

import torch

from flashrt_core.capsule import diskfmt
from flashrt_core.capsule.fingerprint import Fingerprint, dtype_name, shape_text
from flashrt_core.capsule.meta import clone_meta, copy_meta, decode_meta
from flashrt_core.capsule.slab import Copier, Slab, SlabPlan, torch_dtype
from flashrt_core.errors import CapsuleError

TIERS = ("device", "host", "disk")
_NEXT = {"device": "host", "host": "disk", "disk": None}


@dataclasses.dataclass
class _Capsule:
    id: str
    name: str
    tier: str
    nbytes: int
    created: float
    seq: int
    meta: dict  # private copy (see capsule.meta)
    decision_id: object = None  # for list(): meta's 'decision_id', else the runtime's 'decisions' counter
    slab: Slab | None = None  # device / host tiers
    path: pathlib.Path | None = None  # disk tier
    ring: bool = False
    # weak reference to the owner of the `check` this capsule's meta last passed (a runtime): the meta is
    # private and never changes, so a restore into the same runtime need not check it again
    checked_by: object = None


def _own_meta(meta) -> dict:
    if not isinstance(meta, Mapping):
        raise CapsuleError(f"meta must be a dict, got {type(meta).__name__}")
    return copy_meta(meta)


class CapsuleStore:
    def __init__(self, fingerprint: Fingerprint, *, device="cpu", budgets: Mapping | None = None,
                 on_full: str = "refuse", disk_dir=None, ring: int = 0, owns_disk_dir: bool = False):
        """owns_disk_dir: the folder is the store's own (a temporary one): `close()`, or the store's garbage
        collection or the process's exit, removes it with every disk capsule in it."""
        if on_full not in ("refuse", "evict"):
            raise CapsuleError(f"on_full must be 'refuse' or 'evict', got {on_full!r}")
        budgets = dict(budgets or {})
        unknown = set(budgets) - set(TIERS)
        if unknown:
            raise CapsuleError(f"budgets: unknown tier(s) {sorted(unknown)}; tiers are {list(TIERS)}")
        for tier, value in budgets.items():
            if value is not None and (not isinstance(value, int) or value < 0):
                raise CapsuleError(f"budgets[{tier!r}] must be a byte count >= 0 or None, got {value!r}")
        if not isinstance(ring, int) or ring < 0:
            raise CapsuleError(f"ring must be an int >= 0, got {ring!r}")
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self.budgets = {t: budgets.get(t) for t in TIERS}
        self.on_full = on_full
        self.disk_dir = pathlib.Path(disk_dir) if disk_dir is not None else None
        self.ring = ring
        self._plan = SlabPlan(fingerprint.layout)
        self.capsule_bytes = self._plan.payload_bytes
        self._expect = {n: (torch.Size(shape), torch_dtype(dt)) for n, (shape, dt) in fingerprint.layout.items()}
        self._pinned = torch.cuda.is_available()
        self._copier = Copier()
        self._caps: dict[str, _Capsule] = {}
        self._seq = 0
        self._tag = secrets.token_hex(2)  # keeps ids of two stores sharing a disk_dir apart
        self._ring_slots: list[Slab] = []
        self._ring_ids: list[str | None] = []
        self._ring_next = 0
        self._lock = threading.RLock()  # ROS services and the control loop may call from different threads
        # The live tensors last validated, in plan order, with their (id, address, shape, dtype) signature
        # and a generation the Copier keys its cached copy lists on (see _check_buffers).
        self._live: list = []
        self._live_sig: list | None = None
        self._live_gen = 0
        self.verified_config = None  # set by capsule.runtime_verbs: what the runtime's fingerprint was checked for
        self._remove_dir = (weakref.finalize(self, shutil.rmtree, str(self.disk_dir), True)
                            if owns_disk_dir and self.disk_dir is not None else None)

    # ---------------------------------------------------------------- public verbs
    def snapshot(self, name: str, tier: str, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> str:
        self._check_tier(tier)
        meta = _own_meta(meta)
        with self._lock:
            live = self._check_buffers(tensors, f"snapshot {name!r}")
            self._make_room(tier, self.capsule_bytes, protect=set(), for_what=f"snapshot {name!r}")
            cap = self._new(name, tier, meta)
            if tier == "disk":
                staging = self._slab("host")
                self._copier.live_to_slab(staging, live, self._live_gen)
                staging.wait_host()
                self._write_disk(cap, staging.views)
            else:
                cap.slab = self._slab(tier)
                self._copier.live_to_slab(cap.slab, live, self._live_gen)
            self._caps[cap.id] = cap
            return cap.id

    def restore(self, capsule_id: str, into: Mapping[str, torch.Tensor],
                check: Callable[[dict], None] | None = None, copy_meta: bool = True) -> dict:
        """Copy a capsule into the live tensors in place; returns a copy of its meta (copy_meta=False: the
        capsule's own meta, for a caller that only reads it before its next call into the store).

        Everything is validated before the first byte moves: the id, the live buffers against the layout,
        a disk capsule's checksums and fingerprint, and `check(meta)` (the runtime's own test that it can
        apply this meta), so a refused restore leaves the live tensors untouched.
        """
        what = f"restore of capsule {capsule_id}"
        with self._lock:
            cap = self._get(capsule_id)
            live = self._check_buffers(into, what)
            loaded = self._load_disk(cap, what) if cap.tier == "disk" else None
            owner = getattr(check, "__self__", check)
            if check is not None and not (cap.checked_by is not None and cap.checked_by() is owner):
                try:
                    check(cap.meta)
                except CapsuleError as exc:
                    raise CapsuleError(f"{what}: {exc}") from None
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    raise CapsuleError(f"{what}: its meta does not fit this runtime: "
                                       f"{type(exc).__name__}: {exc}") from exc
                try:
                    cap.checked_by = weakref.ref(owner)
                except TypeError:  # an owner without weak references: check every time
                    cap.checked_by = None
            if loaded is not None:
                self._copier.tensors_to_live(live, self._plan.names, loaded)
            else:
                self._copier.slab_to_live(live, self._live_gen, cap.slab)
            return clone_meta(cap.meta) if copy_meta else cap.meta

    def fork(self, capsule_id: str, name: str) -> str:
        """A new, independent capsule with the same buffers and meta, in the source's tier."""
        with self._lock:
            src = self._get(capsule_id)
            tier = "device" if src.ring else src.tier
            # A disk source is verified before anything is evicted for the copy.
            loaded = self._load_disk(src, f"fork of capsule {src.id}") if src.tier == "disk" else None
            self._make_room(tier, self.capsule_bytes, protect={src.id}, for_what=f"fork {name!r} of {src.id}")
            cap = self._new(name, tier, clone_meta(src.meta))
            if tier == "disk":
                if loaded is None:
                    src.slab.wait_host()
                self._write_disk(cap, loaded if loaded is not None else src.slab.views)
            else:
                cap.slab = self._slab(tier)
                if loaded is not None:
                    self._copier.tensors_to_slab(cap.slab, loaded)
                else:  # the source's own fill is already ordered before this copy (see Copier)
                    self._copier.slab_to_slab(cap.slab, src.slab)
            self._caps[cap.id] = cap
            return cap.id

    def list(self) -> list[dict]:
        with self._lock:
            return [{"id": c.id, "name": c.name, "tier": c.tier, "bytes": c.nbytes, "created": c.created,
                     "decision_id": c.decision_id, "ring": c.ring}
                    for c in sorted(self._caps.values(), key=lambda c: c.seq)]

    def drop(self, capsule_id: str) -> None:
        with self._lock:
            cap = self._get(capsule_id)
            del self._caps[cap.id]
            if cap.ring:
                self._ring_ids[self._ring_ids.index(cap.id)] = None
            if cap.path is not None:
                shutil.rmtree(cap.path, ignore_errors=True)

    def close(self) -> None:
        """Forget every capsule and free its memory. Disk capsules in a folder the user gave stay there (they
        are in the export format: `import_` reads them back); a folder of the store's own is removed."""
        with self._lock:
            self._caps.clear()
            self._ring_slots.clear()
            self._ring_ids.clear()
            if self._remove_dir is not None:
                self._remove_dir()

    def move(self, capsule_id: str, tier: str) -> None:
        self._check_tier(tier)
        with self._lock:
            cap = self._get(capsule_id)
            if cap.ring:
                raise CapsuleError(f"capsule {cap.id} lives in the time-travel ring; fork it to keep or move it")
            if cap.tier == tier:
                return
            self._make_room(tier, cap.nbytes, protect={cap.id}, for_what=f"move of {cap.id} to {tier}")
            self._relocate(cap, tier)

    def export(self, capsule_id: str, path) -> None:
        with self._lock:
            cap = self._get(capsule_id)
            if cap.tier == "disk":
                tensors = self._load_disk(cap, f"export of capsule {cap.id}")
            else:
                cap.slab.wait_host()
                tensors = cap.slab.views
            diskfmt.write_capsule(path, capsule_id=cap.id, name=cap.name, created=cap.created,
                                  fingerprint=self.fingerprint.to_dict(),
                                  fingerprint_digest=self.fingerprint.digest(), meta=cap.meta,
                                  tensors=tensors)

    def import_(self, path, tier: str = "host") -> str:
        """Load an exported capsule into `tier` (a new id); refuses other fingerprints and corrupt files."""
        self._check_tier(tier)
        what = f"import of {diskfmt.capsule_dir(path)}"
        manifest, mcheck = diskfmt.read_manifest(path)
        if not mcheck.ok:
            raise CapsuleError(f"{what}: {mcheck.detail}")
        theirs = Fingerprint.from_dict(manifest.get("fingerprint", {}))
        diffs = self.fingerprint.diff(theirs)
        if diffs:
            raise CapsuleError(f"{what}: fingerprint differs (this runtime != file): " + "; ".join(diffs))
        manifest, tensors = diskfmt.load_capsule(path, what)
        self._full_check(tensors, what)  # (a hand-edited manifest may list other buffers than its fingerprint)
        meta = _own_meta(decode_meta(manifest["meta"]))
        with self._lock:
            self._make_room(tier, self.capsule_bytes, protect=set(), for_what=what)
            cap = self._new(str(manifest.get("name", "")), tier, meta)
            if tier == "disk":
                self._write_disk(cap, tensors)
            else:
                cap.slab = self._slab(tier)
                self._copier.tensors_to_slab(cap.slab, tensors)
            self._caps[cap.id] = cap
            return cap.id

    def record(self, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> str | None:
        """Time travel: keep this decision in a ring of the last `ring` decisions (None when ring=0)."""
        if self.ring == 0:
            return None
        meta = _own_meta(meta)
        with self._lock:
            live = self._check_buffers(tensors, "time-travel record")
            if not self._ring_slots:
                # Reserve every slot once, so a decision never allocates; the ring counts against the device budget.
                self._make_room("device", self.ring * self.capsule_bytes, protect=set(),
                                for_what=f"time-travel ring of {self.ring}")
                self._ring_slots = [self._slab("device") for _ in range(self.ring)]
                self._ring_ids = [None] * self.ring
            i = self._ring_next % self.ring
            self._ring_next += 1
            if self._ring_ids[i] is not None:
                self._caps.pop(self._ring_ids[i], None)
            cap = self._new(f"ring/{self._ring_next}", "device", meta)
            cap.ring, cap.slab = True, self._ring_slots[i]
            self._copier.live_to_slab(cap.slab, live, self._live_gen)
            self._caps[cap.id] = cap
            self._ring_ids[i] = cap.id
            return cap.id

    def used(self, tier: str) -> int:
        """Bytes a tier holds (the ring's reserved slots count as device bytes)."""
        with self._lock:
            held = sum(c.nbytes for c in self._caps.values() if c.tier == tier and not c.ring)
            return held + (len(self._ring_slots) * self.capsule_bytes if tier == "device" else 0)

    # ---------------------------------------------------------------- internals
    def _check_tier(self, tier: str) -> None:
        if tier not in TIERS:
            raise CapsuleError(f"tier must be one of {list(TIERS)}, got {tier!r}")
        if tier == "disk" and self.disk_dir is None:
            raise CapsuleError("tier 'disk' needs a disk_dir; create the CapsuleStore with disk_dir=...")

    def _check_buffers(self, tensors: Mapping[str, torch.Tensor], what: str) -> list:
        """The live tensors in plan order, after checking them against the layout (call under the lock).

        Fast path: the same tensor objects at the same addresses with the same shapes and dtypes as the
        last ones checked (the store holds those objects, so their ids cannot be reused meanwhile); any
        change - another object, set_/resize_, a retype through .data - runs the full check again and
        bumps the generation the Copier's cached copy lists depend on.
        """
        names = self._plan.names
        if len(tensors) == len(names) and self._live_sig is not None:
            try:
                live = [tensors[n] for n in names]
                sig = _signature(live)
            except (KeyError, AttributeError):  # a missing name or a non-tensor: the full check names it
                sig = None
            if sig == self._live_sig:
                return live
        self._full_check(tensors, what)
        live = [tensors[n] for n in names]
        self._live, self._live_sig = live, _signature(live)
        self._live_gen += 1
        return live

    def _full_check(self, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        layout = self.fingerprint.layout
        if len(tensors) != len(layout) or any(n not in tensors for n in layout):
            missing = [n for n in layout if n not in tensors]
            extra = [n for n in tensors if n not in layout]
            raise CapsuleError(f"{what}: buffers do not match the fingerprint layout: "
                               f"missing {missing}, unexpected {extra}")
        for name, (size, dt) in self._expect.items():
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise CapsuleError(f"{what}: buffer {name} is a {type(t).__name__}, not a tensor")
            if t.shape != size or t.dtype != dt:
                shape, dtype = layout[name]
                raise CapsuleError(f"{what}: buffer {name} is {dtype_name(t.dtype)} {shape_text(t.shape)}, "
                                   f"the fingerprint says {dtype} {shape_text(shape)}")

    def _get(self, capsule_id: str) -> _Capsule:
        cap = self._caps.get(capsule_id)
        if cap is None:
            known = ", ".join(sorted(self._caps)) or "none"
            raise CapsuleError(f"unknown capsule id {capsule_id!r} (known: {known})")
        return cap

    def _new(self, name: str, tier: str, meta: dict) -> _Capsule:
        self._seq += 1
        return _Capsule(id=f"c{self._seq:04d}-{self._tag}", name=str(name), tier=tier, nbytes=self.capsule_bytes,
                        created=time.time(), seq=self._seq, meta=meta,
                        decision_id=meta.get("decision_id", meta.get("decisions")))

    def _slab(self, tier: str) -> Slab:
        if tier == "device":
            return Slab(self._plan, self.device)
        return Slab(self._plan, torch.device("cpu"), pinned=self._pinned)

    def _write_disk(self, cap: _Capsule, tensors: Mapping[str, torch.Tensor]) -> None:
        path = self.disk_dir / cap.id
        diskfmt.write_capsule(path, capsule_id=cap.id, name=cap.name, created=cap.created,
                              fingerprint=self.fingerprint.to_dict(), fingerprint_digest=self.fingerprint.digest(),
                              meta=cap.meta, tensors=tensors)
        cap.path, cap.tier = path, "disk"

    def _load_disk(self, cap: _Capsule, what: str) -> dict[str, torch.Tensor]:
        manifest, tensors = diskfmt.load_capsule(cap.path, what)
        diffs = self.fingerprint.diff(Fingerprint.from_dict(manifest["fingerprint"]))
        if diffs:
            raise CapsuleError(f"{what}: file {cap.path} has another fingerprint (runtime != file): "
                               + "; ".join(diffs))
        return tensors

    def _relocate(self, cap: _Capsule, tier: str) -> None:
        """Move a capsule's bytes to `tier`: the new copy is complete before the old one is freed."""
        if tier == "disk":
            cap.slab.wait_host()
            self._write_disk(cap, cap.slab.views)
            cap.slab = None
            return
        slab = self._slab(tier)
        old_path = cap.path
        if cap.tier == "disk":
            self._copier.tensors_to_slab(slab, self._load_disk(cap, f"move of capsule {cap.id}"))
        else:
            self._copier.slab_to_slab(slab, cap.slab)
        cap.slab, cap.tier, cap.path = slab, tier, None
        if old_path is not None:
            shutil.rmtree(old_path, ignore_errors=True)

    def _make_room(self, tier: str, need: int, protect: set, for_what: str) -> None:
        """Plan every eviction first (so a refusal changes nothing), then run it deepest tier first."""
        for cap, to in self._plan_room(tier, need, protect, for_what):
            self._relocate(cap, to)

    def _plan_room(self, tier: str, need: int, protect: set, for_what: str) -> list:
        budget = self.budgets[tier]
        if budget is None:
            return []
        used = self.used(tier)
        free = budget - used
        if need <= free:
            return []
        holders = [c for c in sorted(self._caps.values(), key=lambda c: c.seq) if c.tier == tier and not c.ring]
        where = (f"{for_what}: {tier} tier budget is full: needs {need} bytes, {max(free, 0)} of {budget} free "
                 f"(held by {[c.id for c in holders] or 'nothing'})")
        if need > budget:
            raise CapsuleError(f"{for_what}: needs {need} bytes, more than the whole {tier} budget of {budget}")
        if self.on_full == "refuse":
            raise CapsuleError(f"{where}; drop or move a capsule, raise budgets[{tier!r}], or use on_full='evict'")
        nxt = _NEXT[tier]
        if nxt is None or (nxt == "disk" and self.disk_dir is None):
            raise CapsuleError(f"{where}; nothing to evict to below the {tier} tier"
                               + (" (no disk_dir)" if nxt == "disk" else ""))
        victims, freed = [], 0
        for cap in holders:
            if cap.id in protect:
                continue
            victims.append(cap)
            freed += cap.nbytes
            if free + freed >= need:
                break
        else:
            raise CapsuleError(f"{where}; not enough evictable capsules")
        deeper = self._plan_room(nxt, freed, protect | {c.id for c in victims}, for_what)
        return deeper + [(c, nxt) for c in victims]


def _signature(live: list) -> list:
    """(id, data address, shape, dtype) of each live tensor."""
    return [(id(t), t.data_ptr(), t.shape, t.dtype) for t in live]
