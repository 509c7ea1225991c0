"""Per-stage rate and latency statistics, rejected-input counters and staleness, as DiagnosticStatus.

(ROS's diagnostic_updater would assemble the status and the rate windows, but it has no wheel for the pinned
ROS 2 Kilted set: `pip index versions ros-diagnostic-updater` finds none, nor a ros-kilted-/ros-jazzy- one.)
"""
from __future__ import annotations

import collections
import dataclasses
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

    def rate_hz(self, now: float | None = None) -> float:
        """Runs per second over the window; 0 once the stage has not run for three of its periods (at least
        a second): a stopped stage does not keep its old rate."""
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return 0.0
        period = (self.times[-1] - self.times[0]) / (len(self.times) - 1)
        if (time.monotonic() if now is None else now) - self.times[-1] > max(1.0, 3 * period):
            return 0.0
        return 1.0 / period

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.latencies_ms), q)) if self.latencies_ms else 0.0


RECOVERY_S = 2.0  # the level is back to OK once no input was refused for this long
CLOCK_STALL_S = 1.0  # the node's ROS clock unchanged for this long (wall time) is said on /diagnostics


class ClockWatch:
    """Whether the node's ROS clock advances, read at every /diagnostics message (which runs on the steady clock:
    under use_sim_time with nothing on /clock, ROS time stands still and so would a timer on it)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._ros_ns, self._since = None, None

    def update(self, ros_ns: int, sim_time: bool) -> str:
        """'' while ROS time moves, else what is wrong (for NodeHealth.clock_stalled)."""
        now = self.clock()
        if ros_ns != self._ros_ns:
            self._ros_ns, self._since = ros_ns, now
            return ""
        if now - self._since < CLOCK_STALL_S:
            return ""
        why = ("use_sim_time is true and no /clock message arrived (is the simulation publishing /clock, or paused?)"
               if sim_time else "the system clock stands still")
        return f"the node's clock has not advanced for {now - self._since:.1f} s: {why}; the stage timers wait for it"


@dataclasses.dataclass
class Refusal:
    """The last refused message of one source (a topic, or the runtime's observation check)."""

    kind: str  # the counter it went to: image, joint_state, stamp_unset, ...
    why: str
    at: float  # time.monotonic() when it was refused
    count: int  # refusals of this source so far


class NodeHealth:
    """Everything the policy node reports on /diagnostics; plain data, updated by the node. `clock` (seconds,
    monotonic) times the refusals: tests pass their own."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.refusals: dict[str, Refusal] = {}  # by source: the last refusal of each
        self.stages: dict[str, StageStats] = collections.defaultdict(StageStats)
        self.rejected: collections.Counter = collections.Counter()
        self.last_rejection = ""
        self.stale_reason = ""
        self.last_error = ""
        self.lifecycle = "unconfigured"  # the node's lifecycle state: only an active node publishes
        self.chunks_published = 0
        self.overruns = 0  # stage timers that fired while a tick was still computing
        self.deadline_misses = 0  # act periods without a chunk (the action_chunk publisher's deadline QoS)
        self.clock_resets = 0  # times the node's clock jumped back (simulation resets)
        self.clock_stalled = ""  # ClockWatch's word while the node's ROS clock does not advance
        self.capsule_calls: collections.Counter = collections.Counter()  # "<verb>.ok" / "<verb>.failed"
        self.last_capsule = ""  # the last capsule call that changed something (a restore changes the actions)
        self.last_capsule_failure = ""
        self.setup_warnings: list[str] = []  # a set-up that runs but is likely wrong (flashrt_ros.setup_checks)
        self.capsule_dir_notes: list[str] = []  # what configure found in capsule_dir: removed / not listed folders

    def reject(self, kind: str, why: str, source: str = "") -> None:
        """Count a refused input of `source` (a topic name; default: the kind) and keep it as its last refusal."""
        source = source or kind
        why = why[len(kind) + 2:] if why.startswith(kind + ": ") else why  # (the kind is said once)
        self.rejected[kind] += 1
        before = self.refusals.get(source)
        self.refusals[source] = Refusal(kind, why, self.clock(), (before.count if before else 0) + 1)
        self.last_rejection = f"{source}: {why}" if source == kind else f"{source}: {kind}: {why}"

    def capsule_done(self, verb: str, ok: bool, message: str) -> None:
        """Count a capsule service call and keep the last one that changed something, and the last failure."""
        self.capsule_calls[f"{verb}.{'ok' if ok else 'failed'}"] += 1
        if not ok:
            self.last_capsule_failure = f"{verb}: {message}"
        elif verb != "list_capsules":
            self.last_capsule = f"{verb}: {message}"

    def recent_refusals(self) -> list[tuple[str, Refusal]]:
        """The sources refused within the last RECOVERY_S seconds, the latest first."""
        now = self.clock()
        recent = [(source, r) for source, r in list(self.refusals.items()) if now - r.at < RECOVERY_S]
        return sorted(recent, key=lambda item: -item[1].at)

    def _describe(self, refusal: Refusal) -> str:
        return f"{refusal.kind}: {refusal.why} ({self.clock() - refusal.at:.1f} s ago)"

    def level_and_message(self):
        """(level, message): ERROR while the node's clock stands still, stale or failing; WARN while not active
        (lifecycle) or while an input was refused within RECOVERY_S seconds; else OK. The message names each recently
        refused source, its reason and how long ago."""
        refusing = "; ".join(f"{source}: {self._describe(r)}" for source, r in self.recent_refusals())
        if self.lifecycle != "active" and not self.last_error:  # (on purpose, or a manager's step still to come)
            return 1, (f"{self.lifecycle}: not publishing actions (lifecycle state; activate the node to run the "
                       "policy)" + (f"; refusing {refusing}" if refusing else ""))
        if self.clock_stalled:  # (nothing runs on a clock that stands still: it is the first thing to say)
            message = f"not publishing actions: {self.clock_stalled}"
            return 2, message + (f"; refusing {refusing}" if refusing else "")
        if self.stale_reason or self.last_error:
            message = f"not publishing actions: {self.stale_reason}" if self.stale_reason else self.last_error
            return 2, message + (f"; refusing {refusing}" if refusing else "")
        if refusing:
            return 1, f"refusing {refusing}"
        if self.setup_warnings:
            return 1, "publishing; set-up: " + "; ".join(self.setup_warnings)
        return 0, "ok"

    def key_values(self) -> list[tuple[str, str]]:
        values = [("chunks_published", str(self.chunks_published)), ("tick_overruns", str(self.overruns)),
                  ("action_chunk_deadline_misses", str(self.deadline_misses)),
                  ("clock_resets", str(self.clock_resets)),
                  ("ros_clock", self.clock_stalled or "advancing")]
        for name, stats in sorted(self.stages.items()):
            values += [
                (f"{name}.rate_hz", f"{stats.rate_hz():.2f}"),
                (f"{name}.latency_p50_ms", f"{stats.percentile(50):.3f}"),
                (f"{name}.latency_p99_ms", f"{stats.percentile(99):.3f}"),
                (f"{name}.count", str(stats.count)),
            ]
        for kind, n in sorted(self.rejected.items()):
            values.append((f"rejected.{kind}", str(n)))
        for source, refusal in sorted(self.refusals.items()):
            values.append((f"last_refusal.{source}", f"{self._describe(refusal)} [{refusal.count} refused]"))
        values.append(("staleness", self.stale_reason or ("fresh" if self.lifecycle == "active" else
                                                          f"- ({self.lifecycle})")))
        for i, warning in enumerate(self.setup_warnings):
            values.append((f"setup_warning.{i}", warning))
        for call, n in sorted(self.capsule_calls.items()):
            values.append((f"capsule.{call}", str(n)))
        if self.last_capsule:
            values.append(("capsule.last", self.last_capsule))
        if self.last_capsule_failure:
            values.append(("capsule.last_failure", self.last_capsule_failure))
        for i, note in enumerate(self.capsule_dir_notes):
            values.append((f"capsule_dir.{i}", note))
        return values

    def message(self, name: str, hardware_id: str, stamp):
        """This health as a diagnostic_msgs/DiagnosticArray of one status named `name`, stamped `stamp`."""
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

        level, message = self.level_and_message()
        status = DiagnosticStatus(level=bytes([level]), name=name, message=message, hardware_id=hardware_id)
        status.values = [KeyValue(key=k, value=v) for k, v in self.key_values()]
        array = DiagnosticArray(status=[status])
        array.header.stamp = stamp
        return array


def refusal_reason(exc: Exception, p, n_state: int) -> str:
    """Why the runtime refused an observation, with the fix where the node's parameters are the cause: a state
    of the wrong width from joints taken in message order (no `joint_names`)."""
    why = str(exc)
    if why.startswith("state: shape") and not p.joint_names and not p.state_topic:
        why += (f" (the joints come in message order, {n_state} of them: set the node parameter `joint_names` to "
                "the joints the model reads, in its order)")
    return why
