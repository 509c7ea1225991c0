"""`flashrt capsule inspect PATH`: print an exported capsule's manifest and verify every checksum."""
from __future__ import annotations

import json
import sys

from flashrt_core.capsule.diskfmt import created_unix, inspect
from flashrt_core.capsule.timefmt import iso_utc


def capsule_inspect(path, out=None) -> int:
    """Print the manifest and one line per check; 0 if every check passes, else 1."""
    out = out or sys.stdout
    manifest, checks = inspect(path)
    if manifest is not None:
        fp = manifest.get("fingerprint", {})
        for key in ("id", "name", "created", "format", "version"):
            value = manifest.get(key)
            if key == "created" and value is not None:  # ISO 8601 UTC, whichever form the manifest holds
                value = iso_utc(created_unix(manifest))
            print(f"{key}: {value}", file=out)
        for key in ("model", "weights_digest", "precision"):
            print(f"fingerprint.{key}: {fp.get(key)}", file=out)
        print(f"fingerprint.digest: {manifest.get('fingerprint_digest')}", file=out)
        meta = manifest.get("meta", {})
        print("meta: " + json.dumps({k: v if not isinstance(v, dict) else "{...}" for k, v in meta.items()},
                                    sort_keys=True), file=out)
        print("buffers:", file=out)
        for name, spec in manifest.get("buffers", {}).items():
            print(f"  {name:<32} {spec.get('dtype')} {spec.get('shape')} {spec.get('nbytes')} bytes", file=out)
    for check in checks:
        print(f"{'OK  ' if check.ok else 'FAIL'} {check.item}: {check.detail}", file=out)
    failed = sum(not c.ok for c in checks)
    print(f"{len(checks) - failed} checks passed, {failed} failed", file=out)
    return 1 if failed else 0


def add_subparsers(subparsers):
    """Register `capsule inspect PATH` on an argparse subparsers object; the handler is in `func`. Returns the
    `capsule` verbs, so that a shell around the engine can add its own (flashrt_ros: the services of a running
    node)."""
    capsule = subparsers.add_parser("capsule", help="execution-state capsules: inspect files, or (with a node) "
                                                    "list, snapshot, restore, fork, drop, export, import")
    verbs = capsule.add_subparsers(dest="capsule_verb", required=True)
    insp = verbs.add_parser("inspect", help="print the manifest and verify every buffer checksum")
    insp.add_argument("path", help="capsule folder (or its manifest.json / buffers.safetensors)")
    insp.set_defaults(func=lambda args: capsule_inspect(args.path))
    return verbs
