"""LeRobot datasets (v3 layout) as replay bags: `flashrt make-bag --from-lerobot` / lerobot_dataset.py.

Datasets: one written here with pyarrow + PyAV in LeRobot's v3 layout (test/lerobot_v3_writer.py), the same
with PNG `image` features, and test/fixtures/lerobot_dataset_v3/, written by LeRobot 0.6.1 itself
(scripts/lerobot_golden/make_lerobot_dataset_fixture.py). All record frame_values(ep, k).
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from flashrt_ros import conversions
from flashrt_ros.cli import main
from flashrt_ros.replay import lerobot_dataset as L
from flashrt_ros.replay.bagio import BagSource
from flashrt_ros.replay.errors import ReplayError
from lerobot_v3_writer import ACTION, CAMERAS, FPS, LENGTHS, NAMES, TASKS, frame_values, write_dataset

# Tolerances: the bag holds exactly what PyAV decodes from the dataset's mp4 (0 levels); against the recorded
# frames, AV1 at LeRobot's settings (crf 30, yuv420p) on 32x32 frames loses at most this mean |error| per frame
# (measured 3.0 levels; consecutive frames differ by 10.5 or more, so each frame is also the nearest one).
CODEC_MEAN_ABS = 5.0
REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "test" / "fixtures" / "lerobot_dataset_v3"
CONFIG = REPO / "config" / "pi05_tiny.yaml"
NS = 1_000_000_000


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("lerobot")
    return {"pyav": write_dataset(base / "pyav"), "png": write_dataset(base / "png", use_videos=False),
            "lerobot": FIXTURE}


def contract_at(tmp_path, hz: float) -> str:
    """pi05_tiny acting (and observing) at the dataset's rate: a decision at every frame."""
    data = yaml.safe_load(CONFIG.read_text())
    for stage in ("act", "observe"):
        data["stages"][stage]["trigger"]["rate_hz"] = hz
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def decoded_mp4(path: Path) -> dict:
    """{frame number at FPS: rgb} of every frame of an mp4, decoded with PyAV from the start."""
    import av

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        return {round(float(f.pts * s.time_base) * FPS): f.to_ndarray(format="rgb24") for f in c.decode(s)}


def bag_events(bag, dataset):
    with BagSource(bag, L.topic_map(dataset)) as src:
        return list(src.events()), src.info


def padded_actions(ep: int, k: int, chunk: int) -> np.ndarray:
    rows = [min(k + i, LENGTHS[ep] - 1) for i in range(chunk)]
    return np.stack([frame_values(ep, j)["action"] for j in rows])


