"""Camera frames decoded and fitted in a thread of their own, beside the node's executor.

The executor's image callback only checks a frame's stamp and hands the message over (`submit`): decoding and
letterboxing a large frame (1080p: ~15 ms, 4000x4000: ~250 ms) there would hold back the stage timers that wake
the inference thread. The fitter takes the newest frame of each camera, cameras in turn (none starves), and stores
the result unless the node dropped its held frames meanwhile (`drop`: a clock reset, a rewind, cleanup).
"""
from __future__ import annotations

import threading

from flashrt_core.errors import InputError
from flashrt_ros import conversions


class FrameFitter:
    """fit(msg) -> uint8 frame or None (not configured); refuse(topic, kind, why) reports a frame that cannot be
    fitted; store(index, frame, stamp) keeps a fitted one. `lock` guards the node's sensor state: `submit` and
    `drop` are called with it held, `store` runs with it held."""

    def __init__(self, lock: threading.Lock, fit, refuse, store):
        self._lock, self._fit, self._refuse, self._store = lock, fit, refuse, store
        self._wake = threading.Condition(lock)
        self._due: dict[int, tuple[str, object, int]] = {}  # camera -> (topic, message, stamp), not fitted yet
        self._epoch = 0  # +1 at every drop: a frame being fitted then is dropped too
        threading.Thread(target=self._run, name="flashrt_frames", daemon=True).start()

    def submit(self, index: int, topic: str, msg, stamp: int) -> None:
        self._due[index] = (topic, msg, stamp)  # (a frame of that camera not fitted yet is superseded)
        self._wake.notify()

    def drop(self, keep=None) -> None:
        """Forget the frames waiting, but those whose stamp `keep(stamp)` accepts, and the one being fitted."""
        self._due = {i: v for i, v in self._due.items() if keep is not None and keep(v[2])}
        self._epoch += 1

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._due:
                    self._wake.wait()
                index = next(iter(self._due))  # (the camera waiting longest)
                topic, msg, stamp = self._due.pop(index)
                epoch = self._epoch
            try:
                frame = self._fit(msg)
            except (conversions.ConversionError, InputError) as exc:
                self._refuse(topic, "image", str(exc))
                continue
            if frame is None:
                continue
            with self._lock:
                if epoch == self._epoch:
                    self._store(index, frame, stamp)
