"""Shared pytest fixtures: the reference fixtures folder, GPU skipping, isolated ROS environments."""
import os
import pathlib
import random
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def shared_dir() -> pathlib.Path:
    """The read-only `shared/` folder beside the checkout (override with FLASHRT_SHARED)."""
    return pathlib.Path(os.environ.get("FLASHRT_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    path = shared_dir() / "reference" / "fixtures"
    if not path.is_dir():
        pytest.fail(f"LeRobot golden fixtures not found at {path}; set FLASHRT_SHARED")
    return path


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing is itself reported by the tests that import it
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def loopback_ros_environment():
    """Every test run keeps DDS traffic on this machine, in its own domain, with its own log dir."""
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.Random().randint(1, 200)))
    log_dir = tempfile.mkdtemp(prefix="flashrt_roslog_")
    os.environ["ROS_LOG_DIR"] = log_dir
    yield
