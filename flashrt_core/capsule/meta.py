"""Capsule meta: the host-side state beside the buffers (decision counter, stamps, RNG state, prompt).

Meta is plain data: numbers, strings, None, lists, tuples, string-keyed dicts, bytes and tensors. A
capsule keeps its own copy (so the caller may mutate what it passed or got back), and the disk tier stores
it as JSON with tagged tensors / bytes / tuples so an RNG state or a tuple of stamps comes back exactly.
"""
from __future__ import annotations

import base64
from typing import Any, Mapping

import torch

from flashrt_core.capsule.fingerprint import dtype_name
from flashrt_core.errors import CapsuleError

_TAGS = ("__tensor__", "__bytes__", "__tuple__")


class _Bad(Exception):
    """Raised deep inside meta; the path to the offending value is collected while it unwinds."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why, self.path = why, []


def _where(exc: _Bad, root: str) -> str:
    return root + "".join(reversed(exc.path))


def _key(k) -> str:
    if not isinstance(k, str):
        raise _Bad(f"key {k!r} is not a string; capsule meta keys must be strings")
    if k in _TAGS:
        raise _Bad(f"key {k!r} is reserved by the capsule file format")
    return k


def _refuse(obj):
    raise _Bad(f"cannot store a {type(obj).__name__} in a capsule "
               "(use numbers, strings, None, lists, tuples, dicts, bytes or tensors)")


def _copy(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj)
    if isinstance(obj, (list, tuple)):
        out = []
        for i, v in enumerate(obj):
            try:
                out.append(_copy(v))
            except _Bad as exc:
                exc.path.append(f"[{i}]")
                raise
        return tuple(out) if isinstance(obj, tuple) else out
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            try:
                out[_key(k)] = _copy(v)
            except _Bad as exc:
                exc.path.append(f".{k}")
                raise
        return out
    return _refuse(obj)


def copy_meta(obj: Any, where: str = "meta") -> Any:
    """A private deep copy that also refuses anything the disk tier could not store (so it fails early)."""
    try:
        return _copy(obj)
    except _Bad as exc:
        raise CapsuleError(f"{_where(exc, where)}: {exc.why}") from None


def _clone_list(obj: list) -> list:
    return [_CLONE[type(v)](v) if type(v) in _CLONE else clone_meta(v) for v in obj]


_CLONE = {type(None): lambda v: v, bool: lambda v: v, int: lambda v: v, float: lambda v: v, str: lambda v: v,
          bytes: lambda v: v, list: _clone_list, tuple: lambda v: tuple(_clone_list(v))}


def clone_meta(obj: Any) -> Any:
    """A copy of meta that `copy_meta` already checked and the store keeps private (a restore's return).

    Trusts the structure (no key checks) and dispatches on the exact type, so the runtime's meta (a
    ledger of dozens of small dicts) copies in a few microseconds on the restore path. Immutable leaves
    are shared; tensors are cloned; dicts and lists are new.
    """
    if type(obj) is dict:
        return {k: _CLONE[type(v)](v) if type(v) in _CLONE else clone_meta(v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return copy_meta(obj)  # anything else (a Mapping subclass, a bytearray): the checked slow path


def encode_meta(obj: Any, where: str = "meta") -> Any:
    """JSON-ready form of meta (already checked by `copy_meta` when the capsule was made)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                               "b64": base64.b64encode(raw).decode()}}
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_meta(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_meta(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        return {k: encode_meta(v, f"{where}.{k}") for k, v in obj.items()}
    raise CapsuleError(f"{where}: cannot store a {type(obj).__name__} in a capsule")


def decode_meta(obj: Any) -> Any:
    """Inverse of `encode_meta`."""
    if isinstance(obj, list):
        return [decode_meta(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and "__tensor__" in obj:
        spec = obj["__tensor__"]
        dtype = getattr(torch, spec["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise CapsuleError(f"meta tensor has unknown dtype {spec['dtype']!r}")
        raw = bytearray(base64.b64decode(spec["b64"]))
        if not raw:
            return torch.empty(spec["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(spec["shape"]).clone()
    if len(obj) == 1 and "__bytes__" in obj:
        return base64.b64decode(obj["__bytes__"])
    if len(obj) == 1 and "__tuple__" in obj:
        return tuple(decode_meta(v) for v in obj["__tuple__"])
    return {k: decode_meta(v) for k, v in obj.items()}
