"""LeRobot datasets (the v3 layout LeRobot 0.6.1 writes) as replay bags: one MCAP bag per episode.

A v3 dataset is `meta/info.json` (fps, features, the `data_path` / `video_path` templates),
`meta/episodes/chunk-XXX/file-XXX.parquet` (one row per episode: its length, the data file it is in, and per
camera the video file and the time span it occupies there: videos of several episodes are concatenated into
one mp4), `meta/tasks.parquet` (task text -> task_index) and `data/chunk-XXX/file-XXX.parquet` (one row per
frame: observation.state, action, timestamp, frame_index, episode_index, index, task_index, and the frames of
`image` features as PNG bytes). The frame of a `video` feature at timestamp t is the frame of its mp4 at
from_timestamp + t, within LeRobotDataset's tolerance (1e-4 s).

Each frame becomes, at bag time START_NS + timestamp: one sensor_msgs/Image (rgb8, or CompressedImage) per
camera feature on a topic named after it (`observation.images.front` -> /observation/images/front), the state
as sensor_msgs/JointState on /observation/state (joint names from the feature's `names`), the task as
std_msgs/String on /policy_node/prompt (at the first frame and when it changes), and the reference the replay
measures its action error against: a flashrt_ros/ActionChunk on /policy_node/action_chunk holding the
dataset's actions k .. k + chunk - 1 of frame k (past the episode's end the last action is repeated, as
LeRobotDataset pads action chunks), due at frame k. A contract whose act rate is the dataset's fps decides at
every frame, so every decision has its reference; at other rates a decision is matched with the frame within
half a tick. `topics.yaml` beside the bags is the mapping `flashrt replay --topics` takes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import numpy as np
import yaml

from flashrt_ros.replay import bagio
from flashrt_ros.replay.bagio import ACTION_CHUNK, COMPRESSED, IMAGE, JOINT_STATE, STRING
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.make_bag import NS, START_NS, _header, _stamp
from flashrt_ros.replay.staged import staged_folder
from flashrt_ros.replay.topics import TopicMap

STATE, ACTION = "observation.state", "action"
PER_FRAME = ("timestamp", "frame_index", "episode_index", "task_index")
TOLERANCE_S = 1e-4  # LeRobotDataset's tolerance_s: a video frame this close to the frame's timestamp is its frame
CHUNK = 50  # actions per recorded chunk: pi0.5's, pi0's and SmolVLA's chunk_size
IMAGES = ("raw", "png", "jpeg")  # Image rgb8, or CompressedImage
STATE_TOPIC, PROMPT_TOPIC, ACTIONS_TOPIC = "/observation/state", "/policy_node/prompt", "/policy_node/action_chunk"
REFERENCE = ("recorded chunks are the dataset's actions: at frame k, actions k..k+{chunk}-1 (the last one "
             "repeated past the episode's end)")


@dataclass(frozen=True)
class Dataset:
    root: Path
    fps: float
    features: dict
    cameras: tuple[str, ...]  # feature keys of dtype video or image, in info.json order
    state_names: tuple[str, ...]
    action_names: tuple[str, ...]
    data_path: str
    video_path: str | None
    tasks: dict  # task_index -> text


@dataclass(frozen=True)
class Episode:
    index: int
    length: int
    tasks: tuple[str, ...]
    data_file: Path
    videos: dict  # camera key -> (mp4 path, from_timestamp s, to_timestamp s)

    @property
    def name(self) -> str:
        return f"episode_{self.index:06d}"


def topic(key: str) -> str:
    """A ROS topic named after a feature key (dots become levels; other characters ROS refuses, `_`)."""
    parts = [re.sub(r"\W", "_", p, flags=re.ASCII) for p in key.split(".") if p]
    return "/" + "/".join(("_" + p if p[0].isdigit() else p) for p in parts)


def _names(feature: dict, width: int, prefix: str) -> tuple[str, ...]:
    """The feature's `names` (a list, or {"motors": [...]} as older datasets wrote), else prefix_0.."""
    names = feature.get("names")
    if isinstance(names, dict) and len(names) == 1:
        names = next(iter(names.values()))
    if isinstance(names, (list, tuple)) and len(names) == width and all(isinstance(n, str) and n for n in names) \
            and len(set(names)) == width:
        return tuple(names)
    return tuple(f"{prefix}_{i}" for i in range(width))


