"""The report folder as the evaluation's memory: `manifest.json` (what is evaluated: the fingerprint of the
contract, checkpoint weights, seed and inputs, plus the history of runs), one `bags/<key>.json` (+ `.npz`) per
bag written atomically as its result arrives, and the fleet report rebuilt from them. A run started again
with the same folder skips the bags that have a result; a folder of another evaluation is refused."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from flashrt_ros.evaluate.units import EvaluateError

MANIFEST = "manifest.json"


def _sha256(path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def checkpoint_identity(folder) -> str | None:
    """Names, sizes and contents of a checkpoint folder's small files, and the head and tail of its large ones
    (reading gigabytes of weights on every start would cost more than the check is worth; the workers' weight
    digests, checked too, cover every byte)."""
    if not folder:
        return None
    root = Path(folder)
    if not root.is_dir():
        return f"unreadable: {folder}"
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        size = p.stat().st_size
        h.update(f"{p.relative_to(root)}|{size}\n".encode())
        with open(p, "rb") as f:
            if size <= 1 << 22:
                h.update(f.read())
            else:
                h.update(f.read(1 << 20))
                f.seek(size - (1 << 20))
                h.update(f.read())
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Whole or not at all: a temporary file beside `path`, flushed to disk, then renamed over it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # (mkstemp makes it private; a report is for people to read)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
            + "\n").encode()


class ReportFolder:
    def __init__(self, root):
        self.root = Path(root)
        self.bags = self.root / "bags"
        self.written: set[str] = set()  # keys written by this run (a key is never written twice in a run)

    # ---- what is evaluated -------------------------------------------------------------------------------
    def open(self, fingerprint: dict) -> dict:
        """Create the folder, or check that its results belong to this evaluation; -> the manifest."""
        if self.root.exists() and not self.root.is_dir():
            raise EvaluateError(f"--report {self.root}: exists and is not a folder")
        path = self.root / MANIFEST
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
            except ValueError as e:
                raise EvaluateError(f"{path}: unreadable ({e}); use another --report folder") from None
            self.check(manifest.get("fingerprint", {}), fingerprint)
            return manifest
        if self.root.is_dir() and any(self.root.iterdir()):
            raise EvaluateError(f"--report {self.root}: a folder with other files and no {MANIFEST}: not an "
                                "evaluation's report folder; use a new or empty one")
        self.bags.mkdir(parents=True, exist_ok=True)
        manifest = {"fingerprint": fingerprint, "runs": []}
        self.save_manifest(manifest)
        return manifest

    def check(self, theirs: dict, ours: dict) -> None:
        differ = [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
        if differ:
            said = "; ".join(f"{k}: {_short(theirs.get(k))} there, {_short(ours.get(k))} here" for k in differ)
            raise EvaluateError(f"--report {self.root} holds results of another evaluation ({said}); results of "
                                "two evaluations are never mixed: use another --report folder")

    def save_manifest(self, manifest: dict) -> None:
        write_atomic(self.root / MANIFEST, _json_bytes(manifest))

    # ---- per-bag results ---------------------------------------------------------------------------------
    def has_result(self, key: str, retry_failed: bool = False) -> bool:
        row = self.load_row(key)
        return row is not None and not (retry_failed and row.get("status") != "ok")

    def load_row(self, key: str) -> dict | None:
        try:
            return json.loads((self.bags / f"{key}.json").read_text())
        except (OSError, ValueError):  # none yet (a half-written one cannot exist: written atomically)
            return None

    def load_arrays(self, key: str) -> dict:
        try:
            with np.load(self.bags / f"{key}.npz") as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError):
            return {}

    def write_result(self, row: dict, arrays: dict) -> None:
        """The arrays first, the row last: a bag has a result once its row exists."""
        key = row["key"]
        if key in self.written:
            raise AssertionError(f"bag {key} reported twice in one run")
        self.written.add(key)
        self.bags.mkdir(parents=True, exist_ok=True)
        if arrays:
            import io

            buf = io.BytesIO()
            np.savez_compressed(buf, **arrays)
            write_atomic(self.bags / f"{key}.npz", buf.getvalue())
        else:
            (self.bags / f"{key}.npz").unlink(missing_ok=True)
        write_atomic(self.bags / f"{key}.json", _json_bytes(row))


def _short(v) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 70 else s[:67] + "..."
