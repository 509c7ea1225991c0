"""~/snapshot, ~/restore, ~/fork, ~/list_capsules, ~/drop_capsule on top of the node's Runtime.

Every handler takes the runtime lock, so it runs between two control ticks; every failure (unknown id,
fingerprint mismatch, budget, unconfigured node) is answered with ok=false and the reason.
"""
from __future__ import annotations

from flashrt_ros.msg import CapsuleInfo
from flashrt_ros.srv import DropCapsule, ForkCapsule, ListCapsules, RestoreCapsule, SnapshotCapsule


class CapsuleServices:
    def __init__(self, node):
        self.node = node
        self._services = []

    def create_services(self):
        node = self.node
        for srv_type, name, handler in (
            (SnapshotCapsule, "~/snapshot", self._snapshot),
            (RestoreCapsule, "~/restore", self._restore),
            (ForkCapsule, "~/fork", self._fork),
            (ListCapsules, "~/list_capsules", self._list),
            (DropCapsule, "~/drop_capsule", self._drop),
        ):
            self._services.append(node.create_service(srv_type, name, self._guard(handler)))

    def destroy_services(self):
        for service in self._services:
            self.node.destroy_service(service)
        self._services.clear()

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
        response.capsule_id = runtime.snapshot(request.name or "snapshot", tier=request.tier or "device")
        response.message = f"snapshot '{request.name}' -> {response.capsule_id}"

    @staticmethod
    def _restore(runtime, request, response):
        runtime.restore(request.capsule_id)
        response.message = f"restored {request.capsule_id}"

    @staticmethod
    def _fork(runtime, request, response):
        response.capsule_id = runtime.fork(request.capsule_id, name=request.name or "fork")
        response.message = f"forked {request.capsule_id} -> {response.capsule_id}"

    @staticmethod
    def _list(runtime, request, response):
        for entry in runtime.list_capsules():
            response.capsules.append(CapsuleInfo(
                capsule_id=str(entry["id"]), name=str(entry["name"]), tier=str(entry["tier"]),
                size_bytes=int(entry["bytes"]), decision_id=int(entry.get("decision_id") or 0),
                created_unix_s=float(entry.get("created") or 0.0)))
        response.message = f"{len(response.capsules)} capsule(s)"

    @staticmethod
    def _drop(runtime, request, response):
        runtime.drop_capsule(request.capsule_id)
        response.message = f"dropped {request.capsule_id}"
