"""On-disk capsule: a folder with `buffers.safetensors` and `manifest.json` (sha256 per buffer).

Written into a temporary sibling folder and renamed into place, so a reader never sees half a capsule. The
manifest carries its own sha256 so a flipped byte in it (e.g. in the meta) is caught too. Reading checks
every buffer's byte range against the manifest before any tensor is built, and names the first bad buffer.
The manifest's `created` is ISO 8601 text in UTC (older manifests hold Unix seconds; both are read).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import secrets
import shutil
from typing import Any, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file as st_save_file

from flashrt_core.capsule.fingerprint import dtype_name
from flashrt_core.capsule.meta import encode_meta
from flashrt_core.capsule.timefmt import iso_utc, unix_seconds
from flashrt_core.errors import CapsuleError

FORMAT, VERSION = "flashrt-capsule", 1
TENSORS, MANIFEST = "buffers.safetensors", "manifest.json"


@dataclasses.dataclass(frozen=True)
class Check:
    """One integrity check of an on-disk capsule: `item` is 'manifest', 'file' or 'buffer NAME'."""
    item: str
    ok: bool
    detail: str


# ---- checksums and the manifest ----

def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_digest(manifest: Mapping) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return _sha(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_capsule(path, *, capsule_id: str, name: str, created: float, fingerprint: Mapping,
                  fingerprint_digest: str, meta: Mapping, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write atomically to folder `path` (must not exist). Returns the bytes of the tensors file."""
    path = pathlib.Path(path)
    if path.exists():
        raise CapsuleError(f"capsule path {path} already exists; choose another path or delete it first")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    cpu = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    try:
        tmp.mkdir()
        st_save_file(cpu, str(tmp / TENSORS))
        raw = (tmp / TENSORS).read_bytes()
        file_bytes, header_bytes = len(raw), raw[8:8 + int.from_bytes(raw[:8], "little")]
        manifest = {
            "format": FORMAT, "version": VERSION, "id": capsule_id, "name": name, "created": iso_utc(created),
            "fingerprint": dict(fingerprint), "fingerprint_digest": fingerprint_digest,
            "meta": encode_meta(meta), "tensors_file": TENSORS, "tensors_file_bytes": file_bytes,
            "header_sha256": _sha(header_bytes),
            "buffers": {k: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "nbytes": t.numel() * t.itemsize,
                            "sha256": _sha(tensor_bytes(t))} for k, t in cpu.items()},
        }
        manifest["manifest_sha256"] = _manifest_digest(manifest)
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / TENSORS, "rb") as f:
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CapsuleError(f"cannot write capsule {capsule_id} to {path}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return file_bytes


def capsule_dir(path) -> pathlib.Path:
    """Accept the capsule folder or either file inside it."""
    path = pathlib.Path(path)
    return path.parent if path.name in (TENSORS, MANIFEST) else path


def _layout_problem(manifest: Mapping) -> str | None:
    """What makes a manifest unusable before any checksum is looked at, or None."""
    for key in ("fingerprint", "meta", "buffers"):
        if not isinstance(manifest.get(key), dict):
            return f"{key} is a {type(manifest.get(key)).__name__}, not a mapping"
    for name, spec in manifest["buffers"].items():
        if not (isinstance(spec, dict) and isinstance(spec.get("shape"), list) and isinstance(spec.get("dtype"), str)
                and isinstance(spec.get("nbytes"), int) and isinstance(spec.get("sha256"), str)):
            return f"buffers.{name} lacks shape, dtype, nbytes or sha256"
    try:
        created_unix(manifest)
    except CapsuleError as exc:
        return str(exc)
    tensors = manifest.get("tensors_file", TENSORS)
    if not isinstance(tensors, str) or tensors in ("", ".", "..") or pathlib.PurePath(tensors).name != tensors:
        return f"tensors_file {tensors!r} is not a file name inside the capsule folder"
    return None


def created_unix(manifest: Mapping) -> float | None:
    """When the capsule was made, in Unix seconds (None when the manifest does not say)."""
    value = manifest.get("created")
    return None if value is None else unix_seconds(value, "created")


def read_manifest(path) -> tuple[dict | None, Check]:
    """The manifest and the check of its own integrity; (None, failed check) if unreadable."""
    folder = capsule_dir(path)
    if folder.exists() and not folder.is_dir():
        return None, Check("manifest", False, f"{folder} is not a capsule folder (a file; give the folder an export "
                                              f"wrote, or its {MANIFEST})")
    file = folder / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        return None, Check("manifest", False, f"{file} not found")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, Check("manifest", False, f"{file} unreadable: {exc}")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, Check("manifest", False, f"{file} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        return manifest, Check("manifest", False, f"{file}: version {manifest.get('version')} != {VERSION}")
    problem = _layout_problem(manifest)
    if problem:  # (nothing of it can be shown or followed: a field of the wrong type, a path out of the folder)
        return None, Check("manifest", False, f"{file}: malformed manifest: {problem}")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        return manifest, Check("manifest", False, f"{file}: manifest checksum failed (edited or corrupt)")
    return manifest, Check("manifest", True, f"{file}: checksum ok")


def check_buffers(path, manifest: Mapping) -> tuple[list[Check], bytes | None]:
    """Per-buffer checksum checks against the raw tensors file; also returns its bytes when readable."""
    file = capsule_dir(path) / manifest.get("tensors_file", TENSORS)
    try:
        data = file.read_bytes()
    except OSError as exc:
        return [Check("file", False, f"{file} unreadable: {exc}")], None
    checks = []
    want = manifest.get("tensors_file_bytes")
    size_ok = want == len(data)
    checks.append(Check("file", size_ok, f"{file}: {len(data)} bytes" +
                        ("" if size_ok else f" != {want} in manifest (truncated or appended)")))
    header, base = None, 0
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if n < 0 or 8 + n > len(data):
        checks.append(Check("header", False, f"{file}: safetensors header truncated"))
    elif _sha(data[8:8 + n]) != manifest.get("header_sha256"):
        checks.append(Check("header", False, f"{file}: safetensors header checksum failed (corrupt)"))
    else:
        header, base = json.loads(data[8:8 + n]), 8 + n
        checks.append(Check("header", True, f"{file}: header checksum ok"))
    if header is None:  # without a trusted header no buffer can be located
        return checks + [Check(f"buffer {k}", False, "not verified: header unusable")
                         for k in manifest.get("buffers", {})], data
    for name, spec in manifest.get("buffers", {}).items():
        entry = header.get(name)
        if not isinstance(entry, dict) or "data_offsets" not in entry:
            checks.append(Check(f"buffer {name}", False, f"missing from {file.name}"))
            continue
        begin, end = (base + int(o) for o in entry["data_offsets"])
        if end - begin != spec["nbytes"]:
            checks.append(Check(f"buffer {name}", False, f"{end - begin} bytes != {spec['nbytes']} in manifest"))
        elif end > len(data):
            checks.append(Check(f"buffer {name}", False, f"truncated: file ends {end - len(data)} bytes early"))
        elif _sha(data[begin:end]) != spec["sha256"]:
            checks.append(Check(f"buffer {name}", False, "sha256 checksum failed (corrupt)"))
        else:
            checks.append(Check(f"buffer {name}", True, f"sha256 ok, {spec['nbytes']} bytes"))
    return checks, data


def inspect(path) -> tuple[dict | None, list[Check]]:
    """The manifest of an on-disk capsule and every integrity check (never raises on bad data)."""
    manifest, mcheck = read_manifest(path)
    if manifest is None:
        return None, [mcheck]
    checks, _ = check_buffers(path, manifest)
    return manifest, [mcheck] + checks


def load_capsule(path, what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Manifest and CPU tensors of a fully verified capsule; CapsuleError naming the first failure."""
    manifest, mcheck = read_manifest(path)
    if not mcheck.ok:
        raise CapsuleError(f"{what}: {mcheck.detail}")
    checks, data = check_buffers(path, manifest)
    bad = [c for c in checks if not c.ok]
    if bad:
        # Most specific first: a bad header, then a named buffer, then the bare file-size mismatch.
        bad.sort(key=lambda c: (c.item != "header", not c.item.startswith("buffer")))
        first = bad[0]
        where = f"{first.item} in {capsule_dir(path)}: " if first.item.startswith("buffer") else ""
        raise CapsuleError(f"{what}: {where}{first.detail}")
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise CapsuleError(f"{what}: {capsule_dir(path) / TENSORS} unreadable: {exc}") from exc
    for name, spec in manifest["buffers"].items():
        t = tensors[name]
        if list(t.shape) != spec["shape"] or dtype_name(t.dtype) != spec["dtype"]:
            raise CapsuleError(f"{what}: buffer {name} in {capsule_dir(path)} is {dtype_name(t.dtype)}"
                               f"{list(t.shape)} but the manifest says {spec['dtype']}{spec['shape']}")
    extra = set(tensors) - set(manifest["buffers"])
    if extra:
        raise CapsuleError(f"{what}: {capsule_dir(path) / TENSORS} holds buffers not in the manifest: "
                           f"{sorted(extra)}")
    return manifest, tensors
