"""Deterministic replay on the bag clock: the same loop make-bag uses to record actions, so a bag replayed
with the same contract and seed reproduces its recorded actions exactly.

Messages are applied in bag order. Ticks start at the bag time when the first complete observation (every
camera, the joints and a prompt) exists, then follow the contract's rate grid. Before the tick at time T,
every message logged at or before T has been applied, and the newest observation (stamped with its oldest
part, as policy_node does) is handed to each runtime; then each runtime steps at T. Compare runtimes get the
same inputs at the same ticks and draw the same noise from their own equally seeded generators.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from flashrt_core.errors import FlashRTError
from flashrt_ros import conversions
from flashrt_ros.replay.bagio import COMPRESSED, BagEvent
from flashrt_ros.replay.clock import stage_rates, tick_times
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.fit import InputFitter


@dataclass
class TickRecord:
    t_ns: int
    ran: list[str]
    latency_ms: float
    stage_latency_ms: dict[str, float]
    decision_id: int | None
    actions: np.ndarray | None
    observation_age_ms: float | None
    observation_stamp_ns: int | None
    reason: str | None
    prefix_id: int | None = None
    compare_actions: list = field(default_factory=list)  # one entry (array or None) per compare runtime
    compare_latency_ms: list = field(default_factory=list)


@dataclass
class RecordedChunk:
    t_ns: int  # decision time: the tick that computed it
    stamp_ns: int
    decision_id: int
    actions: np.ndarray  # [horizon, action_dim]
    latency_ms: float
    observation_age_ms: float
    stages_ran: list[str]
    joint_names: tuple = ()

    @classmethod
    def from_msg(cls, ev: BagEvent) -> "RecordedChunk":
        m = ev.msg
        actions = np.asarray(m.actions, dtype=np.float32)
        if actions.size != int(m.horizon) * int(m.action_dim):
            raise ReplayError(f"{ev.topic} message #{ev.seq}: {actions.size} action values, but horizon "
                              f"{m.horizon} x action_dim {m.action_dim} = {int(m.horizon) * int(m.action_dim)}")
        if int(m.horizon) == 0 or int(m.action_dim) == 0:
            raise ReplayError(f"{ev.topic} message #{ev.seq}: an empty chunk ({m.horizon} x {m.action_dim})")
        if not math.isfinite(float(m.observation_age_ms)):
            raise ReplayError(f"{ev.topic} message #{ev.seq}: observation_age_ms is {m.observation_age_ms}")
        obs = int(m.observation_stamp.sec) * 1_000_000_000 + int(m.observation_stamp.nanosec)
        # The tick that computed it: observation stamp + age (both from the runtime's clock), else the stamp.
        t_ns = obs + round(float(m.observation_age_ms) * 1e6) if obs else ev.stamp_ns
        return cls(t_ns=t_ns, stamp_ns=ev.stamp_ns,
                   decision_id=int(m.decision_id), actions=actions.reshape(int(m.horizon), int(m.action_dim)),
                   latency_ms=float(m.latency_ms), observation_age_ms=float(m.observation_age_ms),
                   stages_ran=list(m.stages_ran), joint_names=tuple(m.joint_names))


FED_KEPT = 256  # feeds remembered for naming the input behind a refusal


def _slots(runtime) -> int | None:
    images = runtime.contract.buffers.get("images")
    return images.shape[0] if images is not None else None


class BagClockPlayer:
    def __init__(self, runtimes: Sequence, n_cameras: int, joint_names: Sequence[str] = (), prompt: str | None = None,
                 progress=None):
        self.runtimes = list(runtimes)
        self.rates = stage_rates(self.runtimes[0].contract)
        if not self.rates:
            raise ReplayError("contract: no stage has rate_hz, so there is no clock to replay it on")
        slots = _slots(self.runtimes[0])
        if slots is not None and n_cameras > slots:
            raise ReplayError(f"cameras: {n_cameras} camera topics mapped but the contract has {slots} image slots")
        self.slots = slots or n_cameras
        self.joint_names = list(joint_names)
        self.fit = InputFitter(self.runtimes[0].contract)
        out = self.runtimes[0].contract.buffers[self.runtimes[0].contract.output].shape
        for i, rt in enumerate(self.runtimes[1:]):
            self.fit.check_same(InputFitter(rt.contract), f"compare contract #{i + 1}")
            theirs = rt.contract.buffers[rt.contract.output].shape
            if theirs != out:  # (their actions are compared value by value)
                raise ReplayError(f"compare contract #{i + 1}: its actions are {list(theirs)}, the main contract's "
                                  f"{list(out)}")
        self.images: list = [None] * n_cameras  # (rgb, stamp_ns) per mapped camera
        self.joints = None  # (positions, stamp_ns)
        self.prompt_fixed = prompt is not None
        self.prompt: str | None = None
        self.dirty = False
        self.ticks: list[TickRecord] = []
        self.recorded: list[RecordedChunk] = []
        self.messages = 0
        self.refused: dict[str, dict] = {}  # topic -> {count, first, last, reason}: input messages refused as the
        # node refuses them (its previous value stays in use, and ages)
        self._topics: dict = {}  # ("camera", i) / "joints" -> the topic it came from
        self._fed: dict[int, str] = {}  # observation stamp -> its oldest input's topic, of the latest feeds
        self.last_ns: int | None = None
        self._clock = None
        self._next: int | None = None
        self.progress = progress
        if prompt is not None:
            self._set_prompt(prompt, "--prompt")

    # ---- inputs ------------------------------------------------------------------------------------------
    def _set_prompt(self, text: str, where: str) -> None:
        try:
            for rt in self.runtimes:
                rt.set_prompt(text)
        except FlashRTError as e:
            raise ReplayError(f"{where}: the runtime refused the prompt: {e}") from None
        self.prompt = text

    def push(self, ev: BagEvent) -> None:
        while self._next is not None and self._next < ev.log_ns:
            self._tick(self._next)
            self._next = next(self._clock)
        self._apply(ev)
        self.messages += 1
        if ev.role != "actions":  # the bag's inputs end with its last input, not with recorded outputs
            self.last_ns = ev.log_ns
        if self._clock is None and self._complete():
            self._clock = tick_times(ev.log_ns, self.rates)
            self._next = next(self._clock)
        if self.progress is not None:
            self.progress.update(ev.log_ns, self.decisions)

    def _apply(self, ev: BagEvent) -> None:
        where = f"{ev.topic} message #{ev.seq}"
        try:
            if ev.role == "camera":
                self._topics[("camera", ev.index)] = ev.topic
                conv = conversions.compressed_to_rgb if ev.msg.__msgtype__ == COMPRESSED else conversions.image_to_rgb
                self.images[ev.index] = (self.fit.frame(conv(ev.msg), ev.topic), ev.stamp_ns)
                self.dirty = True
            elif ev.role == "joints":
                self._topics["joints"] = ev.topic
                state = conversions.joint_positions(ev.msg, self.joint_names)
                self.joints = (self.fit.state(state, ev.topic), ev.stamp_ns)
                self.dirty = True
            elif ev.role == "prompt":
                if not self.prompt_fixed:
                    self._set_prompt(ev.msg.data, where)
            elif ev.role == "actions":
                self.recorded.append(RecordedChunk.from_msg(ev))
        except conversions.ConversionError as e:  # refused as the node refuses it: the last good value stays
            seen = self.refused.setdefault(ev.topic, {"count": 0, "first": ev.seq, "reason": str(e)})
            seen["count"] += 1
            seen["last"] = ev.seq

    def notes(self) -> list[str]:
        """One line per topic with refused messages."""
        return [f"{topic}: {r['count']} message(s) refused, #{r['first']}..#{r['last']} (first: {r['reason']}); "
                "the last good one stayed in use" for topic, r in self.refused.items()]

    def _oldest_input(self) -> tuple[int, str]:
        """(stamp, topic) of the input whose last accepted message is the oldest."""
        inputs = [(s, self._topics.get(("camera", i), f"camera {i}")) for i, (_, s) in enumerate(self.images)]
        inputs.append((self.joints[1], self._topics.get("joints", "joints")))
        return min(inputs, key=lambda x: x[0])

    def _stale_input(self, t_ns: int, stamp: int | None) -> str:
        """Which input made the refused stage's data too old: the oldest input of the observation it was computed
        from (the feed of the stamp the runtime reports for it), else the oldest input now."""
        if stamp not in self._fed:
            stamp, topic = self._oldest_input()
        else:
            topic = self._fed[stamp]
        return f"stale input: {topic} (its message from {(t_ns - stamp) / 1e6:.0f} ms before)"

    def _complete(self) -> bool:
        return self.prompt is not None and self.joints is not None and all(i is not None for i in self.images)

    # ---- ticks -------------------------------------------------------------------------------------------
    def _feed(self, t_ns: int) -> None:
        frames = [img for img, _ in self.images] + [None] * (self.slots - len(self.images))
        stamp, topic = self._oldest_input()
        self._fed[stamp] = topic
        if len(self._fed) > FED_KEPT:
            del self._fed[next(iter(self._fed))]
        try:
            for rt in self.runtimes:
                rt.set_observation(images=frames, state=self.joints[0], stamp_ns=stamp)
        except FlashRTError as e:
            raise ReplayError(f"observation at bag time {t_ns} ns: the runtime refused it: {e}") from None
        self.dirty = False

    def _tick(self, t_ns: int) -> None:
        if self.dirty:
            self._feed(t_ns)
        results = [rt.step(t_ns) for rt in self.runtimes]
        r = results[0]
        stamp = getattr(r, "observation_stamp_ns", None)
        if stamp is None and r.observation_age_ms is not None:
            stamp = t_ns - int(round(r.observation_age_ms * 1e6))
        reason = r.reason
        if r.actions is None and reason and reason.startswith("observation age"):
            reason = f"{reason}; {self._stale_input(t_ns, stamp)}"
        self.ticks.append(TickRecord(
            t_ns=t_ns, ran=list(r.ran), latency_ms=float(r.latency_ms), stage_latency_ms=r.completed_stage_ms(),
            decision_id=r.decision_id, actions=r.actions, observation_age_ms=r.observation_age_ms,
            observation_stamp_ns=stamp, reason=reason, prefix_id=getattr(r, "prefix_id", None),
            compare_actions=[o.actions for o in results[1:]], compare_latency_ms=[o.latency_ms for o in results[1:]]))

    def finish(self, end_ns: int | None = None) -> None:
        """Run the ticks due up to the end of the inputs (the last input message, or `end_ns`)."""
        end = self.last_ns if end_ns is None else end_ns
        while self._next is not None and end is not None and self._next <= end:
            self._tick(self._next)
            self._next = next(self._clock)

    @property
    def started(self) -> bool:
        return self._clock is not None

    @property
    def decisions(self) -> int:
        return sum(1 for t in self.ticks if t.actions is not None)

    def waiting_for(self) -> list[str]:
        """What the first complete observation still lacks (for the error when it never comes)."""
        out = [f"camera {i}" for i, img in enumerate(self.images) if img is None]
        if self.joints is None:
            out.append("joint states")
        if self.prompt is None:
            out.append("a prompt")
        return out
