"""A plain stderr progress bar over bag time (no tqdm): redrawn at most ten times a second."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, start_ns: int, end_ns: int, enabled: bool = True, stream=None, width: int = 30,
                 label: str = "replay"):
        self.start, self.span = start_ns, max(1, end_ns - start_ns)
        self.enabled, self.stream, self.width, self.label = enabled, stream or sys.stderr, width, label
        self._last_draw = 0.0
        self._t0 = time.monotonic()

    def update(self, t_ns: int, decisions: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        frac = min(1.0, max(0.0, (t_ns - self.start) / self.span))
        filled = int(round(frac * self.width))
        self.stream.write(f"\r  {self.label} [{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:5.1f}%  "
                          f"bag {(t_ns - self.start) / 1e9:7.2f}/{self.span / 1e9:.2f} s  {decisions} decisions  "
                          f"{now - self._t0:6.1f} s wall")
        self.stream.flush()

    def close(self, t_ns: int, decisions: int) -> None:
        if self.enabled:
            self.update(t_ns, decisions, force=True)
            self.stream.write("\n")
            self.stream.flush()
