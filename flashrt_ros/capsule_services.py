"""The node's capsules: ~/snapshot, ~/restore, ~/fork, ~/list_capsules, ~/drop_capsule, ~/export_capsule,
~/import_capsule on top of its Runtime, and the capsule parameters (capsule_params) applied at configure.

Every handler takes the runtime lock, so it runs between two control ticks; every failure (unknown id,
fingerprint mismatch, budget, unconfigured node) is answered with ok=false and the reason.
"""
from __future__ import annotations

import pathlib

from rcl_interfaces.msg import SetParametersResult

from flashrt_core.capsule.options import mb_text
from flashrt_core.capsule.store import TIERS
from flashrt_ros import capsule_params
from flashrt_ros.msg import CapsuleInfo
from flashrt_ros.srv import (DropCapsule, ExportCapsule, ForkCapsule, ImportCapsule, ListCapsules, RestoreCapsule,
                             SnapshotCapsule)


class CapsuleServices:
    def __init__(self, node):
        self.node = node
        self._services = []
        capsule_params.declare(node)
        node.add_on_set_parameters_callback(self._on_set_parameters)

    def configure(self, runtime) -> None:
        """Apply the capsule parameters to a runtime being configured (before the node holds it): budgets,
        eviction, the capsule folder (whose capsules are listed again). On failure the runtime is closed and
        the error raised, naming the parameter."""
        try:
            p = capsule_params.read(self.node)
            runtime.configure_capsules(capsule_budget_mb=p.budget_mb, capsule_eviction=p.eviction,
                                       capsule_dir=p.capsule_dir or None)
        except Exception:
            runtime.close()
            raise
        store, log = runtime.capsules, self.node.get_logger()
        if p.capsule_dir:
            log.info(f"capsule_dir {store.disk_dir}: {len(store.relisted)} capsule(s) listed again")
        for skipped in store.relist_skipped:
            log.warning(f"capsule_dir {store.disk_dir}: not listed: {skipped}")

    def create_services(self):
        node = self.node
        for srv_type, name, handler in (
            (SnapshotCapsule, "~/snapshot", self._snapshot),
            (RestoreCapsule, "~/restore", self._restore),
            (ForkCapsule, "~/fork", self._fork),
            (ListCapsules, "~/list_capsules", self._list),
            (DropCapsule, "~/drop_capsule", self._drop),
            (ExportCapsule, "~/export_capsule", self._export),
            (ImportCapsule, "~/import_capsule", self._import),
        ):
            self._services.append(node.create_service(srv_type, name, self._guard(handler)))

    def destroy_services(self):
        for service in self._services:
            self.node.destroy_service(service)
        self._services.clear()

    def _on_set_parameters(self, parameters) -> SetParametersResult:
        """The capsule parameters are read at configure: while configured a change is refused, not ignored."""
        if self.node.runtime is not None:
            for p in parameters:
                if p.name in capsule_params.PARAMETERS:
                    return SetParametersResult(successful=False, reason=(
                        f"{p.name}: read at configure; deactivate, clean up and configure again to change it"))
        return SetParametersResult(successful=True)

    def _guard(self, handler):
        def call(request, response):
            with self.node.runtime_lock:
                runtime = self.node.runtime
                if runtime is None:
                    response.ok, response.message = False, "policy node is not configured"
                    return response
                try:
                    handler(runtime, request, response)
                    response.ok = True
                except Exception as exc:  # CapsuleError and anything unexpected: answer, never crash
                    response.ok, response.message = False, f"{type(exc).__name__}: {exc}"
                    self.node.get_logger().warning(f"capsule service failed: {response.message}")
            return response

        return call

    @staticmethod
    def _snapshot(runtime, request, response):
        name = request.name or "snapshot"  # (an empty name: the capsule is named "snapshot", and so says the reply)
        response.capsule_id = runtime.snapshot(name, tier=request.tier or "device")
        response.message = f"snapshot '{name}' -> {response.capsule_id}" + _dropped(runtime)

    def _restore(self, runtime, request, response):
        runtime.restore(request.capsule_id, rewind_time=request.rewind_time)
        if request.rewind_time:  # the node's per-topic stamp checks rewind too (re-sent messages are accepted)
            self.node.rewound(runtime.runtime_meta().get("last_stamp_ns"))
        response.message = f"restored {request.capsule_id} " + (
            "(rewind: rate clocks and the observation-stamp watermark are the snapshot's)" if request.rewind_time
            else "(live: the rate grid and observation stamps go on from now; the restored buffers keep their "
                 "observation's stamp, so an act over a prefix older than max_observation_age_ms waits for the next "
                 "observe)")

    @staticmethod
    def _fork(runtime, request, response):
        response.capsule_id = runtime.fork(request.capsule_id, name=request.name or "fork")
        response.message = f"forked {request.capsule_id} -> {response.capsule_id}" + _dropped(runtime)

    @staticmethod
    def _list(runtime, request, response):
        for entry in runtime.list_capsules():
            response.capsules.append(CapsuleInfo(
                capsule_id=str(entry["id"]), name=str(entry["name"]), tier=str(entry["tier"]),
                size_bytes=int(entry["bytes"]), decision_id=int(entry.get("decision_id") or 0),
                created_unix_s=float(entry.get("created") or 0.0), created_utc=str(entry.get("created_utc", ""))))
        response.message = f"{len(response.capsules)} capsule(s)"
        store = runtime.capsules
        if store is not None:
            response.message += "; held: " + ", ".join(
                f"{tier} {mb_text(store.used(tier))} of "
                + ("no bound" if store.budgets[tier] is None else mb_text(store.budgets[tier])) for tier in TIERS)

    @staticmethod
    def _drop(runtime, request, response):
        runtime.drop_capsule(request.capsule_id)
        response.message = f"dropped {request.capsule_id}"

    @staticmethod
    def _export(runtime, request, response):
        folder = _folder(request.path)
        runtime.export_capsule(request.id, folder)
        response.path = str(folder)
        response.message = f"exported {request.id} -> {folder}"

    @staticmethod
    def _import(runtime, request, response):
        folder = _folder(request.path)
        response.id = runtime.import_capsule(folder, tier=request.tier or "host")
        response.message = f"imported {folder} -> {response.id} ({request.tier or 'host'})" + _dropped(runtime)


def _folder(path: str) -> pathlib.Path:
    if not path.strip():
        raise ValueError("path: empty; give the capsule folder (on the node's machine)")
    return pathlib.Path(path).expanduser().resolve()


def _dropped(runtime) -> str:
    ids = runtime.capsules.last_dropped if runtime.capsules is not None else []
    return f" (capsule_eviction oldest: dropped {', '.join(ids)} to make room)" if ids else ""
