"""Camera frames decoded and fitted beside the node's executor, one thread per camera, within a pixel budget.

The executor's image callback only checks a frame's stamp and hands the message over (`submit`): decoding and
letterboxing a large frame (1080p: ~15 ms, 4096x4096: ~230 ms) there would hold back the stage timers that wake
the inference thread. Each camera has a thread of its own that takes its newest frame, so one camera's large
frames never delay another's. What a camera may cost is bounded: a frame whose header promises more pixels than
the camera's budget per second has left is refused before it is decoded, naming the camera (the model sees a
224x224 letterbox of a few frames a second: a 4096x4096 PNG ten times a second is work nobody uses). The threads
run at a lower CPU priority than the inference thread, so what decoding remains yields the cores to the decisions.
A fitted frame is stored unless the node dropped its held frames meanwhile (`drop`: a clock reset, a rewind,
cleanup).
"""
from __future__ import annotations

import os
import threading
import time

from flashrt_core.errors import InputError
from flashrt_ros import conversions

FIT_NICE = 10  # the fitting threads' niceness (Linux): the inference thread and the executor come first


class PixelBudget:
    """Pixels one camera may have fitted per second: a bucket refilled at `per_s` that holds one second's worth,
    so a frame larger than `per_s` is never fitted and smaller ones are taken at most `per_s / pixels` a second."""

    def __init__(self, per_s: float, clock=time.monotonic):
        self.per_s, self.clock = per_s, clock
        self.left, self._at = per_s, clock()

    def take(self, width: int, height: int) -> str:
        """'' when the frame fits the budget (its pixels are then spent), else why it is refused."""
        now = self.clock()
        self.left = min(self.per_s, self.left + (now - self._at) * self.per_s)
        self._at = now
        pixels = width * height
        if pixels <= self.left:
            self.left -= pixels
            return ""
        said = (f"{width}x{height} frame ({pixels / 1e6:.1f} megapixels, from its header; not decoded) is over this "
                f"camera's budget of {self.per_s / 1e6:g} megapixels a second (node parameter "
                "camera_pixel_budget_mpx_s)")
        if pixels > self.per_s:
            return said + ": frames this large are never fitted; send smaller frames (the model sees them letterboxed)"
        return said + (f" at this rate: {self.left / 1e6:.1f} left now; frames this large are taken at most "
                       f"{self.per_s / pixels:.1f} times a second")


class FrameFitter:
    """fit(msg) -> uint8 frame or None (not configured); refuse(topic, kind, why) reports a frame that cannot be
    fitted; store(index, frame, stamp) keeps a fitted one. `lock` guards the node's sensor state: `submit` and
    `drop` are called with it held, `store` runs with it held. `budget(pixels_per_s)` (0: none) applies from
    the next frame of each camera."""

    def __init__(self, lock: threading.Lock, fit, refuse, store):
        self._lock, self._fit, self._refuse, self._store = lock, fit, refuse, store
        self._wake = threading.Condition(lock)
        self._due: dict[int, tuple[str, object, int]] = {}  # camera -> (topic, message, stamp), not fitted yet
        self._threads: dict[int, threading.Thread] = {}
        self._budget_per_s = 0.0
        self._budgets: dict[int, PixelBudget] = {}  # camera -> its budget (each used by its own thread only)
        self._epoch = 0  # +1 at every drop: a frame being fitted then is dropped too

    def budget(self, pixels_per_s: float) -> None:
        self._budget_per_s = float(pixels_per_s)
        self._budgets = {}

    def submit(self, index: int, topic: str, msg, stamp: int) -> None:
        self._due[index] = (topic, msg, stamp)  # (a frame of that camera not fitted yet is superseded)
        if index not in self._threads:
            self._threads[index] = threading.Thread(target=self._run, args=(index,), name=f"flashrt_frames{index}",
                                                    daemon=True)
            self._threads[index].start()
        self._wake.notify_all()

    def drop(self, keep=None) -> None:
        """Forget the frames waiting, but those whose stamp `keep(stamp)` accepts, and those being fitted."""
        self._due = {i: v for i, v in self._due.items() if keep is not None and keep(v[2])}
        self._epoch += 1

    def _over_budget(self, index: int, msg) -> str:
        """Why this camera's frame is refused before decoding ('' to fit it)."""
        if self._budget_per_s <= 0:
            return ""
        budget = self._budgets.get(index)
        if budget is None or budget.per_s != self._budget_per_s:
            budget = self._budgets[index] = PixelBudget(self._budget_per_s)
        width, height = conversions.frame_size(msg)
        if width * height > conversions.MAX_PIXELS:  # (refused by the conversion, undecoded, with its own reason)
            return ""
        return budget.take(width, height)

    def _run(self, index: int) -> None:
        try:  # (Linux: a thread's niceness is its own, and the threads it starts inherit it)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FIT_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._lock:
                while index not in self._due:
                    self._wake.wait()
                topic, msg, stamp = self._due.pop(index)
                epoch = self._epoch
            try:
                over = self._over_budget(index, msg)
                if over:
                    self._refuse(topic, "image_budget", over)
                    continue
                frame = self._fit(msg)
            except (conversions.ConversionError, InputError) as exc:
                self._refuse(topic, "image", str(exc))
                continue
            if frame is None:
                continue
            with self._lock:
                if epoch == self._epoch:
                    self._store(index, frame, stamp)
