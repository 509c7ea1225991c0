"""Runtime fingerprint: what a capsule must match before its bytes may be copied into live buffers.

Two runtimes with equal fingerprints run the same model, with the same weights, in the same precision, over
the same persistent-buffer layout, so a capsule taken on one is valid on the other. `diff` names exactly
what differs so a refused restore or import tells the user why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping

import torch

from flashrt_core.errors import CapsuleError

LayoutEntry = tuple  # (shape tuple of ints, dtype str)


def dtype_name(dtype: Any) -> str:
    """'torch.bfloat16' / torch.bfloat16 / 'bfloat16' -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def shape_text(shape) -> str:
    shape = tuple(shape)
    return "(" + ",".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _layout_entry(name: str, value: Any) -> LayoutEntry:
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape), dtype_name(value.dtype)
    try:
        shape, dtype = value
        return tuple(int(s) for s in shape), dtype_name(dtype)
    except (TypeError, ValueError) as exc:
        raise CapsuleError(f"fingerprint layout buffer {name!r}: expected a tensor or (shape, dtype), "
                           f"got {value!r}") from exc


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    model: str
    weights_digest: str
    precision: str
    layout: Mapping[str, LayoutEntry]  # name -> (shape, dtype); sorted by name

    def __hash__(self):  # layout is a dict, so hash the canonical digest instead of the fields
        return hash(self.digest())

    def to_dict(self) -> dict:
        return {"model": self.model, "weights_digest": self.weights_digest, "precision": self.precision,
                "layout": {k: [list(s), d] for k, (s, d) in self.layout.items()}}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Fingerprint":
        try:
            return fingerprint(data["model"], data["weights_digest"], data["precision"], data["layout"])
        except (KeyError, TypeError) as exc:
            raise CapsuleError(f"fingerprint is malformed: missing or bad field {exc}") from exc

    def digest(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def diff(self, other: "Fingerprint") -> list[str]:
        """What differs, `self` value first: e.g. 'precision: bfloat16 != float32'."""
        out = [f"{f}: {getattr(self, f)} != {getattr(other, f)}"
               for f in ("model", "weights_digest", "precision") if getattr(self, f) != getattr(other, f)]
        for name in sorted(set(self.layout) | set(other.layout)):
            mine, theirs = self.layout.get(name), other.layout.get(name)
            if theirs is None:
                out.append(f"buffer {name}: present != absent")
            elif mine is None:
                out.append(f"buffer {name}: absent != present")
            else:
                if mine[0] != theirs[0]:
                    out.append(f"buffer {name}: shape {shape_text(mine[0])} != {shape_text(theirs[0])}")
                if mine[1] != theirs[1]:
                    out.append(f"buffer {name}: dtype {mine[1]} != {theirs[1]}")
        return out


def fingerprint(model: str, weights_digest: str, precision: Any,
                layout: Mapping[str, Any]) -> Fingerprint:
    """Build a canonical fingerprint; `layout` maps buffer names to tensors or (shape, dtype) pairs."""
    entries = {str(name): _layout_entry(str(name), layout[name]) for name in sorted(layout)}
    return Fingerprint(str(model), str(weights_digest), dtype_name(precision), entries)
