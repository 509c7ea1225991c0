"""The capsule verbs of `Runtime`, as functions of a runtime, bound as methods by the contract module.

A runtime provides `persistent_buffers() -> {name: tensor}` (the live, graph-captured buffers),
`runtime_meta() -> dict` (decision counter, stamps, RNG state, prompt state), `apply_meta(meta)`,
`fingerprint_fields() -> dict` (model, weights_digest, precision and optionally layout), a `capsules`
attribute that starts as None and optionally `capsule_options` (capsule.options: budgets, eviction, folder).
The store is created by `prepare` (the runtime's warmup) or else at the first capsule verb.
"""
from __future__ import annotations

import tempfile
import weakref

import torch

from flashrt_core.capsule.fingerprint import Fingerprint, fingerprint
from flashrt_core.capsule.options import CapsuleOptions, capsule_options
from flashrt_core.capsule.store import CapsuleStore
from flashrt_core.errors import CapsuleError


def runtime_fingerprint(rt) -> Fingerprint:
    fields = dict(rt.fingerprint_fields())
    if "layout" not in fields:
        fields["layout"] = rt.persistent_buffers()
    try:
        return fingerprint(fields["model"], fields["weights_digest"], fields["precision"], fields["layout"])
    except KeyError as exc:
        raise CapsuleError(f"runtime fingerprint_fields() lacks field {exc}") from exc


def _device_of(rt):
    """The runtime's compute device (some persistent buffers may be placed on the host)."""
    if getattr(rt, "device", None) is not None:
        return rt.device
    devices = [t.device for t in rt.persistent_buffers().values()]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def configure_capsules(rt, *, budgets=None, on_full="refuse", disk_dir=None, ring=0,
                       owns_disk_dir=False) -> CapsuleStore:
    """Create (or replace, if none exists yet) the runtime's capsule store with these options."""
    if getattr(rt, "capsules", None) is not None and rt.capsules.list():
        raise CapsuleError("configure_capsules: the runtime already holds capsules; drop them first")
    if getattr(rt, "capsules", None) is not None:
        rt.capsules.close()  # (empty: this only removes a temporary folder it owned)
    rt.capsules = CapsuleStore(runtime_fingerprint(rt), device=_device_of(rt), budgets=budgets,
                               on_full=on_full, disk_dir=disk_dir, ring=ring, owns_disk_dir=owns_disk_dir)
    return rt.capsules


def _options(rt) -> CapsuleOptions:
    opts = getattr(rt, "capsule_options", None)
    return opts if opts is not None else capsule_options()


def capsule_store(rt) -> CapsuleStore:
    if getattr(rt, "capsules", None) is None:
        opts = _options(rt)
        # Without a capsule_dir the disk tier still works, in a private temporary folder (the store's own:
        # removed when the runtime closes, or at exit). A capsule_dir is kept, and what it holds is listed.
        folder = opts.capsule_dir
        if folder is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CapsuleError(f"capsule_dir: cannot create {folder}: {exc}") from exc
        configure_capsules(rt, budgets=opts.budget_bytes(), on_full=opts.on_full,
                           disk_dir=folder if folder is not None else tempfile.mkdtemp(prefix="flashrt_capsules_"),
                           owns_disk_dir=folder is None)
    return rt.capsules


def prepare(rt) -> CapsuleStore:
    """Make the store ready at start-up (Runtime.warmup): the fingerprint (the weights digest: sha256 over every
    weight, seconds for a full-size model), the store, its spare slabs and warm copy paths. Without it the
    first snapshot did all of that between two control ticks."""
    store = _checked_store(rt, "capsule warm-up")
    store.prepare(rt.persistent_buffers())
    return store


def reconfigure(rt, options: CapsuleOptions) -> CapsuleStore:
    """New capsule options for a runtime that holds no capsule it made (capsules listed again from its old
    capsule_dir do not count: they stay in their folder); the new store is made ready at once."""
    store = getattr(rt, "capsules", None)
    if store is not None and any(c["id"] not in store.relisted for c in store.list()):
        raise CapsuleError("capsule options: the runtime already holds capsules; drop them first")
    if store is not None:
        store.close()
        rt.capsules = None
    rt.capsule_options = options
    return prepare(rt)


