"""Camera frames -> SigLIP input, as LeRobot 0.6.1's `PI05Policy._preprocess_images` does it.

LeRobot: a frame whose size differs from 224x224 is resized without distortion (bilinear, half-pixel
centres, no antialias), clamped to [0, 1] and padded equally on both sides (the odd pixel at the
bottom/right) with black; then [0, 1] -> [-1, 1], so padding becomes -1. A missing camera is an image of
-1 with mask False. Present cameras come first, in order, and missing ones fill the remaining slots.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from flashrt_core.errors import InputError

FLOAT_SLACK = 1e-3  # float frames are in [0, 1]; a rounding overshoot is fine, 0..255 values are not


def resize_with_pad(img: torch.Tensor, height: int, width: int, pad: str = "centre") -> torch.Tensor:
    """img [B, C, H, W] float in [0, 1] -> [B, C, height, width], aspect kept, padded with 0: centred and clamped
    to [0, 1] (openpi's convention: pi0, pi0.5), or "top_left" (the padding on the left and top, not clamped:
    LeRobot's SmolVLA)."""
    if img.ndim != 4:
        raise InputError(f"image: expected [B, C, H, W], got shape {tuple(img.shape)}")
    h, w = img.shape[-2:]
    ratio = max(w / width, h / height)
    new_h, new_w = int(h / ratio), int(w / ratio)
    if new_h < 1 or new_w < 1:
        raise InputError(f"image: a {w}x{h} frame is too thin to fit {width}x{height} with its aspect kept "
                         f"(it would be {new_w}x{new_h} pixels)")
    out = F.interpolate(img, size=(new_h, new_w), mode="bilinear", align_corners=False)
    if pad == "top_left":
        return F.pad(out, (width - new_w, 0, height - new_h, 0), value=0.0)
    out = out.clamp(0.0, 1.0)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    return F.pad(out, (left, width - new_w - left, top, height - new_h - top), value=0.0)


def letterbox(frame: np.ndarray, height: int, width: int, pad: str = "centre") -> np.ndarray:
    """One uint8 HxWx3 RGB frame of any size -> uint8 height x width x 3 by `resize_with_pad` (LeRobot's
    bilinear resize with black padding where the model's pre-processing puts it: `pad`, the binding's
    IMAGE_PAD), rounded back to uint8. The node and the replay fit every
    camera frame to the contract's `images` buffer with this one function; where the buffer is the model's
    224x224 the device step then has nothing left to resize, and the only difference from LeRobot, which
    resizes the float frame, is that rounding (at most 0.5/255)."""
    arr = np.asarray(frame)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3 or 0 in arr.shape:
        raise InputError(f"frame: expected uint8 HxWx3, got {arr.dtype} of shape {arr.shape}")
    if arr.shape[:2] == (height, width):
        return arr
    arr = np.ascontiguousarray(arr) if arr.flags.writeable else arr.copy()  # (torch wants writable memory)
    x = torch.from_numpy(arr).permute(2, 0, 1)[None].float().div_(255.0)
    out = resize_with_pad(x, height, width, pad)[0].clamp_(0.0, 1.0).permute(1, 2, 0)
    return out.mul_(255.0).round_().clamp_(0, 255).to(torch.uint8).numpy()


def to_batched_chw_float01(frame, index: int, device) -> torch.Tensor:
    """uint8 HWC / [B,H,W,C] (0..255) or float CHW / [B,C,H,W] (0..1), numpy or torch -> float [B,3,H,W]."""
    t = torch.from_numpy(np.ascontiguousarray(frame)) if isinstance(frame, np.ndarray) else frame
    if not isinstance(t, torch.Tensor):
        raise InputError(f"frames[{index}]: expected a numpy array or torch tensor, got {type(frame).__name__}")
    if t.ndim not in (3, 4):
        raise InputError(f"frames[{index}]: expected 3 or 4 dims, got shape {tuple(t.shape)}")
    if 0 in t.shape:
        raise InputError(f"frames[{index}]: empty frame of shape {tuple(t.shape)}")
    if t.is_floating_point() and t.device.type == "cpu":  # (values on the host: no device sync to check them)
        if not torch.isfinite(t).all():
            raise InputError(f"frames[{index}]: NaN or infinite values")
        lo, hi = float(t.min()), float(t.max())
        if lo < -FLOAT_SLACK or hi > 1 + FLOAT_SLACK:
            raise InputError(f"frames[{index}]: float frames must lie in [0, 1], got {lo:.4g}..{hi:.4g} "
                             "(0..255 frames go in as uint8)")
    t = t.to(device)
    if t.ndim == 3:
        t = t[None]
    if t.dtype == torch.uint8:
        if t.shape[-1] != 3:
            raise InputError(f"frames[{index}]: uint8 frames must be HWC with 3 channels, got {tuple(t.shape)}")
        return t.permute(0, 3, 1, 2).float() / 255.0
    if not t.is_floating_point():
        raise InputError(f"frames[{index}]: dtype {t.dtype} is neither uint8 nor floating point")
    if t.shape[1] == 3:
        return t.float()
    if t.shape[-1] == 3:  # float HWC, accepted like LeRobot does
        return t.permute(0, 3, 1, 2).float()
    raise InputError(f"frames[{index}]: no 3-channel axis in shape {tuple(t.shape)}")


def preprocess_images(frames: Sequence, num_slots: int = 3, size: int = 224, device=None, pad: str = "centre"):
    """frames: one entry per camera (None = missing) -> images [B, num_slots, 3, size, size] in [-1, 1],
    masks [B, num_slots] bool. Present cameras fill the first slots in order (LeRobot's order)."""
    if len(frames) > num_slots:
        raise InputError(f"frames: {len(frames)} cameras but only {num_slots} image slots")
    present = []
    for i, f in enumerate(frames):
        if f is None:
            continue
        img = to_batched_chw_float01(f, i, device)
        if tuple(img.shape[-2:]) != (size, size):
            img = resize_with_pad(img, size, size, pad)
        present.append(img * 2.0 - 1.0)
    if not present:
        raise InputError("frames: every camera is missing; pi0.5 needs at least one image")
    batch = present[0].shape[0]
    for i, img in enumerate(present):
        if img.shape[0] != batch:
            raise InputError(f"frames: batch sizes differ ({img.shape[0]} vs {batch})")
    images = torch.full((batch, num_slots, 3, size, size), -1.0, device=present[0].device)
    masks = torch.zeros(batch, num_slots, dtype=torch.bool, device=present[0].device)
    for slot, img in enumerate(present):
        images[:, slot] = img
        masks[:, slot] = True
    return images, masks
