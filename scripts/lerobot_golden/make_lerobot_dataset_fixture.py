"""Writes test/fixtures/lerobot_dataset_v3/: a 3-episode dataset written by LeRobot 0.6.1 itself
(LeRobotDataset.create / add_frame / save_episode / finalize, with its default AV1 video encoding), so that
test_lerobot_dataset.py checks that flashrt_ros/replay/lerobot_dataset.py reads LeRobot's real output.

Run from the repository root with a Python that has `lerobot[dataset]==0.6.1` (datasets, pyarrow, av, pandas):
    python scripts/lerobot_golden/make_lerobot_dataset_fixture.py test/fixtures/lerobot_dataset_v3
The recorded values are test/lerobot_v3_writer.py's frame_values(ep, k), which the test recomputes.
"""
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))
from lerobot_v3_writer import ACTION, CAMERAS, FPS, H, LENGTHS, NAMES, STATE, TASKS, W, frame_values  # noqa: E402


def main(out: Path) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    camera = {"dtype": "video", "shape": (H, W, 3), "names": ["height", "width", "channels"]}
    features = {**{c: camera for c in CAMERAS},
                "observation.state": {"dtype": "float32", "shape": (STATE,), "names": NAMES},
                "action": {"dtype": "float32", "shape": (ACTION,), "names": NAMES}}
    if out.exists():
        shutil.rmtree(out)
    ds = LeRobotDataset.create("flashrt/tiny_v3", fps=FPS, features=features, root=out, use_videos=True)
    for ep, (n, task) in enumerate(zip(LENGTHS, TASKS)):
        for k in range(n):
            ds.add_frame({**frame_values(ep, k), "task": task})
        ds.save_episode()
    ds.finalize()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
