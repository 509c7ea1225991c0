"""CapsuleStore: named copies of a runtime's persistent buffers in device, host or disk tiers.

Every capsule of a store shares the store's fingerprint (and so its buffer layout). Restore validates
everything it can before the first byte moves, so a refused restore leaves the live tensors untouched;
copies land in place, so CUDA graphs captured over the live buffers stay valid. Budgets bound each tier;
when one is full the store refuses, evicts the oldest capsules one tier down (device -> host -> disk), or
drops the tier's oldest, as `on_full` says (see capsule.room); it never drops a capsule unless told to.
A disk_dir the user names outlives the store: capsules found there when a store opens it are listed again,
and the temporary folders of a write that was killed (`.ID.tmp-PID-...` of a process that is gone) are removed;
the disk budget counts whatever lies in the folder, not only the store's capsules.
`prepare` does at start-up what a first snapshot would otherwise do between two control ticks.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import secrets
import shutil
import threading
import time
import weakref
from typing import Callable, Mapping

import torch

from flashrt_core.capsule import diskfmt, room
from flashrt_core.capsule.fingerprint import Fingerprint, dtype_name, shape_text
from flashrt_core.capsule.meta import clone_meta, copy_meta, decode_meta
from flashrt_core.capsule.slab import Copier, Slab, SlabPlan, torch_dtype
from flashrt_core.capsule.timefmt import iso_utc
from flashrt_core.errors import CapsuleError

TIERS = ("device", "host", "disk")
_PARTIAL = re.compile(r"^\.(?P<id>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")  # diskfmt.write_capsule's temporary folder
MEMORY_TIERS = ("device", "host")


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
        collection or the process's exit, removes it with every disk capsule in it. A folder of the user's is
        kept, and the capsules already in it (of this fingerprint) are listed again (see `relisted`)."""
        if on_full not in room.ON_FULL:
            raise CapsuleError(f"on_full must be one of {list(room.ON_FULL)}, got {on_full!r}")
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
        # Slabs this store allocated (a counter tests read), and one spare per memory tier once `prepare` ran:
        # a snapshot takes the spare, a drop gives its slab back, so a control loop's snapshots need not
        # allocate. A spare is not a capsule: budgets count capsules only.
        self.slabs_allocated = 0
        self._spare: dict[str, Slab | None] = dict.fromkeys(MEMORY_TIERS)
        self._keep_spares = False
        self.last_dropped: list[str] = []  # ids that the last snapshot / fork / import / move dropped for room
        self.relisted: list[str] = []  # ids found in the disk_dir when the store opened it
        self.relist_skipped: list[str] = []  # folders found there that are not capsules of this fingerprint
        self.removed_partial: list[str] = []  # temporary folders of killed writes found there, removed
        if self.disk_dir is not None and not owns_disk_dir and self.disk_dir.is_dir():
            self._remove_partial()
            self._relist()

    # ---------------------------------------------------------------- public verbs
    def snapshot(self, name: str, tier: str, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> str:
        return self.begin_snapshot(name, tier, tensors, meta)()

    def begin_snapshot(self, name: str, tier: str, tensors: Mapping[str, torch.Tensor],
                       meta: Mapping) -> Callable[[], str]:
        """Copy the live tensors now and return the call that finishes the capsule and returns its id. In a memory
        tier the capsule is whole already; in the disk tier the copy is a host staging slab and the call writes
        its files (without holding the live buffers: the caller may let its control loop run meanwhile)."""
        self._check_tier(tier)
        meta = _own_meta(meta)
        what = f"snapshot {name!r}"
        with self._lock:
            live = self._check_buffers(tensors, what)
            if tier != "disk":
                self._make_room(tier, self.capsule_bytes, protect=set(), for_what=what)
                cap = self._new(name, tier, meta)
                cap.slab = self._slab(tier)
                self._copier.live_to_slab(cap.slab, live, self._live_gen)
                self._caps[cap.id] = cap
                return lambda: cap.id
            room.plan(self, tier, self.capsule_bytes, set(), what)  # (refused here, before any copy)
            staging = self._slab("host")
            self._copier.live_to_slab(staging, live, self._live_gen)
        staging.wait_host()

        def finish() -> str:
            try:
                with self._lock:
                    self._make_room(tier, self.capsule_bytes, protect=set(), for_what=what)
                    cap = self._new(name, tier, meta)
                self._write_disk(cap, staging.views)  # (the files of a capsule no other call knows yet)
                with self._lock:
                    self._caps[cap.id] = cap
                return cap.id
            finally:
                with self._lock:
                    self._release(staging, "host")

        return finish

    def load(self, capsule_id: str) -> dict[str, torch.Tensor] | None:
        """A disk capsule's tensors, read and verified (checksums, fingerprint, layout) without holding the store,
        for `restore(..., loaded=)`; None for a capsule in a memory tier (restore copies it directly)."""
        with self._lock:
            cap = self._get(capsule_id)
            if cap.tier != "disk":
                return None
        return self._load_disk(cap, f"restore of capsule {capsule_id}")

    def restore(self, capsule_id: str, into: Mapping[str, torch.Tensor],
                check: Callable[[dict], None] | None = None, copy_meta: bool = True,
                loaded: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Copy a capsule into the live tensors in place; returns a copy of its meta (copy_meta=False: the
        capsule's own meta, for a caller that only reads it before its next call into the store). loaded: a
        disk capsule's tensors as `load` read them (else they are read here).

        Everything is validated before the first byte moves: the id, the live buffers against the layout,
        a disk capsule's checksums and fingerprint, and `check(meta)` (the runtime's own test that it can
        apply this meta), so a refused restore leaves the live tensors untouched.
        """
        what = f"restore of capsule {capsule_id}"
        with self._lock:
            cap = self._get(capsule_id)
            live = self._check_buffers(into, what)
            if cap.tier != "disk":
                loaded = None
            elif loaded is None:
                loaded = self._load_disk(cap, what)
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
                     "created_utc": iso_utc(c.created), "decision_id": c.decision_id, "ring": c.ring}
                    for c in sorted(self._caps.values(), key=lambda c: c.seq)]

    def drop(self, capsule_id: str) -> None:
        with self._lock:
            self._forget(self._get(capsule_id))

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Do now (at start-up) the work a first snapshot, restore or fork would do on the control path: check
        the live buffers and build their copy views, allocate one spare slab per memory tier (the host one
        pinned: the first pinned allocation is the slow one), and copy the live state into each once, which
        creates the side stream, loads the copy kernels and plans both copy directions on that slab. A tier
        whose budget cannot hold one capsule gets no spare. Leaves the live buffers untouched."""
        with self._lock:
            live = self._check_buffers(tensors, "capsule warm-up")
            self._keep_spares = True
            for tier in MEMORY_TIERS:
                budget = self.budgets[tier]
                if budget is not None and budget < self.capsule_bytes:
                    continue
                slab = self._slab(tier)
                self._copier.live_to_slab(slab, live, self._live_gen)
                self._copier.plan_restore(slab, live, self._live_gen)
                slab.wait_host()
                self._spare[tier] = slab

    def close(self) -> None:
        """Forget every capsule and free its memory. Disk capsules in a folder the user gave stay there (they
        are in the export format: `import_` reads them back); a folder of the store's own is removed."""
        with self._lock:
            self._caps.clear()
            self._ring_slots.clear()
            self._ring_ids.clear()
            self._spare = dict.fromkeys(MEMORY_TIERS)
            self._keep_spares = False
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
        """Write a capsule to `path`. A memory capsule is copied to the host under the store's lock, and the files
        are written after it (a ring snapshot of the control loop never waits for the disk)."""
        with self._lock:
            cap = self._get(capsule_id)
            if cap.tier != "disk":
                cap.slab.wait_host()
                # (host copies: a host slab's views are copied too, since a drop may hand the slab on)
                tensors = {n: t.to("cpu", copy=True) for n, t in cap.slab.views.items()}
            meta, header = clone_meta(cap.meta), (cap.id, cap.name, cap.created)
        if cap.tier == "disk":
            tensors = self._load_disk(cap, f"export of capsule {cap.id}")
        diskfmt.write_capsule(path, capsule_id=header[0], name=header[1], created=header[2],
                              fingerprint=self.fingerprint.to_dict(), fingerprint_digest=self.fingerprint.digest(),
                              meta=meta, tensors=tensors)

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
        """Bytes the capsules of a tier hold (the ring's reserved slots count as device bytes; spares do not); the
        disk tier also counts every other file in disk_dir (`other_disk_bytes`)."""
        with self._lock:
            held = sum(c.nbytes for c in self._caps.values() if c.tier == tier and not c.ring)
            if tier == "disk":
                held += self.other_disk_bytes()
            return held + (len(self._ring_slots) * self.capsule_bytes if tier == "device" else 0)

    def other_disk_bytes(self) -> int:
        """Bytes of the files in disk_dir that are not this store's capsules (another store's, another fingerprint's,
        a folder a write of another process is filling, anything put there): the disk is one, and so its budget.
        This process's writes in progress are not counted (their capsule is, once listed)."""
        if self.disk_dir is None or not self.disk_dir.is_dir():
            return 0
        with self._lock:
            own = {c.path.name for c in self._caps.values() if c.tier == "disk" and c.path is not None}
        mine = f".tmp-{os.getpid()}-"
        total = 0
        for entry in os.scandir(self.disk_dir):
            if entry.name in own or mine in entry.name:
                continue
            total += _tree_bytes(entry)
        return total

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

    def holders(self, tier: str) -> list[_Capsule]:
        """The capsules of a tier that a budget may move or drop (the ring's are not), oldest first."""
        return [c for c in sorted(self._caps.values(), key=lambda c: c.seq) if c.tier == tier and not c.ring]

    def _get(self, capsule_id: str) -> _Capsule:
        cap = self._caps.get(capsule_id)
        if cap is None:  # (the newest few: a store of hundreds would make an unreadable reply)
            known = room.ids_text([c.id for c in sorted(self._caps.values(), key=lambda c: c.seq)])
            raise CapsuleError(f"unknown capsule id {capsule_id!r} (known: {known})")
        return cap

    def _new(self, name: str, tier: str, meta: dict) -> _Capsule:
        self._seq += 1
        cid = f"c{self._seq:04d}-{self._tag}"
        # (an id listed again from the disk_dir; for a disk capsule also a folder someone left there: a stat,
        # which memory tiers skip as it costs a snapshot tens of microseconds)
        while cid in self._caps or (tier == "disk" and (self.disk_dir / cid).exists()):
            self._seq += 1
            cid = f"c{self._seq:04d}-{self._tag}"
        return _Capsule(id=cid, name=str(name), tier=tier, nbytes=self.capsule_bytes, created=time.time(),
                        seq=self._seq, meta=meta, decision_id=meta.get("decision_id", meta.get("decisions")))

    def _slab(self, tier: str) -> Slab:
        """The tier's spare slab when there is one, else a new allocation."""
        spare = self._spare.get(tier)
        if spare is not None:
            self._spare[tier] = None
            return spare
        self.slabs_allocated += 1
        if tier == "device":
            return Slab(self._plan, self.device)
        return Slab(self._plan, torch.device("cpu"), pinned=self._pinned)

    def _release(self, slab: Slab | None, tier: str) -> None:
        """A slab no capsule uses any more: kept as the tier's spare (after `prepare`), else freed."""
        if slab is not None and self._keep_spares and tier in MEMORY_TIERS and self._spare[tier] is None:
            self._spare[tier] = slab

    def _forget(self, cap: _Capsule) -> None:
        """Drop a capsule: its slab becomes a spare or is freed, its disk folder is removed."""
        del self._caps[cap.id]
        if cap.ring:
            self._ring_ids[self._ring_ids.index(cap.id)] = None
        elif cap.slab is not None:
            self._release(cap.slab, cap.tier)
        cap.slab = None
        if cap.path is not None:
            shutil.rmtree(cap.path, ignore_errors=True)

    def _remove_partial(self) -> None:
        """Remove the temporary folders that a write killed before its rename left in disk_dir (a process that is
        gone: another live one may be writing there now); each is said in `removed_partial`."""
        for entry in sorted(os.scandir(self.disk_dir), key=lambda e: e.name):
            match = _PARTIAL.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False) or _process_alive(int(match["pid"])):
                continue
            nbytes = _tree_bytes(entry)
            shutil.rmtree(entry.path, ignore_errors=True)
            self.removed_partial.append(f"{entry.name}: incomplete capsule {match['id']} ({nbytes} bytes) of a "
                                        f"write by process {match['pid']} that ended before it was done; removed")

    def _relist(self) -> None:
        """List the capsules of this fingerprint already in the disk_dir again (a restart), oldest first. Only
        manifests are read here, and the buffers file's size checked (missing or cut short: not listed, and
        said why); a capsule's checksums are verified when it is restored, forked or moved."""
        found = []
        for path in sorted(self.disk_dir.iterdir()):
            if path.name.startswith(".") or not (path / diskfmt.MANIFEST).is_file():
                continue  # (a half-written capsule is a dot folder until it is complete)
            manifest, check = diskfmt.read_manifest(path)
            try:
                if not check.ok:
                    raise CapsuleError(check.detail)
                diffs = self.fingerprint.diff(Fingerprint.from_dict(manifest["fingerprint"]))
                if diffs:
                    raise CapsuleError("another fingerprint (this runtime != file): " + "; ".join(diffs))
                meta = _own_meta(decode_meta(manifest["meta"]))
                created = diskfmt.created_unix(manifest)
                tensors = path / diskfmt.TENSORS
                if not tensors.is_file():
                    raise CapsuleError(f"{diskfmt.TENSORS} is missing")
                if tensors.stat().st_size < self.capsule_bytes:
                    raise CapsuleError(f"{diskfmt.TENSORS} is cut short ({tensors.stat().st_size} bytes, its buffers "
                                       f"alone take {self.capsule_bytes})")
            except CapsuleError as exc:
                self.relist_skipped.append(f"{path.name}: {exc}")
                continue
            found.append((created if created is not None else path.stat().st_mtime, path, manifest, meta))
        for created, path, manifest, meta in sorted(found, key=lambda f: f[0]):
            self._seq += 1
            self._caps[path.name] = _Capsule(
                id=path.name, name=str(manifest.get("name", "")), tier="disk", nbytes=self.capsule_bytes,
                created=created, seq=self._seq, meta=meta, path=path,
                decision_id=meta.get("decision_id", meta.get("decisions")))
            self.relisted.append(path.name)

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
        self._full_check(tensors, what)  # (a folder found in the disk_dir may list other buffers)
        return tensors

    def _relocate(self, cap: _Capsule, tier: str) -> None:
        """Move a capsule's bytes to `tier`: the new copy is complete before the old one is freed."""
        if tier == "disk":
            cap.slab.wait_host()
            old_tier = cap.tier
            self._write_disk(cap, cap.slab.views)
            self._release(cap.slab, old_tier)
            cap.slab = None
            return
        old_path, old_slab, old_tier = cap.path, cap.slab, cap.tier
        if cap.tier == "disk":
            loaded = self._load_disk(cap, f"move of capsule {cap.id}")  # verified before a slab is taken
            slab = self._slab(tier)
            self._copier.tensors_to_slab(slab, loaded)
        else:
            slab = self._slab(tier)
            self._copier.slab_to_slab(slab, cap.slab)
        cap.slab, cap.tier, cap.path = slab, tier, None
        self._release(old_slab, old_tier)
        if old_path is not None:
            shutil.rmtree(old_path, ignore_errors=True)

    def _make_room(self, tier: str, need: int, protect: set, for_what: str) -> None:
        """Plan every step first (so a refusal changes nothing), then carry them out; `last_dropped` says which
        capsules were dropped for it."""
        self.last_dropped = []
        for cap, to in room.plan(self, tier, need, protect, for_what):
            if to is None:
                self._forget(cap)
                self.last_dropped.append(cap.id)
            else:
                self._relocate(cap, to)


def _tree_bytes(entry) -> int:
    """Bytes of the files under a directory entry (symbolic links not followed)."""
    try:
        if not entry.is_dir(follow_symlinks=False):
            return entry.stat(follow_symlinks=False).st_size
        return sum(_tree_bytes(e) for e in os.scandir(entry.path))
    except OSError:  # (removed meanwhile: a drop, a rename)
        return 0


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return pid != 0


def _signature(live: list) -> list:
    """(id, data address, shape, dtype) of each live tensor."""
    return [(id(t), t.data_ptr(), t.shape, t.dtype) for t in live]
