"""Shared pytest fixtures: LeRobot golden fixtures (test/fixtures/), GPU skipping, isolated ROS environments."""
import os
import pathlib
import random
import tempfile

import pytest

# Triton reads TRITON_INTERPRET when a kernel module is first imported, and collection imports every test module
# (some import engine modules that import the kernels) before any test runs: the CPU interpreter is chosen here,
# first. A GPU run exports TRITON_INTERPRET=0 (scripts/gpu_round.sh) and keeps its compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    """test/fixtures/: LeRobot 0.6.1's golden outputs for tiny pi0.5 / pi0 checkpoints (its README.md)."""
    path = REPO / "test" / "fixtures"
    if not (path / "lerobot_pi05_tiny").is_dir():
        pytest.fail(f"LeRobot golden fixtures not found at {path}: they are part of the repository")
    return path


@pytest.fixture(scope="session")
def model_ckpt(fixtures_dir, tmp_path_factory) -> dict:
    """{"pi05": folder, "pi0": folder}: the model-only golden fixtures (lerobot_pi0*_tiny) as checkpoints the
    policy API and the runtime load: no processor files, so config.json's normalization_mapping is set to
    IDENTITY (a folder that asks for statistics it lacks is refused, `test_pi05_normalize`)."""
    from lerobot_checkpoint import unnormalized_copy

    base = tmp_path_factory.mktemp("model_ckpt")
    return {kind: unnormalized_copy(base, fixtures_dir / f"lerobot_{kind}_tiny") for kind in ("pi05", "pi0")}


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


@pytest.fixture
def ros_context():
    """A fresh rclpy context per test (init/shutdown around it), in the session's loopback domain."""
    rclpy = pytest.importorskip("rclpy")
    context = rclpy.Context()
    rclpy.init(context=context)
    yield context
    rclpy.shutdown(context=context)


@pytest.fixture
def ros_node(ros_context):
    import rclpy

    node = rclpy.create_node(f"test_node_{random.randint(0, 1 << 30)}", context=ros_context)
    yield node
    node.destroy_node()


@pytest.fixture
def spawn():
    """Start `python -m <module> args...` processes with the test's ROS environment; all are stopped after."""
    import signal
    import subprocess
    import sys

    procs = []

    def start(*args, log=None):
        out = open(log, "w") if log else subprocess.DEVNULL
        proc = subprocess.Popen([sys.executable, "-m", *args], env=dict(os.environ), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def spin_until(node, predicate, timeout: float, executor=None) -> bool:
    """Spin `node` until predicate() is true or `timeout` seconds passed (never a bare sleep)."""
    import time

    import rclpy

    from rclpy.executors import SingleThreadedExecutor

    own = executor is None
    if own:
        executor = SingleThreadedExecutor(context=node.context)
        executor.add_node(node)
    try:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            executor.spin_once(timeout_sec=0.05)
        return predicate()
    finally:
        if own:
            executor.remove_node(node)
            executor.shutdown()


@pytest.fixture(scope="session")
def pi0_weights(fixtures_dir):
    """The tiny LeRobot pi0 checkpoint (test/fixtures/lerobot_pi0_tiny) in the engine layout, fp32."""
    from flashrt_core.models import pi0, pi05

    config, state = pi05.load_checkpoint(fixtures_dir / "lerobot_pi0_tiny")
    return pi0.convert(config, state)


@pytest.fixture(scope="session")
def pi0_cases(fixtures_dir):
    """LeRobot's three golden cases of the tiny pi0 checkpoint (lerobot_cases.load_cases)."""
    from lerobot_cases import load_cases

    return load_cases(fixtures_dir, "lerobot_pi0_tiny")
