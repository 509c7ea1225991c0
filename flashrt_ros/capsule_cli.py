"""`flashrt capsule list|snapshot|restore|fork|drop|export|import --node NAME`: the capsule services of a running
policy node, from a pip install (no `ros2` command needed).

Paths go to the node as absolute paths (a relative one is taken from this shell's directory); the node reads
and writes them on its own machine. Exit status 0 when the node answered ok, 1 when it refused (its reason
is printed), 2 when it did not answer.
"""
from __future__ import annotations

import os
import sys

DEFAULT_NODE = "/policy_node"


def _service(node_name: str, service: str) -> str:
    node_name = node_name if node_name.startswith("/") else "/" + node_name
    return f"{node_name.rstrip('/')}/{service}"


SETTLE_S = 0.5  # after the service shows up: time for its response writer to find this new client too


def call_node(node_name: str, service: str, srv_type, request, timeout: float):
    """One call of a node's service from a short-lived client; None when it is not there or does not answer."""
    import time

    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        client_node = rclpy.create_node(f"flashrt_capsule_cli_{os.getpid()}", context=context)
        client = client_node.create_client(srv_type, _service(node_name, service))
        if not client.wait_for_service(timeout_sec=timeout):
            return None
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(client_node)
        # DDS matches the server's request reader (what wait_for_service sees) before its response writer has
        # found this client: a request sent at once can lose its answer. Export and import must not be sent
        # twice, so wait out discovery instead of retrying.
        settle = time.monotonic() + SETTLE_S
        while time.monotonic() < settle:
            executor.spin_once(timeout_sec=0.05)
        future = client.call_async(request)
        executor.spin_until_future_complete(future, timeout_sec=timeout)
        executor.shutdown()
        return future.result() if future.done() else None
    finally:
        rclpy.shutdown(context=context)


def _answer(args, service, srv_type, request):
    response = call_node(args.node, service, srv_type, request, args.timeout)
    if response is None:
        print(f"{_service(args.node, service)}: no answer within {args.timeout:g} s (is the node running and "
              "configured, on this ROS_DOMAIN_ID?)", file=sys.stderr)
        return None
    if not response.ok:
        print(f"{_service(args.node, service)} refused: {response.message}", file=sys.stderr)
    return response


def capsule_list(args, out=None) -> int:
    from flashrt_ros.srv import ListCapsules

    out = out or sys.stdout
    response = _answer(args, "list_capsules", ListCapsules, ListCapsules.Request())
    if response is None:
        return 2
    if not response.ok:
        return 1
    rows = [("id", "name", "tier", "size", "decision", "created (UTC)")]
    rows += [(c.capsule_id, c.name, c.tier, f"{c.size_bytes / 2 ** 20:.3f} MB", str(c.decision_id), c.created_utc)
             for c in response.capsules]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip(), file=out)
    print(response.message, file=out)
    return 0


def capsule_export(args, out=None) -> int:
    from flashrt_ros.srv import ExportCapsule

    out = out or sys.stdout
    request = ExportCapsule.Request(id=args.id, path=args.path)  # (a relative path is the node's: in its capsule_dir)
    response = _answer(args, "export_capsule", ExportCapsule, request)
    if response is None:
        return 2
    if response.ok:
        print(f"{args.id} -> {response.path}", file=out)
    return 0 if response.ok else 1


def capsule_import(args, out=None) -> int:
    from flashrt_ros.srv import ImportCapsule

    out = out or sys.stdout
    request = ImportCapsule.Request(path=args.path, tier=args.tier)
    response = _answer(args, "import_capsule", ImportCapsule, request)
    if response is None:
        return 2
    if response.ok:  # the id alone on stdout (`cid=$(flashrt capsule import DIR)`), the node's message beside it
        print(response.id, file=out)
        print(response.message, file=sys.stderr)
    return 0 if response.ok else 1


