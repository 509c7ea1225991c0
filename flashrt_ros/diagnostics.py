"""Per-stage rate and latency statistics, rejected-input counters and staleness, as DiagnosticStatus."""
from __future__ import annotations

import collections
import time

import numpy as np


class StageStats:
    """Sliding window of (wall time, latency) for one stage."""

    def __init__(self, window: int = 500):
        self.times = collections.deque(maxlen=window)
        self.latencies_ms = collections.deque(maxlen=window)
        self.count = 0

    def add(self, latency_ms: float, now: float | None = None) -> None:
        self.times.append(time.monotonic() if now is None else now)
        self.latencies_ms.append(float(latency_ms))
        self.count += 1

    def rate_hz(self) -> float:
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return 0.0
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.latencies_ms), q)) if self.latencies_ms else 0.0


class NodeHealth:
    """Everything the policy node reports on /diagnostics; plain data, updated by the node."""

    def __init__(self):
        self.stages: dict[str, StageStats] = collections.defaultdict(StageStats)
        self.rejected: collections.Counter = collections.Counter()
        self.last_rejection = ""
        self.stale_reason = ""
        self.last_error = ""
        self.chunks_published = 0
        self.overruns = 0  # stage timers that fired while a tick was still computing
        self.deadline_misses = 0  # act periods without a chunk (the action_chunk publisher's deadline QoS)
        self.clock_resets = 0  # times the node's clock jumped back (simulation resets)

    def reject(self, kind: str, why: str) -> None:
        self.rejected[kind] += 1
        self.last_rejection = f"{kind}: {why}"

    def level_and_message(self):
        """(level, message): ERROR while stale or failing, WARN after rejected inputs, else OK."""
        if self.stale_reason:
            return 2, f"not publishing actions: {self.stale_reason}"
        if self.last_error:
            return 2, self.last_error
        if self.rejected:
            return 1, f"rejected inputs: {dict(self.rejected)}; last: {self.last_rejection}"
        return 0, "ok"

    def key_values(self) -> list[tuple[str, str]]:
        values = [("chunks_published", str(self.chunks_published)), ("tick_overruns", str(self.overruns)),
                  ("action_chunk_deadline_misses", str(self.deadline_misses)),
                  ("clock_resets", str(self.clock_resets))]
        for name, stats in sorted(self.stages.items()):
            values += [
                (f"{name}.rate_hz", f"{stats.rate_hz():.2f}"),
                (f"{name}.latency_p50_ms", f"{stats.percentile(50):.3f}"),
                (f"{name}.latency_p99_ms", f"{stats.percentile(99):.3f}"),
                (f"{name}.count", str(stats.count)),
            ]
        for kind, n in sorted(self.rejected.items()):
            values.append((f"rejected.{kind}", str(n)))
        values.append(("staleness", self.stale_reason or "fresh"))
        return values
