"""rosbag2 access through `rosbags` (pure Python; mcap and sqlite3): one typestore, a checked reader that
yields decoded, role-tagged events in bag order, and the writer set-up shared by make-bag and realtime."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.salvage import SalvageReader, storage_file
from flashrt_ros.replay.topics import TopicMap

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED = "sensor_msgs/msg/CompressedImage"
JOINT_STATE = "sensor_msgs/msg/JointState"
STRING = "std_msgs/msg/String"
ACTION_CHUNK = "flashrt_ros/msg/ActionChunk"
EXPECTED = {"camera": (IMAGE, COMPRESSED), "joints": (JOINT_STATE,), "prompt": (STRING,),
            "actions": (ACTION_CHUNK,)}


def action_chunk_definition() -> str:
    """ActionChunk.msg text: installed share/flashrt_ros/msg, else the checkout's msg/."""
    for root in (Path(sys.prefix) / "share" / "flashrt_ros", Path(__file__).resolve().parents[2]):
        path = root / "msg" / "ActionChunk.msg"
        if path.is_file():
            return path.read_text()
    raise ReplayError("ActionChunk.msg not found (neither installed under share/flashrt_ros/msg nor in msg/)")


@functools.lru_cache(maxsize=1)
def typestore():
    """ROS 2 Kilted message types plus flashrt_ros/msg/ActionChunk (built on first use, then shared)."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    store.register(get_types_from_msg(action_chunk_definition(), ACTION_CHUNK))
    return store


def storage_of(path: Path) -> str:
    if path.is_dir():
        files = sorted(p.suffix for p in path.iterdir())
        return "mcap" if ".mcap" in files else "sqlite3" if ".db3" in files else "unknown"
    return {".mcap": "mcap", ".db3": "sqlite3"}.get(path.suffix, "unknown")


@dataclass
class BagEvent:
    role: str  # camera | joints | prompt | actions
    index: int  # camera slot (0 for the other roles)
    topic: str
    log_ns: int  # bag (receive) time: the replay clock
    stamp_ns: int  # header stamp (log time for messages without a header)
    seq: int  # 0-based position of the message on its topic
    msg: Any


@dataclass
class BagInfo:
    path: str
    storage: str
    start_ns: int
    end_ns: int
    message_count: int
    topics: dict  # topic -> {"type": str, "count": int}
    damage: str | None = None  # why the storage could not be opened normally (then read up to the damage)

    def to_dict(self) -> dict:
        return {"path": self.path, "storage": self.storage, "start_ns": self.start_ns, "end_ns": self.end_ns,
                "duration_s": max(0, self.end_ns - self.start_ns) / 1e9, "message_count": self.message_count,
                "topics": self.topics, "damage": self.damage}

    def listing(self) -> str:
        if not self.topics:
            return "no topics"
        return ", ".join(f"{t} ({v['type']}, {v['count']} msgs)" for t, v in sorted(self.topics.items()))


def _stamp_ns(msg) -> int | None:
    header = getattr(msg, "header", None)
    if header is None:
        return None
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


class BagSource:
    """An open bag, its topics checked against a TopicMap. Use as a context manager."""

    def __init__(self, path, topics: TopicMap, need_prompt: bool = True):
        self.path = Path(path)
        self.topics = topics
        self.need_prompt = need_prompt
        self.reader = None
        self.salvage = None  # a SalvageReader when the bag is damaged
        self.info: BagInfo | None = None
        self.roles: dict[str, tuple[str, int]] = {}  # topic -> (role, index)
        self.store = typestore()

    def __enter__(self) -> "BagSource":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for closer in ((self.reader.close if self.reader is not None and self.reader.is_open else None),
                       (self.salvage.close if self.salvage is not None else None)):
            if closer is not None:
                try:
                    closer()
                except Exception:  # a damaged storage may fail to close too; nothing left to save
                    pass
        self.reader = self.salvage = None

    def open(self) -> None:
        from rosbags.rosbag2 import Reader

        if not self.path.exists():
            raise ReplayError(f"{self.path}: no such bag (a rosbag2 folder, .mcap or .db3 file)")
        try:
            self.reader = Reader(self.path)
            self.reader.open()
        except Exception as e:  # ReaderError, storage (apsw, mcap) errors, bad metadata.yaml
            self.reader = None
            self._open_damaged(e)
        else:
            r = self.reader
            topics = {t: {"type": i.msgtype or "?", "count": int(i.msgcount)} for t, i in r.topics.items()}
            count = int(r.message_count)
            self.info = BagInfo(str(self.path), storage_of(self.path), int(r.start_time) if count else 0,
                                int(r.end_time) if count else 0, count, topics)
        self._check_topics()

    def _open_damaged(self, error: Exception) -> None:
        """Fall back to reading the storage file from the front, up to the damage."""
        file = storage_file(self.path)
        if file is None and self.path.is_dir() and not (self.path / "metadata.yaml").exists():
            raise ReplayError(f"{self.path}: not a rosbag2 bag (a folder with no metadata.yaml and no .mcap or .db3 "
                              "file)")
        fail = ReplayError(f"{self.path}: cannot open bag (corrupt or truncated): {error}")
        try:
            self.salvage = SalvageReader(file) if file is not None else None
        except Exception:
            self.salvage = None
        if self.salvage is None or not self.salvage.connections:
            raise fail
        counts: dict[int, int] = {}
        times = []
        try:  # one pass without decoding, for the topic counts and the time span of the intact part
            for conn, log_ns, _ in self.salvage.messages(self.salvage.connections):
                counts[conn.id] = counts.get(conn.id, 0) + 1
                times.append(log_ns)
        except Exception:
            pass
        topics: dict = {}
        for c in self.salvage.connections:
            row = topics.setdefault(c.topic, {"type": c.msgtype, "count": 0})
            row["count"] += counts.get(c.id, 0)
        self.info = BagInfo(str(self.path), storage_of(self.path), min(times, default=0), max(times, default=0),
                            len(times), topics, damage=str(error))

    def _check_topics(self) -> None:
        info, m = self.info, self.topics
        if info.message_count == 0 and info.damage:
            raise ReplayError(f"{self.path}: cannot open bag (corrupt or truncated): {info.damage}; no message "
                              f"before the damage is readable (topics: {info.listing()})")
        if info.message_count == 0:
            raise ReplayError(f"{self.path}: the bag is empty (0 messages; topics: {info.listing()})")
        wanted = [(t, "camera", i) for i, t in enumerate(m.cameras)] + [(m.joint_states, "joints", 0)]
        optional = [(m.prompt, "prompt", 0), (m.actions, "actions", 0)]
        missing = [t for t, _, _ in wanted if info.topics.get(t, {}).get("count", 0) == 0]
        if self.need_prompt and info.topics.get(m.prompt, {}).get("count", 0) == 0:
            missing.append(m.prompt)
        if missing:
            raise ReplayError(f"{self.path}: missing topic(s) {', '.join(missing)}; the bag has: {info.listing()} "
                              "(map topics with --cameras/--joints/--prompt-topic or --topics FILE)")
        for topic, role, index in wanted + optional:
            if topic not in info.topics:
                continue
            msgtype = info.topics[topic]["type"]
            if msgtype not in EXPECTED[role]:
                known = "" if msgtype in self.store.types else " (a message type this replay does not know)"
                raise ReplayError(f"{self.path}: topic {topic} has message type {msgtype}{known}, expected "
                                  f"{' or '.join(EXPECTED[role])} for the {role} input")
            self.roles[topic] = (role, index)

    def events(self) -> Iterator[BagEvent]:
        """Decoded messages of the mapped topics in bag order; raises ReplayError on corruption, undecodable
        messages and timestamps that go back (bag time overall, header stamps per topic)."""
        source = self.salvage or self.reader
        conns = [c for c in source.connections if c.topic in self.roles]
        seq = dict.fromkeys(self.roles, 0)
        last_stamp: dict[str, int] = {}
        last_log = None
        it = self.salvage.messages(conns) if self.salvage else self.reader.messages(connections=conns)
        while True:
            where = f" after bag time {(last_log - self.info.start_ns) / 1e9:.3f} s" if last_log else ""
            try:
                conn, log_ns, raw = next(it)
            except StopIteration:
                if self.info.damage:
                    raise ReplayError(f"{self.path}: damaged bag ({self.info.damage}); replayed the "
                                      f"{sum(seq.values())} intact messages of the mapped topics{where}") from None
                return
            except Exception as e:  # storage-level damage found mid-way
                raise ReplayError(f"{self.path}: corrupt or truncated bag{where}: {e}") from None
            topic = conn.topic
            role, index = self.roles[topic]
            k = seq[topic]
            seq[topic] += 1
            try:
                msg = self.store.deserialize_cdr(raw, conn.msgtype)
            except Exception as e:
                raise ReplayError(f"{self.path}: {topic} message #{k} ({conn.msgtype}) cannot be decoded: "
                                  f"{e!r}") from None
            if last_log is not None and log_ns < last_log:
                raise ReplayError(f"{self.path}: timestamps out of order: {topic} message #{k} was recorded "
                                  f"{(last_log - log_ns) / 1e6:.3f} ms before the previous message")
            last_log = log_ns
            stamp = _stamp_ns(msg)
            if stamp is None:
                stamp = log_ns
            elif topic in last_stamp and stamp < last_stamp[topic]:
                raise ReplayError(f"{self.path}: timestamps out of order: {topic} message #{k} header stamp "
                                  f"{stamp} ns is {(last_stamp[topic] - stamp) / 1e6:.3f} ms older than the "
                                  f"previous one on that topic")
            last_stamp[topic] = stamp
            yield BagEvent(role, index, topic, int(log_ns), stamp, k, msg)


def open_writer(path, storage: str):
    """A rosbag2 Writer (not yet opened) for `storage` mcap or sqlite3, refusing to overwrite."""
    from rosbags.rosbag2 import StoragePlugin, Writer

    plugins = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
    if storage not in plugins:
        raise ReplayError(f"storage: must be mcap or sqlite3, got {storage!r}")
    if Path(path).exists():
        raise ReplayError(f"{path}: exists already; a bag is never overwritten")
    return Writer(path, version=9, storage_plugin=plugins[storage])


def latched_qos():
    """Transient-local, reliable, depth 1: how a prompt is offered, so late joiners get it."""
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

    zero = QosTime(0, 0)
    return Qos(QosHistory.KEEP_LAST, 1, QosReliability.RELIABLE, QosDurability.TRANSIENT_LOCAL, zero, zero,
               QosLiveliness.AUTOMATIC, zero, False)