@pytest.mark.parametrize("kind", ["pyav", "png", "lerobot"])
def test_each_episode_becomes_a_bag_with_its_frames_state_task_and_actions(datasets, kind, tmp_path):
    root = datasets[kind]
    assert L.is_dataset(root)
    assert [(e.index, e.length, e.tasks) for e in L.episodes(root)] == \
        [(i, n, (t,)) for i, (n, t) in enumerate(zip(LENGTHS, TASKS))]
    failed = {}
    bags = L.to_bags(root, tmp_path / "bags", failed=failed, chunk=8)
    assert failed == {} and [b.name for b in bags] == ["episode_000000", "episode_000001", "episode_000002"]
    assert yaml.safe_load((tmp_path / "bags" / "topics.yaml").read_text()) == {
        "cameras": ["/observation/images/front", "/observation/images/wrist"], "joint_states": "/observation/state",
        "joint_names": NAMES, "prompt": "/policy_node/prompt", "actions": "/policy_node/action_chunk"}
    videos = {e.index: e.videos for e in L.episodes(root)}  # camera -> (mp4, from_timestamp, to_timestamp)
    decoded = {}
    for ep, bag in enumerate(bags):
        events, info = bag_events(bag, root)
        n = LENGTHS[ep]
        assert {t: v["count"] for t, v in info.topics.items()} == {
            "/observation/images/front": n, "/observation/images/wrist": n, "/observation/state": n,
            "/policy_node/prompt": 1, "/policy_node/action_chunk": n}
        seen = {"camera": 0, "joints": 0, "prompt": 0, "actions": 0}
        for ev in events:
            seen[ev.role] += 1
            k = ev.seq
            # the bag clock: frame k at k / fps from the start, exactly on the replay clock's grid
            assert ev.log_ns - info.start_ns == -(-k * NS // FPS) and ev.stamp_ns == ev.log_ns
            want = frame_values(ep, k)
            if ev.role == "camera":
                c = CAMERAS[ev.index]
                rgb = conversions.image_to_rgb(ev.msg)
                if kind == "png":
                    np.testing.assert_array_equal(rgb, want[c])  # PNG is lossless
                    continue
                path, start, _ = videos[ep][c]
                if path not in decoded:
                    decoded[path] = decoded_mp4(path)
                np.testing.assert_array_equal(rgb, decoded[path][round(start * FPS) + k])
                errors = [np.abs(rgb.astype(int) - frame_values(ep, j)[c]).mean() for j in range(n)]
                assert errors[k] <= CODEC_MEAN_ABS and int(np.argmin(errors)) == k, errors
            elif ev.role == "joints":
                assert list(ev.msg.name) == NAMES
                np.testing.assert_array_equal(ev.msg.position, want["observation.state"].astype(np.float64))
            elif ev.role == "prompt":
                assert ev.msg.data == TASKS[ep] and k == 0
            else:
                m = ev.msg
                assert (m.horizon, m.action_dim, list(m.joint_names), m.decision_id) == (8, ACTION, NAMES, k)
                assert m.dt == pytest.approx(1 / FPS)
                np.testing.assert_array_equal(np.asarray(m.actions).reshape(8, ACTION), padded_actions(ep, k, 8))
        assert seen == {"camera": 2 * n, "joints": n, "prompt": 1, "actions": n}
        custom = yaml.safe_load((bag / "metadata.yaml").read_text())["rosbag2_bagfile_information"]["custom_data"]
        assert custom["flashrt.source"] == "lerobot" and "actions k..k+8-1" in custom["flashrt.reference"]


def test_replay_of_an_episode_measures_the_error_against_the_dataset_actions(datasets, tmp_path, capsys):
    out = tmp_path / "bags"
    assert main(["make-bag", "--from-lerobot", str(datasets["pyav"]), str(out), "--episodes", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"{out}/episode_000001: 5 frames, 0.40 s, 5 recorded chunks" in printed
    assert not (out / "episode_000000").exists()
    report = tmp_path / "report"
    assert main(["replay", str(out / "episode_000001"), "--topics", str(out / "topics.yaml"), "--config",
                 contract_at(tmp_path, FPS), "--report", str(report), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "action error vs recorded: 5/5 chunks matched" in printed
    data = json.loads((report / "report.json").read_text())
    assert data["staleness"]["p99"] == 0.0  # every decision saw the frame of its own time
    # the reported error is the replayed chunks against the dataset's actions k.. (the tiny model has 50 rows)
    replayed = np.load(report / "actions.npz")["actions"]
    assert replayed.shape == (5, 50, ACTION)
    reference = np.stack([padded_actions(1, k, 50) for k in range(5)])
    err = data["action_error"]
    assert err["mse"] == pytest.approx(float(np.mean((replayed.astype(np.float64) - reference) ** 2)), rel=1e-9)
    assert err["max_abs"] == pytest.approx(float(np.abs(replayed.astype(np.float64) - reference).max()), rel=1e-9)
    assert err["mse"] > 0.01  # (a random tiny model does not reproduce a teleoperator)


def test_an_unreadable_episode_is_reported_and_the_others_converted_once(tmp_path, capsys):
    root = write_dataset(tmp_path / "ds", video_files=(0, 0, 1))  # episode 2 in a second mp4, as a full file makes
    missing = root / "videos" / CAMERAS[1] / "chunk-000" / "file-001.mp4"
    missing.unlink()
    failed = {}
    bags = L.to_bags(root, tmp_path / "bags", failed=failed)
    assert [b.name for b in bags] == ["episode_000000", "episode_000001"]
    assert list(failed) == [2] and f"{missing}: missing (the video of camera {CAMERAS[1]}, episode 2)" in failed[2]
    assert not (tmp_path / "bags" / "episode_000002").exists()  # (nothing half-written)
    stamps = {b: (b / f"{b.name}.mcap").stat().st_mtime_ns for b in bags}
    assert main(["make-bag", "--from-lerobot", str(root), str(tmp_path / "bags")]) == 1
    captured = capsys.readouterr()
    assert captured.out.count("reused (converted before with the same settings)") == 2
    assert "episode 2: error:" in captured.err and "file-001.mp4: missing" in captured.err
    assert "2 bag(s)" in captured.out and "1 episode(s) failed" in captured.out
    assert {b: (b / f"{b.name}.mcap").stat().st_mtime_ns for b in bags} == stamps  # reused, not rewritten
    # other settings are another conversion: the bag is written again
    assert L.to_bags(root, tmp_path / "bags", episodes=[0], chunk=5) == [bags[0]]
    assert (bags[0] / f"{bags[0].name}.mcap").stat().st_mtime_ns != stamps[bags[0]]


def _edit_info(root: Path, edit) -> None:
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize("case, message", [
    ("no info.json", "not a LeRobot dataset (no meta/info.json)"),
    ("v2.1", "a LeRobot dataset of codebase_version v2.1; this reader takes the v3 layout"),
    ("no action", "the dataset lacks feature(s) action"),
    ("no timestamp", "the dataset lacks feature(s) timestamp"),
    ("no camera", "the dataset has no camera feature"),
    ("no tasks", "meta/tasks.parquet: missing (the task texts)"),
])
def test_a_dataset_that_is_not_v3_or_lacks_a_needed_part_is_refused_by_name(datasets, tmp_path, case, message,
                                                                            capsys):
    root = tmp_path / "ds"
    shutil.copytree(datasets["png"], root)
    if case == "no info.json":
        (root / "meta" / "info.json").unlink()
    elif case == "v2.1":
        _edit_info(root, lambda i: i.update(codebase_version="v2.1"))
    elif case == "no tasks":
        (root / "meta" / "tasks.parquet").unlink()
    else:
        drop = {"no action": ["action"], "no timestamp": ["timestamp"], "no camera": list(CAMERAS)}[case]
        _edit_info(root, lambda i: [i["features"].pop(k) for k in drop])
    assert L.is_dataset(root) == (case not in ("no info.json", "v2.1"))
    with pytest.raises(ReplayError, match="^" + str(root)) as e:
        L.to_bags(root, tmp_path / "bags")
    assert message in str(e.value)
    assert main(["make-bag", "--from-lerobot", str(root), str(tmp_path / "bags")]) == 1
    assert message in capsys.readouterr().err


def test_episode_lists_and_wrong_options(datasets, tmp_path, capsys):
    assert L.parse_episodes("0,2,5-7") == [0, 2, 5, 6, 7]
    with pytest.raises(ReplayError, match="--episodes: expected"):
        L.parse_episodes("1-x")
    with pytest.raises(ReplayError, match=r"no episode\(s\) 3-4 \(it has 0-2\)"):
        L.to_bags(datasets["png"], tmp_path / "bags", episodes=[0, 3, 4])
    with pytest.raises(ReplayError, match="no episode 9"):
        L.write_bag(datasets["png"], 9, tmp_path / "one")
    assert L.write_bag(datasets["png"], 0, tmp_path / "one", images="jpeg")["frames"] == LENGTHS[0]
    with pytest.raises(ReplayError, match="exists already"):
        L.write_bag(datasets["png"], 0, tmp_path / "one")
    assert main(["make-bag", "--from-lerobot", str(datasets["png"]), str(tmp_path / "b"), "--config", "x.yaml"]) == 1
    assert "--config do(es) not apply to --from-lerobot" in capsys.readouterr().err
