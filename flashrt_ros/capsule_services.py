"""The node's capsules: ~/snapshot, ~/restore, ~/fork, ~/list_capsules, ~/drop_capsule, ~/export_capsule,
~/import_capsule on top of its Runtime, and the capsule parameters (capsule_params) applied at configure.

Every call but a listing runs on the capsule thread, one at a time, while the executor goes on with the control
ticks and sensor callbacks (the service callback awaits it). Only the copies from or into the live buffers
(snapshot, restore) take the runtime lock, between two ticks; disk work (the disk tier, export, import: a full
pi0.5 state is megabytes of files with checksums) holds no lock a tick needs. Every outcome is logged and counted
on /diagnostics (`NodeHealth.capsule_done`); every failure (unknown id, fingerprint mismatch, budget,
unconfigured node) is answered with ok=false and the reason.
"""
from __future__ import annotations

import contextlib
import pathlib
import queue
import threading
import time

from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.task import Future

from flashrt_core.capsule.options import mb_text
from flashrt_core.capsule.store import TIERS
from flashrt_ros import capsule_params
from flashrt_ros.msg import CapsuleInfo
from flashrt_ros.srv import (DropCapsule, ExportCapsule, ForkCapsule, ImportCapsule, ListCapsules, RestoreCapsule,
                             SnapshotCapsule)


BUSY_WAIT_S = 30.0  # how long cleanup waits for a capsule call in progress before it closes the runtime anyway


