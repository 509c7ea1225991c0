"""The replay worker: one per GPU (or CPU worker). It builds the runtime(s) once, keeps a capsule of their fresh
state, and replays each bag handed to it from that state, with the same bag-clock replay as `flashrt replay`
(`replay.bag_clock_report`), so a bag's numbers do not depend on which worker replayed it or what it replayed
before. Plain Python: flashrt_ros.evaluate.fleet makes it a Ray actor."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from flashrt_ros.replay import metrics
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.replay import bag_clock_report
from flashrt_ros.replay.runtimes import build_runtime
from flashrt_ros.replay.topics import TopicMap


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def strip_report(data: dict) -> dict:
    """A replay report's numbers without what grows with the bag's length (the decision table, the per-splice
    series): those stay in the bag's own `flashrt replay --report` folder; the arrays the fleet plots need
    travel beside this (`arrays`)."""
    out = {k: v for k, v in data.items() if k != "decisions_table"}
    if "splice" in out:
        out["splice"] = {who: {k: v for k, v in sp.items() if k != "series"} for who, sp in out["splice"].items()}
    return out


def _first_rows(chunks) -> np.ndarray:
    return np.stack([np.asarray(a[0], np.float32) for a in chunks]) if chunks else np.zeros((0, 0), np.float32)


def arrays_of(report) -> dict:
    """Per-tick and per-decision arrays of a replay, small enough for hundreds of bags: tick latencies, the first
    action of every chunk (replayed, recorded, compared) with its bag time, and each matched chunk's MSE."""
    ticks, pairs = report.ticks, report.pairs
    if not ticks:
        return {}
    decided = [t for t in ticks if t.actions is not None]
    compared = [t for t in ticks if t.compare_actions and t.compare_actions[0] is not None]
    mse = []
    for t, c in pairs:
        rows, cols = min(t.actions.shape[0], c.actions.shape[0]), min(t.actions.shape[1], c.actions.shape[1])
        mse.append(float(np.mean((t.actions[:rows, :cols].astype(np.float64) - c.actions[:rows, :cols]) ** 2)))
    return {"tick_t_ns": np.asarray([t.t_ns for t in ticks], np.int64),
            "tick_latency_ms": np.asarray([t.latency_ms for t in ticks], np.float32),
            "decision_t_ns": np.asarray([t.t_ns for t in decided], np.int64),
            "first_actions": _first_rows([t.actions for t in decided]),
            "recorded_t_ns": np.asarray([c.t_ns for _, c in pairs], np.int64),
            "recorded_first": _first_rows([c.actions for _, c in pairs]),
            "chunk_mse": np.asarray(mse, np.float64),
            "compare_t_ns": np.asarray([t.t_ns for t in compared], np.int64),
            "compare_first": _first_rows([t.compare_actions[0] for t in compared])}


def compare_action_error(report) -> dict:
    """The compare configuration's action error against the recorded chunks (its own decisions, same matching)."""
    from dataclasses import replace

    ticks = [replace(t, actions=t.compare_actions[0] if t.compare_actions else None) for t in report.ticks]
    tol = 0
    rates = (report.data.get("contract") or {}).get("rates_hz") or {}
    if rates:
        tol = int(1e9 / max(rates.values()) / 2)
    return metrics.action_error(ticks, report.recorded, tol)


class BagReplayer:
    """spec: config, compare, checkpoint, tokenizer, seed, device, topics (TopicMap fields), prompt,
    action_dt_s, threads (CPU threads for torch; None: torch's default)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.topics = TopicMap(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["topics"].items()})
        self.error: str | None = None
        self.runtimes: list = []
        self.fresh: list[str] = []
        started = time.perf_counter()
        try:
            if spec.get("threads"):
                import torch

                torch.set_num_threads(int(spec["threads"]))
            cams, joints = len(self.topics.cameras), self.topics.joint_names
            self.runtimes = [build_runtime(spec["config"], seed=spec["seed"], cameras=cams, device=spec["device"],
                                           checkpoint=spec.get("checkpoint"), joint_names=joints,
                                           tokenizer=spec.get("tokenizer"))]
            if spec.get("compare"):
                self.runtimes.append(build_runtime(spec["compare"], seed=spec["seed"], cameras=cams,
                                                   device=spec["device"], joint_names=joints))
            # host-tier capsules of the fresh state: every bag starts from them, rewound (rewind_time=True)
            self.fresh = [rt.snapshot("fresh", tier="host") for rt in self.runtimes]
        except ReplayError as e:
            self.error = str(e)
        except Exception as e:  # a checkpoint or device problem: said once, by ready()
            self.error = f"cannot build the runtime: {_one_line(e)}"
        self.build_s = time.perf_counter() - started

    def ready(self) -> dict:
        """Who this worker is, and what it built (or why it could not)."""
        out = {"pid": os.getpid(), "host": socket.gethostname(), "device": self.spec["device"],
               "build_s": self.build_s, "error": self.error}
        if self.error is None:
            fields = [rt.fingerprint_fields() for rt in self.runtimes]
            out["weights_digest"] = [f["weights_digest"] for f in fields]
            out["description"] = self.runtimes[0].describe()
        return out

    def _rewound(self) -> list:
        for rt, capsule in zip(self.runtimes, self.fresh):
            rt.restore(capsule, rewind_time=True)
        return self.runtimes

    def replay(self, unit: dict) -> dict:
        """Replay one unit (a bag, or a LeRobot episode converted to a bag in a temporary folder) -> its result:
        the row (`flashrt replay`'s report numbers, stripped) and its arrays. Never raises for a bad bag."""
        started = time.perf_counter()
        row = {"key": unit["key"], "bag": unit["path"], "episode": unit.get("episode"),
               "worker": {"pid": os.getpid(), "host": socket.gethostname(), "device": self.spec["device"],
                          "threads": self.spec.get("threads")}}
        arrays: dict = {}
        scratch = None
        try:
            if self.error is not None:
                raise ReplayError(self.error)
            bag = unit["path"]
            if unit.get("episode") is not None:
                from flashrt_ros.replay import lerobot_dataset

                scratch = tempfile.mkdtemp(prefix="flashrt_episode_")
                bag = Path(scratch) / f"episode_{unit['episode']:06d}"
                lerobot_dataset.write_bag(unit["path"], unit["episode"], bag)
            report = bag_clock_report(bag, self._rewound, config=self.spec["config"], topic_map=self.topics,
                                      seed=self.spec["seed"], compare=self.spec.get("compare"),
                                      prompt=self.spec.get("prompt"), action_dt_s=self.spec["action_dt_s"])
            row["replay"] = strip_report(report.data)
            if self.spec.get("compare") and report.ticks:
                row["replay"]["compare"]["action_error"] = compare_action_error(report)
            row["joint_names"] = list(report.joint_names)
            row["status"], row["error"] = report.data["status"], report.data["error"]
            arrays = arrays_of(report)
        except ReplayError as e:
            row["status"], row["error"] = "error", str(e)
        except Exception as e:  # a failure this replay did not foresee is still this bag's row, not the fleet's
            row["status"], row["error"] = "error", f"{_one_line(e)} ({traceback.format_exc(limit=-3).strip()})"
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        row["replay_wall_s"] = time.perf_counter() - started
        return {"row": row, "arrays": arrays}