def is_dataset(path) -> bool:
    """Whether `path` is a LeRobot dataset folder in the v3 layout (meta/info.json, codebase_version v3.x)."""
    try:
        info = json.loads((Path(path) / "meta" / "info.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and str(info.get("codebase_version", "")).startswith("v3")


def _table(path: Path, what: str, columns=None, filters=None, schema_only: bool = False):
    import pyarrow.parquet as pq

    if not path.is_file():
        raise ReplayError(f"{path}: missing ({what})")
    try:
        if schema_only:
            return pq.read_schema(path)
        return pq.read_table(path, columns=columns, filters=filters)
    except Exception as e:  # ArrowInvalid, OSError: a damaged or foreign file
        raise ReplayError(f"{path}: cannot read {what}: {e}") from None


def open_dataset(root) -> Dataset:
    """meta/info.json and meta/tasks.parquet of a v3 dataset, checked for what a bag needs."""
    root = Path(root)
    info_path = root / "meta" / "info.json"
    if not info_path.is_file():
        raise ReplayError(f"{root}: not a LeRobot dataset (no meta/info.json)")
    try:
        info = json.loads(info_path.read_text())
    except ValueError as e:
        raise ReplayError(f"{info_path}: not valid JSON: {e}") from None
    version = str(info.get("codebase_version", "?"))
    if not version.startswith("v3"):
        raise ReplayError(f"{root}: a LeRobot dataset of codebase_version {version}; this reader takes the v3 "
                          "layout, as LeRobot 0.6.1 writes it (its convert_dataset_v21_to_v30 converts a v2.1 one)")
    features = info.get("features") or {}
    need = [k for k in (STATE, ACTION, *PER_FRAME) if k not in features]
    if need:
        raise ReplayError(f"{root}: the dataset lacks feature(s) {', '.join(need)} (a replay bag needs the state, "
                          f"the actions and the frame timing; it has: {', '.join(features)})")
    cameras = tuple(k for k, f in features.items() if f.get("dtype") in ("video", "image"))
    if not cameras:
        raise ReplayError(f"{root}: the dataset has no camera feature (dtype video or image; it has: "
                          f"{', '.join(features)})")
    for key in (STATE, ACTION):
        if len(features[key].get("shape") or ()) != 1:
            raise ReplayError(f"{info_path}: feature {key} has shape {features[key].get('shape')}, expected [n]")
    fps = info.get("fps")
    if not isinstance(fps, (int, float)) or fps <= 0:
        raise ReplayError(f"{info_path}: fps is {fps!r}, expected a positive number")
    if any(features[c]["dtype"] == "video" for c in cameras) and not info.get("video_path"):
        raise ReplayError(f"{info_path}: video features but no video_path template")
    table = _table(root / "meta" / "tasks.parquet", "the task texts").to_pydict()
    text = table.get("task") or table.get("__index_level_0__")  # (the index, as pandas wrote it)
    if text is None or "task_index" not in table:
        raise ReplayError(f"{root}/meta/tasks.parquet: expected columns task and task_index, got {list(table)}")
    state_w, action_w = features[STATE]["shape"][0], features[ACTION]["shape"][0]
    return Dataset(root=root, fps=float(fps), features=features, cameras=cameras,
                   state_names=_names(features[STATE], state_w, "state"),
                   action_names=_names(features[ACTION], action_w, "action"),
                   data_path=info.get("data_path") or "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
                   video_path=info.get("video_path"), tasks=dict(zip(table["task_index"], text)))


def _episodes(ds: Dataset) -> list[Episode]:
    files = sorted((ds.root / "meta" / "episodes").glob("*/*.parquet"))
    if not files:
        raise ReplayError(f"{ds.root}: no episode index (meta/episodes/chunk-XXX/file-XXX.parquet)")
    videos = [c for c in ds.cameras if ds.features[c]["dtype"] == "video"]
    need = ["episode_index", "length", "data/chunk_index", "data/file_index"]
    need += [f"videos/{c}/{k}" for c in videos for k in ("chunk_index", "file_index", "from_timestamp",
                                                           "to_timestamp")]
    out = []
    for path in files:
        names = _table(path, "the episode index", schema_only=True).names
        missing = [c for c in need if c not in names]
        if missing:
            raise ReplayError(f"{path}: episode index lacks column(s) {', '.join(missing)}")
        rows = _table(path, "the episode index", columns=need + (["tasks"] if "tasks" in names else [])).to_pylist()
        for r in rows:
            fmt = dict(chunk_index=r["data/chunk_index"], file_index=r["data/file_index"])
            vids = {c: (ds.root / ds.video_path.format(video_key=c, chunk_index=r[f"videos/{c}/chunk_index"],
                                                       file_index=r[f"videos/{c}/file_index"]),
                        float(r[f"videos/{c}/from_timestamp"]), float(r[f"videos/{c}/to_timestamp"]))
                    for c in videos}
            out.append(Episode(index=int(r["episode_index"]), length=int(r["length"]),
                               tasks=tuple(r.get("tasks") or ()), data_file=ds.root / ds.data_path.format(**fmt),
                               videos=vids))
    return sorted(out, key=lambda e: e.index)


def episodes(dataset_dir) -> list[Episode]:
    """The episodes of a v3 dataset, by index (meta/episodes)."""
    return _episodes(open_dataset(dataset_dir))


def topic_map(dataset_dir) -> TopicMap:
    """The topics the bags of this dataset carry, cameras in info.json's feature order."""
    ds = open_dataset(dataset_dir)
    return TopicMap(cameras=tuple(topic(c) for c in ds.cameras), joint_states=STATE_TOPIC,
                    joint_names=ds.state_names, prompt=PROMPT_TOPIC, actions=ACTIONS_TOPIC)


def _column(table, key: str, n: int, width: int) -> np.ndarray:
    """A per-frame vector column ([fixed_size_]list<float>) as an [n, width] float64 array."""
    col = table.column(key).combine_chunks()
    values = np.asarray(col.flatten() if hasattr(col, "flatten") else col, dtype=np.float64)
    if values.size != n * width:
        raise ReplayError(f"column {key}: {values.size} values in {n} frames, expected {width} per frame")
    return values.reshape(n, width)


def _frames(ds: Dataset, ep: Episode, key: str, times: np.ndarray) -> Iterator[np.ndarray]:
    """The RGB frames of video feature `key` at the episode's timestamps, decoded in order (one at a time)."""
    import av

    path, start, _ = ep.videos[key]
    if not path.is_file():
        raise ReplayError(f"{path}: missing (the video of camera {key}, episode {ep.index})")
    try:
        container = av.open(str(path))
    except Exception as e:  # av.error.InvalidDataError and the like
        raise ReplayError(f"{path}: cannot open video ({e})") from None
    with container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        container.seek(max(0, round(start / stream.time_base) - 1), backward=True, any_frame=False, stream=stream)
        decoded = (f for f in container.decode(stream) if f.pts is not None)
        frame, t = None, -np.inf
        for i, want in enumerate(start + times):
            try:
                while t < want - TOLERANCE_S:
                    frame = next(decoded)
                    t = float(frame.pts * stream.time_base)
            except StopIteration:
                raise ReplayError(f"{path}: ends at {t:.4f} s, before frame {i} of episode {ep.index} "
                                  f"(camera {key}, due at {want:.4f} s)") from None
            except av.error.FFmpegError as e:
                raise ReplayError(f"{path}: cannot decode (camera {key}, episode {ep.index}): {e}") from None
            if abs(t - want) >= TOLERANCE_S:
                raise ReplayError(f"{path}: no frame at {want:.4f} s for frame {i} of episode {ep.index} (camera "
                                  f"{key}; the nearest is at {t:.4f} s, LeRobot's tolerance is {TOLERANCE_S} s)")
            yield frame.to_ndarray(format="rgb24")


def _png_frames(table, key: str) -> Iterator[np.ndarray]:
    """The RGB frames of an `image` feature, stored in the data parquet as {bytes, path} PNG structs."""
    import cv2

    for i, cell in enumerate(table.column(key).to_pylist()):
        data = cell.get("bytes") if isinstance(cell, dict) else cell
        bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR) if data else None
        if bgr is None:
            raise ReplayError(f"column {key}: the image of frame {i} cannot be decoded")
        yield np.ascontiguousarray(bgr[..., ::-1])


def _image_msg(store, rgb: np.ndarray, ns: int, frame_id: str, images: str):
    if images == "raw":
        h, w = rgb.shape[:2]
        return IMAGE, store.types[IMAGE](header=_header(store, ns, frame_id), height=h, width=w, encoding="rgb8",
                                         is_bigendian=0, step=w * 3, data=np.ascontiguousarray(rgb).reshape(-1))
    import cv2

    ok, data = cv2.imencode("." + images.replace("jpeg", "jpg"), np.ascontiguousarray(rgb[..., ::-1]))
    if not ok:
        raise ReplayError(f"{frame_id}: a frame could not be encoded as {images}")
    return COMPRESSED, store.types[COMPRESSED](header=_header(store, ns, frame_id), format=images,
                                               data=data.reshape(-1))


def bag_offsets_ns(times: np.ndarray, fps: float) -> list[int]:
    """Bag time (ns after the start) of each frame. LeRobot stores timestamp = frame_index / fps as float32, a
    few hundred ns off the fps grid: timestamps on the grid up to that rounding are put on it exactly as the
    replay clock counts it (clock.grid), so a contract acting at the dataset's fps ticks when each frame arrives,
    not just before it. Timestamps off the grid (a recording with jitter) are kept as they are."""
    steps = np.round(times * fps)
    if not np.all(np.abs(times * fps - steps) < 1e-3):
        return [round(t * NS) for t in times]
    rate = Fraction(str(fps))
    return [-(-(int(n) * NS * rate.denominator) // rate.numerator) for n in steps]


def _chunks(actions: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
    """Actions k .. k + chunk - 1 for every frame k, the last action repeated past the end."""
    padded = np.concatenate([actions, np.repeat(actions[-1:], chunk - 1, axis=0)]).astype(np.float32)
    for k in range(len(actions)):
        yield padded[k:k + chunk]


def write_bag(dataset_dir, episode_index: int, out_path, chunk: int = CHUNK, images: str = "raw",
              storage: str = "mcap") -> dict:
    """Write episode `episode_index` of the dataset as a new bag folder `out_path` (whole or not at all) and
    return its summary: frames, duration, topic counts."""
    ds = open_dataset(dataset_dir)
    eps = {e.index: e for e in _episodes(ds)}
    if episode_index not in eps:
        raise ReplayError(f"{ds.root}: no episode {episode_index} (episodes: {_spans(sorted(eps))})")
    return _write(ds, eps[episode_index], Path(out_path), chunk, images, storage, replace=False)


def _spans(indices) -> str:
    spans, start = [], None
    for i, k in enumerate(indices):
        if start is None:
            start = k
        if i + 1 == len(indices) or indices[i + 1] != k + 1:
            spans.append(f"{start}" if start == k else f"{start}-{k}")
            start = None
    return ",".join(spans) or "none"


def _conversion(ds: Dataset, ep: Episode, chunk: int, images: str) -> str:
    """What a bag was converted from and how: a bag whose record matches is reused."""
    return json.dumps({"dataset": str(ds.root.resolve()), "episode": ep.index, "length": ep.length,
                       "chunk": chunk, "images": images}, sort_keys=True)


def _write(ds: Dataset, ep: Episode, out: Path, chunk: int, images: str, storage: str, replace: bool) -> dict:
    if chunk < 1:
        raise ReplayError(f"chunk: at least 1 action per recorded chunk, got {chunk}")
    if images not in IMAGES:
        raise ReplayError(f"images: one of {', '.join(IMAGES)}, got {images!r}")
    if out.exists() and not replace:
        raise ReplayError(f"{out}: exists already; a bag is never overwritten")
    where = f"{ds.root}: episode {ep.index}"
    pngs = [c for c in ds.cameras if ds.features[c]["dtype"] == "image"]
    try:
        table = _table(ep.data_file, f"the frames of episode {ep.index}",
                       columns=[STATE, ACTION, *PER_FRAME, *pngs], filters=[("episode_index", "=", ep.index)])
        table = table.sort_by("frame_index")
        n = table.num_rows
        if n == 0:
            raise ReplayError(f"{ep.data_file}: no frame of the episode")
        if n != ep.length:
            raise ReplayError(f"{ep.data_file}: {n} frames, but meta/episodes says {ep.length}")
        state = _column(table, STATE, n, len(ds.state_names))
        actions = _column(table, ACTION, n, len(ds.action_names))
        times = np.asarray(table.column("timestamp"), dtype=np.float64)
        if np.any(np.diff(times) <= 0) or not np.all(np.isfinite(times)):
            raise ReplayError(f"{ep.data_file}: timestamps do not increase through the episode")
        tasks = np.asarray(table.column("task_index"))
        unknown = sorted(set(tasks.tolist()) - set(ds.tasks))
        if unknown:
            raise ReplayError(f"{ep.data_file}: task_index {unknown} not in meta/tasks.parquet")
    except ReplayError as e:
        raise ReplayError(f"{where}: {e}") from None
    streams = {c: (_frames(ds, ep, c, times) if c in ep.videos else _png_frames(table, c)) for c in ds.cameras}
    store = bagio.typestore()
    JointState, String, Chunk = store.types[JOINT_STATE], store.types[STRING], store.types[ACTION_CHUNK]
    counts = dict.fromkeys([*map(topic, ds.cameras), STATE_TOPIC, PROMPT_TOPIC, ACTIONS_TOPIC], 0)
    with staged_folder(out, replace=replace) as path:
        writer = bagio.open_writer(path, storage)
        for key, value in (("source", "lerobot"), ("lerobot.conversion", _conversion(ds, ep, chunk, images)),
                           ("lerobot.fps", f"{ds.fps:g}"), ("reference", REFERENCE.format(chunk=chunk))):
            writer.set_custom_data(f"flashrt.{key}", value)
        with writer:
            image_type = IMAGE if images == "raw" else COMPRESSED
            conns = {topic(c): writer.add_connection(topic(c), image_type, typestore=store) for c in ds.cameras}
            conns[STATE_TOPIC] = writer.add_connection(STATE_TOPIC, JOINT_STATE, typestore=store)
            conns[PROMPT_TOPIC] = writer.add_connection(PROMPT_TOPIC, STRING, typestore=store,
                                                        offered_qos_profiles=[bagio.latched_qos()])
            conns[ACTIONS_TOPIC] = writer.add_connection(ACTIONS_TOPIC, ACTION_CHUNK, typestore=store)

            def put(name, msgtype, msg, ns):
                writer.write(conns[name], ns, store.serialize_cdr(msg, msgtype))
                counts[name] += 1

            empty = np.zeros(0, np.float64)
            last_task = None
            offsets = bag_offsets_ns(times, ds.fps)
            try:
                for k, rows in enumerate(_chunks(actions, chunk)):
                    ns = START_NS + offsets[k]
                    if tasks[k] != last_task:
                        put(PROMPT_TOPIC, STRING, String(data=ds.tasks[tasks[k]]), ns)
                        last_task = tasks[k]
                    for c in ds.cameras:
                        put(topic(c), *_image_msg(store, next(streams[c]), ns, c, images), ns)
                    put(STATE_TOPIC, JOINT_STATE, JointState(header=_header(store, ns), name=list(ds.state_names),
                                                             position=state[k], velocity=empty, effort=empty), ns)
                    put(ACTIONS_TOPIC, ACTION_CHUNK, Chunk(
                        header=_header(store, ns), joint_names=list(ds.action_names), horizon=chunk,
                        action_dim=rows.shape[1], actions=rows.reshape(-1), dt=1.0 / ds.fps, decision_id=k,
                        prefix_id=k, observation_stamp=_stamp(store, ns), observation_age_ms=0.0, latency_ms=0.0,
                        stages_ran=[], now_index=0, publish_stamp=_stamp(store, ns)), ns)
            except ReplayError as e:
                raise ReplayError(f"{where}: {e}") from None
    return {"path": str(out), "episode": ep.index, "frames": n, "duration_s": float(times[-1] - times[0]),
            "fps": ds.fps, "cameras": len(ds.cameras), "chunk": chunk, "topics": counts}


def _recorded_conversion(bag: Path) -> str | None:
    try:
        meta = yaml.safe_load((bag / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
        return (meta.get("custom_data") or {}).get("flashrt.lerobot.conversion")
    except Exception:  # no bag there, or not one of ours
        return None


@dataclass
class Converted:
    episode: int
    path: Path
    summary: dict | None = None  # None: an earlier conversion was reused
    error: str | None = None


def convert(dataset_dir, out_dir, episodes=None, chunk: int = CHUNK, images: str = "raw",
            storage: str = "mcap") -> Iterator[Converted]:
    """Convert the episodes (all, or the indices given) into OUT_DIR/episode_XXXXXX bags and write
    OUT_DIR/topics.yaml; yields one Converted per episode as it is done. A bag already converted from the same
    episode with the same settings is reused; an episode that cannot be read is yielded with its error, and
    the others are still converted. Dataset-wide problems (not v3, a feature missing) raise ReplayError."""
    ds = open_dataset(dataset_dir)
    eps = {e.index: e for e in _episodes(ds)}
    wanted = sorted(eps) if episodes is None else list(episodes)
    absent = [i for i in wanted if i not in eps]
    if absent:
        raise ReplayError(f"{ds.root}: no episode(s) {_spans(absent)} (it has {_spans(sorted(eps))})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    m = topic_map(ds.root)
    (out_dir / "topics.yaml").write_text(yaml.safe_dump(m.describe(), sort_keys=False))
    for i in wanted:
        ep = eps[i]
        bag = out_dir / ep.name
        if _recorded_conversion(bag) == _conversion(ds, ep, chunk, images):
            yield Converted(i, bag)
            continue
        try:
            yield Converted(i, bag, summary=_write(ds, ep, bag, chunk, images, storage, replace=True))
        except ReplayError as e:
            yield Converted(i, bag, error=str(e))
        except Exception as e:  # a decoder or file error this reader did not foresee: still this episode's alone
            yield Converted(i, bag, error=f"{ds.root}: episode {i}: {type(e).__name__}: {e}")


def to_bags(dataset_dir, out_dir, failed: dict | None = None, **options) -> list[Path]:
    """The bags of every episode (converted now, or reused: idempotent). Episodes that cannot be converted are
    left out; pass `failed` (a dict) to receive {episode index: error}. options: convert()'s."""
    bags = []
    for c in convert(dataset_dir, out_dir, **options):
        if c.error is None:
            bags.append(c.path)
        elif failed is not None:
            failed[c.episode] = c.error
    return bags


def parse_episodes(text: str) -> list[int]:
    """`0,2,5-7` -> [0, 2, 5, 6, 7]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise ReplayError(f"--episodes: expected indices and ranges like 0,2,5-7, got {text!r}") from None
    if not out:
        raise ReplayError(f"--episodes: no episode in {text!r}")
    return out
