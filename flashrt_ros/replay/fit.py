"""Fit camera frames and joint vectors to the contract's fixed input buffers.

A contract's `images` buffer has one frame size and its `state` buffer one width, while robots (and bags)
have their own. Frames are letterboxed (aspect kept, centred, zero padded: pi0.5's resize-with-pad, done
once here in uint8); a state shorter than the buffer is zero padded as LeRobot pads to max_state_dim.
"""
from __future__ import annotations

import numpy as np

from flashrt_ros.replay.errors import ReplayError


def letterbox(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    import cv2

    h, w = rgb.shape[:2]
    if (h, w) == (height, width):
        return rgb
    ratio = max(w / width, h / height)
    new_h, new_w = max(1, int(h / ratio)), max(1, int(w / ratio))
    resized = cv2.resize(rgb, (new_w, new_h), interpolation=cv2.INTER_AREA if ratio > 1 else cv2.INTER_LINEAR)
    out = np.zeros((height, width, 3), np.uint8)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    out[top:top + new_h, left:left + new_w] = resized
    return out


class InputFitter:
    def __init__(self, contract):
        images, state = contract.buffers.get("images"), contract.buffers.get("state")
        self.frame_hw = tuple(images.shape[1:3]) if images is not None else None
        self.state_dim = state.shape[0] if state is not None else None
        self.notes: list[str] = []

    def frame(self, rgb: np.ndarray, topic: str) -> np.ndarray:
        if self.frame_hw is None or rgb.shape[:2] == self.frame_hw:
            return rgb
        note = f"{topic}: {rgb.shape[1]}x{rgb.shape[0]} frames letterboxed to {self.frame_hw[1]}x{self.frame_hw[0]}"
        if note not in self.notes:
            self.notes.append(note)
        return letterbox(rgb, *self.frame_hw)

    def state(self, values: np.ndarray, topic: str) -> np.ndarray:
        if self.state_dim is None or values.shape[0] == self.state_dim:
            return values
        if values.shape[0] > self.state_dim:
            raise ReplayError(f"{topic}: {values.shape[0]} joints but the contract's state holds {self.state_dim} "
                              "(select joints with --joint-names)")
        note = f"{topic}: {values.shape[0]} joints zero padded to the contract's state_dim {self.state_dim}"
        if note not in self.notes:
            self.notes.append(note)
        return np.concatenate([values, np.zeros(self.state_dim - values.shape[0], np.float32)])

    def check_same(self, other: "InputFitter", where: str) -> None:
        if (self.frame_hw, self.state_dim) != (other.frame_hw, other.state_dim):
            raise ReplayError(f"{where}: its inputs (frames {other.frame_hw}, state {other.state_dim}) differ from "
                              f"the main contract's (frames {self.frame_hw}, state {self.state_dim})")