def _reply(args, service, srv_type, request, out=None, id_field: str | None = None) -> int:
    """Call a service and print its answer: the new capsule's id alone on stdout where it makes one
    (`cid=$(flashrt capsule snapshot NAME)`), the node's message on stderr."""
    response = _answer(args, service, srv_type, request)
    if response is None:
        return 2
    if response.ok:
        if id_field:
            print(getattr(response, id_field), file=out or sys.stdout)
            print(response.message, file=sys.stderr)
        else:
            print(response.message, file=out or sys.stdout)
    return 0 if response.ok else 1


def capsule_snapshot(args, out=None) -> int:
    from flashrt_ros.srv import SnapshotCapsule

    return _reply(args, "snapshot", SnapshotCapsule, SnapshotCapsule.Request(name=args.name, tier=args.tier), out,
                  id_field="capsule_id")


def capsule_restore(args, out=None) -> int:
    from flashrt_ros.srv import RestoreCapsule

    request = RestoreCapsule.Request(capsule_id=args.id, rewind_time=args.rewind_time)
    return _reply(args, "restore", RestoreCapsule, request, out)


def capsule_fork(args, out=None) -> int:
    from flashrt_ros.srv import ForkCapsule

    return _reply(args, "fork", ForkCapsule, ForkCapsule.Request(capsule_id=args.id, name=args.name), out,
                  id_field="capsule_id")


def capsule_drop(args, out=None) -> int:
    from flashrt_ros.srv import DropCapsule

    return _reply(args, "drop_capsule", DropCapsule, DropCapsule.Request(capsule_id=args.id), out)


def add_node_verbs(verbs) -> None:
    """Add list / export / import to the `flashrt capsule` verbs (flashrt_core.capsule.cli.add_subparsers)."""
    def common(p):
        p.add_argument("--node", default=DEFAULT_NODE, help=f"the policy node (default {DEFAULT_NODE})")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the node (default 10)")

    p = verbs.add_parser("list", help="the capsules a running node holds: id, name, tier, size, time")
    common(p)
    p.set_defaults(func=capsule_list)
    p = verbs.add_parser("snapshot", help="snapshot a running node's pipeline state (prints the new id)")
    p.add_argument("name", nargs="?", default="", help="a name for it (default: snapshot)")
    p.add_argument("--tier", default="device", choices=["device", "host", "disk"], help="where to keep it (device)")
    common(p)
    p.set_defaults(func=capsule_snapshot)
    p = verbs.add_parser("restore", help="restore a capsule into a running node (its next ticks go on from it)")
    p.add_argument("id", help="capsule id (see `flashrt capsule list`)")
    p.add_argument("--rewind-time", action="store_true",
                   help="the rate clocks and observation-stamp watermark return to the snapshot's too")
    common(p)
    p.set_defaults(func=capsule_restore)
    p = verbs.add_parser("fork", help="copy a node's capsule under a new id (prints it)")
    p.add_argument("id", help="capsule id")
    p.add_argument("name", nargs="?", default="", help="a name for the copy (default: fork)")
    common(p)
    p.set_defaults(func=capsule_fork)
    p = verbs.add_parser("drop", help="free a node's capsule")
    p.add_argument("id", help="capsule id")
    common(p)
    p.set_defaults(func=capsule_drop)
    p = verbs.add_parser("export", help="write a node's capsule to a folder (on the node's machine)")
    p.add_argument("id", help="capsule id (see `flashrt capsule list`)")
    p.add_argument("path", help="folder to write (must not exist), on the node's machine: relative to the node's "
                   "capsule_dir, or absolute inside capsule_dir or a folder of its capsule_io_dirs")
    common(p)
    p.set_defaults(func=capsule_export)
    p = verbs.add_parser("import", help="load an exported capsule folder into a running node")
    p.add_argument("path", help="capsule folder (or its manifest.json) on the node's machine: relative to the node's "
                   "capsule_dir, or absolute inside capsule_dir or a folder of its capsule_io_dirs")
    p.add_argument("--tier", default="host", choices=["device", "host", "disk"], help="where to keep it (host)")
    common(p)
    p.set_defaults(func=capsule_import)
