"""Validation of what the robot hands the runtime: camera frames, the state vector, the prompt.

Inputs follow one naming convention so the runtime stays model-agnostic: `set_observation` writes the input
buffers `images` ([cameras, H, W, 3] uint8), `image_mask` ([cameras] bool) and `state` ([state_dim]
float32); `set_prompt` writes `prompt` (UTF-8 bytes, zero padded). A contract declares the ones its model
uses. Everything is checked before anything is written, so a bad observation leaves the runtime untouched.
"""
from __future__ import annotations

import numpy as np
import torch

from flashrt_core.errors import InputError


def _as_array(x, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        try:
            return x.detach().cpu().numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            raise InputError(f"{what}: torch dtype {x.dtype} has no numpy equivalent (images are uint8, the "
                             "state float32)") from None
    if isinstance(x, np.ndarray):
        return x
    raise InputError(f"{what}: expected a numpy array, got {type(x).__name__}")


def check_images(images, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """-> (frames [cameras, H, W, 3] uint8 with zeros for missing cameras, mask [cameras] bool)."""
    cams, frame_shape = shape[0], tuple(shape[1:])
    if not isinstance(images, (list, tuple)):
        raise InputError(f"images: expected a list of {cams} HWC uint8 frames, got {type(images).__name__}")
    if len(images) != cams:
        raise InputError(f"images: expected {cams} cameras, got {len(images)}")
    frames = np.zeros(shape, dtype=np.uint8)
    mask = np.zeros(cams, dtype=bool)
    for i, img in enumerate(images):
        if img is None:  # a missing camera
            continue
        a = _as_array(img, f"images[{i}]")
        if a.dtype != np.uint8:
            raise InputError(f"images[{i}]: dtype {a.dtype}, expected uint8")
        if a.shape != frame_shape:
            raise InputError(f"images[{i}]: shape {tuple(a.shape)}, expected {frame_shape} (HWC)")
        frames[i] = a
        mask[i] = True
    if not mask.any():
        raise InputError("images: every camera is missing (None)")
    return frames, mask


def check_state(state, shape: tuple[int, ...]) -> np.ndarray:
    if isinstance(state, (list, tuple)):
        state = np.asarray(state)
    a = _as_array(state, "state")
    if a.dtype.kind != "f":
        raise InputError(f"state: dtype {a.dtype}, expected float32")
    if a.shape != tuple(shape):
        raise InputError(f"state: shape {tuple(a.shape)}, expected {tuple(shape)}")
    with np.errstate(over="ignore"):
        out = a.astype(np.float32)  # checked after the cast: a float64 1e39 becomes inf here
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        i = int(bad[0])
        why = "is not finite" if not np.isfinite(a.flat[i]) else "overflows float32"
        raise InputError(f"state[{i}]: {a.flat[i]} {why}")
    return out


def check_stamp(stamp_ns, last_ns: int | None) -> int:
    if isinstance(stamp_ns, bool) or not isinstance(stamp_ns, (int, np.integer)):
        raise InputError(f"stamp_ns: expected an integer (nanoseconds), got {type(stamp_ns).__name__}")
    stamp_ns = int(stamp_ns)
    if stamp_ns < 0:
        raise InputError(f"stamp_ns: {stamp_ns} is negative")
    if last_ns is not None and stamp_ns < last_ns:
        raise InputError(f"stamp_ns: {stamp_ns} is older than the last observation ({last_ns})")
    return stamp_ns


def encode_prompt(text, capacity: int) -> np.ndarray:
    if not isinstance(text, str):
        raise InputError(f"prompt: expected a string, got {type(text).__name__}")
    if not text.strip():
        raise InputError("prompt: empty")
    data = text.encode("utf-8")
    if len(data) > capacity:
        raise InputError(f"prompt: {len(data)} bytes of UTF-8, more than the prompt buffer holds ({capacity})")
    out = np.zeros(capacity, dtype=np.uint8)
    out[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def decode_prompt(buf: torch.Tensor) -> str:
    """Inverse of encode_prompt for a host uint8 tensor (zero padded)."""
    data = bytes(buf.cpu().numpy().tobytes()).rstrip(b"\0")
    return data.decode("utf-8")
