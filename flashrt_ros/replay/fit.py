"""Fit camera frames and joint vectors to the contract's fixed input buffers.

A contract's `images` buffer has one frame size, while robots (and bags) have their own: frames are
letterboxed with `flashrt_core.lerobot.preprocess.letterbox`, the function the node uses too. The state
must have the contract's width: LeRobot does not pad the state (pi0.5 prints every value into the prompt, so a
padded zero would be one more number there), so a shorter vector is refused, never padded.
"""
from __future__ import annotations

import numpy as np

from flashrt_core.lerobot.preprocess import letterbox
from flashrt_ros.replay.errors import ReplayError


class InputFitter:
    def __init__(self, contract):
        from flashrt_core.contract.bindings import image_pad

        images, state = contract.buffers.get("images"), contract.buffers.get("state")
        self.pad = image_pad(contract.model)
        self.frame_hw = tuple(images.shape[1:3]) if images is not None else None
        self.state_dim = state.shape[0] if state is not None else None
        self.notes: list[str] = []

    def frame(self, rgb: np.ndarray, topic: str) -> np.ndarray:
        if self.frame_hw is None or rgb.shape[:2] == self.frame_hw:
            return rgb
        note = f"{topic}: {rgb.shape[1]}x{rgb.shape[0]} frames letterboxed to {self.frame_hw[1]}x{self.frame_hw[0]}"
        if note not in self.notes:
            self.notes.append(note)
        return letterbox(rgb, *self.frame_hw, self.pad)

    def state(self, values: np.ndarray, topic: str) -> np.ndarray:
        if self.state_dim is None or values.shape[0] == self.state_dim:
            return values
        raise ReplayError(f"{topic}: {values.shape[0]} joints but the contract's state holds {self.state_dim} "
                          "(select joints with --joint-names, or give the contract the robot's state_dim; a state "
                          "is never padded: LeRobot does not pad it)")

    def check_same(self, other: "InputFitter", where: str) -> None:
        if (self.frame_hw, self.state_dim) != (other.frame_hw, other.state_dim):
            raise ReplayError(f"{where}: its inputs (frames {other.frame_hw}, state {other.state_dim}) differ from "
                              f"the main contract's (frames {self.frame_hw}, state {self.state_dim})")
