"""A tiny LeRobot dataset in the v3 layout LeRobot 0.6.1 writes, written with pyarrow and PyAV (no LeRobot
needed): the same paths, parquet schemas (fixed-size float32 lists, int64 indices, float32 timestamps), episode
index columns, and AV1 (libsvtav1, yuv420p, g=2, crf=30) videos in which episodes follow one another, each at
its from_timestamp. `frame_values(ep, k)` is the recorded frame k of episode ep; the LeRobot-made fixture
(scripts/lerobot_golden/make_lerobot_dataset_fixture.py) records the same values."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FPS, H, W, STATE, ACTION = 10, 32, 32, 6, 6
LENGTHS = (7, 5, 6)
TASKS = ("pick up the red cube", "push the blue block", "pick up the red cube")
CAMERAS = ("observation.images.front", "observation.images.wrist")
NAMES = [f"joint{i}" for i in range(STATE)]


def frame_values(ep: int, k: int) -> dict:
    """Frame k of episode ep: smooth images (a codec keeps them within a few levels) that differ by frame and
    episode, and state / action vectors."""
    y, x = np.mgrid[0:H, 0:W].astype(np.float64)
    front = np.stack([np.full((H, W), 30 + 30 * k), 60 + 4 * y + 10 * ep, 128 + 60 * np.sin(2 * np.pi * x / W)], -1)
    wrist = np.stack([40 + 2 * (x + y), np.full((H, W), 30 + 40 * ep), np.full((H, W), 220 - 30 * k)], -1)
    return {CAMERAS[0]: front.round().astype(np.uint8), CAMERAS[1]: wrist.round().astype(np.uint8),
            "observation.state": np.sin(0.3 * k + np.arange(STATE) + ep).astype(np.float32),
            "action": np.cos(0.2 * k + np.arange(ACTION) - ep).astype(np.float32)}


def _encode(path: Path, frames) -> None:
    import av

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1's banner and warnings to the terminal: errors only
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libsvtav1", FPS, options={"g": "2", "crf": "30", "preset": "12"})
        stream.pix_fmt, stream.width, stream.height = "yuv420p", W, H
        for rgb in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(stream.encode())


def _png(rgb: np.ndarray) -> bytes:
    import cv2

    return cv2.imencode(".png", np.ascontiguousarray(rgb[..., ::-1]))[1].tobytes()


def write_dataset(root, video_files=(0, 0, 1), use_videos: bool = True) -> Path:
    """The 3-episode dataset at `root`. video_files: the mp4 file index of each episode (LeRobot starts a new
    file when one is full); use_videos=False stores the frames as PNG `image` features in the data parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    vec = lambda n: pa.list_(pa.float32(), n)  # noqa: E731 (datasets.Sequence(length=n) in arrow)
    camera = {"dtype": "video" if use_videos else "image", "shape": [H, W, 3],
              "names": ["height", "width", "channels"]}
    if use_videos:
        camera["info"] = {"video.height": H, "video.width": W, "video.codec": "av1", "video.pix_fmt": "yuv420p",
                          "video.fps": FPS, "video.channels": 3, "has_audio": False}
    features = {**{c: camera for c in CAMERAS},
                "observation.state": {"dtype": "float32", "shape": [STATE], "names": NAMES},
                "action": {"dtype": "float32", "shape": [ACTION], "names": NAMES},
                **{k: {"dtype": t, "shape": [1], "names": None} for k, t in
                   (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                    ("index", "int64"), ("task_index", "int64"))}}
    tasks = list(dict.fromkeys(TASKS))
    info = {"codebase_version": "v3.0", "robot_type": None, "total_episodes": len(LENGTHS),
            "total_frames": sum(LENGTHS), "total_tasks": len(tasks), "chunks_size": 1000,
            "data_files_size_in_mb": 100, "video_files_size_in_mb": 200, "fps": FPS,
            "splits": {"train": f"0:{len(LENGTHS)}"},
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4" if use_videos
            else None, "features": features}
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    pq.write_table(pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": tasks}),
                   root / "meta" / "tasks.parquet")

    rows = {k: [] for k in ("observation.state", "action", "timestamp", "frame_index", "episode_index", "index",
                            "task_index", *([] if use_videos else CAMERAS))}
    index = 0
    for ep, n in enumerate(LENGTHS):
        for k in range(n):
            v = frame_values(ep, k)
            for key in ("observation.state", "action"):
                rows[key].append(v[key].tolist())
            rows["timestamp"].append(np.float32(k / FPS))
            rows["frame_index"].append(k)
            rows["episode_index"].append(ep)
            rows["index"].append(index)
            rows["task_index"].append(tasks.index(TASKS[ep]))
            for c in ([] if use_videos else CAMERAS):
                rows[c].append({"bytes": _png(v[c]), "path": f"frame_{index:06d}.png"})
            index += 1
    types = {"observation.state": vec(STATE), "action": vec(ACTION), "timestamp": pa.float32(),
             **{k: pa.int64() for k in ("frame_index", "episode_index", "index", "task_index")},
             **{c: pa.struct([("bytes", pa.binary()), ("path", pa.string())]) for c in CAMERAS}}
    data = root / "data" / "chunk-000" / "file-000.parquet"
    data.parent.mkdir(parents=True)
    pq.write_table(pa.table({k: pa.array(v, types[k]) for k, v in rows.items()}), data)

    episodes = {"episode_index": [], "tasks": [], "length": [], "data/chunk_index": [], "data/file_index": [],
                "dataset_from_index": [], "dataset_to_index": []}
    start = 0
    for ep, n in enumerate(LENGTHS):
        for key, value in (("episode_index", ep), ("tasks", [TASKS[ep]]), ("length", n), ("data/chunk_index", 0),
                           ("data/file_index", 0), ("dataset_from_index", start), ("dataset_to_index", start + n)):
            episodes[key].append(value)
        start += n
    if use_videos:
        for c in CAMERAS:
            offset: dict = {}
            for ep, n in enumerate(LENGTHS):
                f = video_files[ep]
                t0 = offset.get(f, 0) / FPS
                offset[f] = offset.get(f, 0) + n
                for key, value in (("chunk_index", 0), ("file_index", f), ("from_timestamp", t0),
                                   ("to_timestamp", t0 + n / FPS)):
                    episodes.setdefault(f"videos/{c}/{key}", []).append(value)
            for f in sorted(set(video_files)):
                _encode(root / "videos" / c / "chunk-000" / f"file-{f:03d}.mp4",
                        [frame_values(ep, k)[c] for ep, n in enumerate(LENGTHS) if video_files[ep] == f
                         for k in range(n)])
    episodes["meta/episodes/chunk_index"] = [0] * len(LENGTHS)
    episodes["meta/episodes/file_index"] = [0] * len(LENGTHS)
    path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table(episodes), path)
    return root