class CapsuleServices:
    def __init__(self, node):
        self.node = node
        self._services = []
        # the capsule thread: a daemon, so that a call stuck at its files (a hung network disk) never keeps the
        # process from exiting (a ThreadPoolExecutor's workers are joined at exit)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name="capsules", daemon=True)
        self._worker.start()
        self.busy = threading.Lock()  # held by the capsule thread for each call (cleanup waits for it)
        self._group = ReentrantCallbackGroup()
        self._io_base: pathlib.Path | None = None  # capsule_dir: relative export / import paths start there
        self._io_roots: list[pathlib.Path] = []  # the folders export / import may touch (set at configure)
        self.parameter_errors = capsule_params.declare(node)  # (the node reports them)
        node.add_on_set_parameters_callback(self._on_set_parameters)
        self._create_services()

    def idle(self, timeout: float = BUSY_WAIT_S) -> bool:
        """Wait until no capsule call runs (before the runtime is closed); False after `timeout` seconds."""
        if not self.busy.acquire(timeout=timeout):
            return False
        self.busy.release()
        return True

    def shutdown(self) -> None:
        """Calls still queued are not run (a call in progress is left to end with the process)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (work := self._calls.get()) is not None:
            work()

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
        self._io_base = pathlib.Path(p.capsule_dir).expanduser().resolve() if p.capsule_dir else None
        self._io_roots = ([self._io_base] if self._io_base else []) + [
            pathlib.Path(d).expanduser().resolve() for d in p.io_dirs]
        if p.capsule_dir:
            log.info(f"capsule_dir {store.disk_dir}: {len(store.relisted)} capsule(s) listed again")
        notes = [f"removed {r}" for r in store.removed_partial] + [f"not listed: {r}" for r in store.relist_skipped]
        for note in notes:
            log.warning(f"capsule_dir {store.disk_dir}: {note}")
        self.node.health.capsule_dir_notes = notes

    def _create_services(self):
        """The services, for the node's whole life (not per configure: a reply still due when the node cleans up
        must find its service); unconfigured, each call answers "policy node is not configured"."""
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
            verb = name.removeprefix("~/")
            # (a listing reads the store only: answered at once, even while another call waits for its files)
            call = self._inline(verb, handler) if verb == "list_capsules" else self._guard(verb, handler)
            # (a group of their own, reentrant: a call awaiting the capsule thread holds back neither the
            # node's default group (sensor callbacks, timers) nor a listing)
            self._services.append(node.create_service(srv_type, name, call, callback_group=self._group))

    def _on_set_parameters(self, parameters) -> SetParametersResult:
        """The capsule parameters are read at configure: while configured a change is refused, not ignored."""
        if self.node.runtime is not None:
            for p in parameters:
                if p.name in capsule_params.PARAMETERS:
                    return SetParametersResult(successful=False, reason=(
                        f"{p.name}: read at configure; deactivate, clean up and configure again to change it"))
        return SetParametersResult(successful=True)

    def _guard(self, verb: str, handler):
        async def call(request, response):
            done = Future()

            def work():
                try:
                    done.set_result(self.run(verb, handler, request, response))
                except BaseException as exc:  # (run answers every Exception itself; this is the rest)
                    done.set_exception(exc)
                executor = self.node.executor  # (the awaiting callback resumes at the executor's next wake)
                if executor is not None:
                    executor.wake()

            self._calls.put(work)
            return await done

        return call

    def _inline(self, verb: str, handler):
        return lambda request, response: self.run(verb, handler, request, response, serial=False)

    def _runtime(self):
        with self.node.runtime_lock:  # (cleanup detaches the runtime under it before it closes it)
            return self.node.runtime

    def run(self, verb: str, handler, request, response, serial: bool = True):
        """One call (on the capsule thread where serial): the handler, its outcome logged and counted; the filled
        response."""
        with self.busy if serial else contextlib.nullcontext():
            runtime = self._runtime()
            t0 = time.monotonic()
            if runtime is None:
                response.ok, response.message = False, "policy node is not configured"
            else:
                try:
                    handler(runtime, request, response)
                    response.ok = True
                except Exception as exc:  # CapsuleError and anything unexpected: answer, never crash
                    response.ok, response.message = False, f"{type(exc).__name__}: {exc}"
            took_ms = (time.monotonic() - t0) * 1e3
            self.node.health.capsule_done(verb, response.ok, response.message)
            log = self.node.get_logger()
            if response.ok and verb != "list_capsules":
                log.info(f"capsule {verb}: {response.message} ({took_ms:.0f} ms)")
            elif not response.ok:
                log.warning(f"capsule {verb} failed: {response.message}")
        return response

    def _snapshot(self, runtime, request, response):
        name = request.name or "snapshot"  # (an empty name: the capsule is named "snapshot", and so says the reply)
        with self.node.runtime_lock:  # (the live buffers' copy, between two ticks; a disk capsule's files after)
            finish = runtime.begin_snapshot(name, tier=request.tier or "device")
        response.capsule_id = finish()
        response.message = f"snapshot '{name}' -> {response.capsule_id}" + _dropped(runtime)

    def _restore(self, runtime, request, response):
        loaded = runtime.load_capsule(request.capsule_id)  # (a disk capsule's files: read before the lock)
        with self.node.runtime_lock:
            runtime.restore(request.capsule_id, rewind_time=request.rewind_time, loaded=loaded)
            if request.rewind_time:  # the node's per-topic stamp checks rewind too (re-sent messages are accepted)
                self.node.rewound(runtime.runtime_meta().get("last_stamp_ns"))
            task = runtime.prompt
        self.node.follow_prompt(task)  # (the capsule's task is the running one now)
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

    def _export(self, runtime, request, response):
        folder = self._folder(request.path)
        runtime.export_capsule(request.id, folder)
        response.path = str(folder)
        response.message = f"exported {request.id} -> {folder}"

    def _import(self, runtime, request, response):
        folder = self._folder(request.path)
        response.id = runtime.import_capsule(folder, tier=request.tier or "host")
        response.message = f"imported {folder} -> {response.id} ({request.tier or 'host'})" + _dropped(runtime)

    def _folder(self, path: str) -> pathlib.Path:
        """The folder an export writes or an import reads: a relative path is taken in capsule_dir, and the
        result (symbolic links and '..' resolved) must lie inside capsule_dir or a capsule_io_dirs folder. Any
        peer on the ROS domain may call these services: without this they wrote and read wherever the node's user
        may. Refused here, by name, before anything is read or written."""
        if not path.strip():
            raise ValueError("path: empty; give the capsule folder (on the node's machine)")
        given = pathlib.Path(path).expanduser()
        if not given.is_absolute():
            if self._io_base is None:
                raise ValueError(f"path '{path}' is relative and the node has no capsule_dir to take it in; give "
                                 "an absolute path inside capsule_io_dirs, or set capsule_dir")
            given = self._io_base / given
        folder = given.resolve()
        if not any(root in folder.parents for root in self._io_roots):
            allowed = ", ".join(str(r) for r in self._io_roots) or "none: capsule_dir and capsule_io_dirs are unset"
            raise ValueError(f"path '{path}' ({folder}) is outside the folders capsule export and import may use "
                             f"({allowed}); refused, nothing read or written (node parameters capsule_dir, "
                             "capsule_io_dirs)")
        return folder


def _dropped(runtime) -> str:
    ids = runtime.capsules.last_dropped if runtime.capsules is not None else []
    return f" (capsule_eviction oldest: dropped {', '.join(ids)} to make room)" if ids else ""