def _config_key(rt):
    """Weak references to the objects a runtime's fingerprint is computed from (its contract and model
    binding) and its cached weights digest; None when the runtime has no such objects."""
    contract, binding = getattr(rt, "contract", None), getattr(rt, "binding", None)
    if contract is None or binding is None:
        return None
    try:
        return weakref.ref(contract), weakref.ref(binding), getattr(rt, "_weights_digest", None)
    except TypeError:  # objects without weak references: check the full fingerprint every time
        return None


def _same_config(rt, key) -> bool:
    return (key is not None and key[0]() is getattr(rt, "contract", None) and key[1]() is getattr(rt, "binding", None)
            and key[2] == getattr(rt, "_weights_digest", None))


def _checked_store(rt, what: str) -> CapsuleStore:
    """The store, after checking the runtime was not re-configured under it (other weights, dtype, layout).

    Computing the fingerprint (model identity, layout) costs more than a restore's copy, so it is redone
    only when the runtime's contract or binding are other objects or its weights digest changed; the live
    buffers' shapes and dtypes are checked by the store on every call anyway.
    """
    store = capsule_store(rt)
    if _same_config(rt, store.verified_config):
        return store
    live = runtime_fingerprint(rt)
    if live != store.fingerprint:
        diffs = "; ".join(store.fingerprint.diff(live))
        raise CapsuleError(f"{what}: the runtime's fingerprint changed since its capsules were made "
                           f"(capsules != runtime): {diffs}")
    store.verified_config = _config_key(rt)
    return store


def begin_snapshot(rt, name: str, tier: str = "device"):
    """Copy the live buffers and meta now; -> the call that finishes the capsule (the disk tier: writes its files,
    without the live buffers) and returns its id."""
    return _checked_store(rt, f"snapshot {name!r}").begin_snapshot(name, tier, rt.persistent_buffers(),
                                                                    rt.runtime_meta())


def load(rt, capsule_id: str):
    """A disk capsule's tensors read and verified, for `restore(..., loaded=)` (None in a memory tier)."""
    return _checked_store(rt, f"restore of {capsule_id}").load(capsule_id)


def restore(rt, capsule_id: str, rewind_time: bool = False, loaded=None) -> dict:
    """Copy the capsule into the live buffers, then apply its meta, so the next step continues that branch:
    live (the rate grid and the input watermark go on from now) or with rewind_time (they return to the
    snapshot's; see contract.host_state).

    The runtime's `check_meta` (when it has one) vets the meta before any copy, so a meta that does not
    fit this runtime is refused with the live buffers and host state untouched. Returns what was restored
    (capsule id, decisions, step, prompt): the meta itself stays private to the capsule, and not copying it
    keeps the host's share of a restore small (it runs between two control ticks).
    """
    store = _checked_store(rt, f"restore of {capsule_id}")
    meta = store.restore(capsule_id, rt.persistent_buffers(), check=getattr(rt, "check_meta", None),
                         copy_meta=False, loaded=loaded)
    rt.apply_meta(meta, rewind_time=rewind_time)  # takes no references into meta
    return {"capsule_id": capsule_id, "decisions": meta.get("decisions"), "step": meta.get("step"),
            "prompt": meta.get("prompt"), "rewind_time": rewind_time}


def fork(rt, capsule_id: str, name: str) -> str:
    return capsule_store(rt).fork(capsule_id, name)


def list_capsules(rt) -> list[dict]:
    if getattr(rt, "capsules", None) is None and _options(rt).capsule_dir is None:
        return []  # (nothing made yet, nothing to list again: no need to compute the fingerprint)
    return capsule_store(rt).list()


def drop_capsule(rt, capsule_id: str) -> None:
    if getattr(rt, "capsules", None) is None and _options(rt).capsule_dir is None:
        raise CapsuleError(f"unknown capsule id {capsule_id!r} (known: none)")
    capsule_store(rt).drop(capsule_id)


def move_capsule(rt, capsule_id: str, tier: str) -> None:
    capsule_store(rt).move(capsule_id, tier)


def export_capsule(rt, capsule_id: str, path) -> None:
    capsule_store(rt).export(capsule_id, path)


def import_capsule(rt, path, tier: str = "host") -> str:
    return _checked_store(rt, f"import of {path}").import_(path, tier)


def record_decision(rt) -> str | None:
    """Called by the runtime after each decision: feeds the time-travel ring when it is on."""
    store = getattr(rt, "capsules", None)
    if store is None or store.ring == 0:
        return None
    return store.record(rt.persistent_buffers(), rt.runtime_meta())
