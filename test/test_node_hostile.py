"""The policy node under hostile input, end to end (separate processes, the tiny model on the CPU): a valid but
huge frame on one camera, a simulated clock that never moves, capsule folders left by a killed write, capsule
paths outside capsule_dir."""
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]
pytest.importorskip("rclpy")

from policy_rig import Rig  # noqa: E402

ACT_HZ = 10.0
WINDOW_S = 6.0


@pytest.fixture
def rig_factory(ros_context, tmp_path):
    rigs = []

    def make(name, **kwargs):
        rig = Rig(ros_context, name, str(tmp_path / f"{name}.log"), **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def _values(status) -> dict:
    return {kv.key: kv.value for kv in status.values} if status is not None else {}


def _chunk_window(rig, seconds: float):
    """(chunks per second, the longest gap between consecutive chunks' first-action stamps in s) over `seconds`."""
    start = time.monotonic()
    rig.wait(lambda: False, seconds)
    stamps = [c.header.stamp.sec + c.header.stamp.nanosec * 1e-9 for c in rig.chunks_since(start)]
    return len(stamps) / seconds, max(np.diff(stamps)) if len(stamps) > 1 else float("inf")


def test_a_huge_png_on_one_camera_neither_slows_the_chunks_nor_starves_the_other_camera(rig_factory):
    from png_testing import valid_png

    rig = rig_factory("huge_node", autostart=True, act_rate=ACT_HZ, observe_rate=5.0, compressed=True)
    cam0, cam1 = "/huge_node_cam0/compressed", "/huge_node_cam1/compressed"
    assert rig.wait(lambda: len(rig.chunks) >= 5, 60), rig.log()
    rate_before, gap_before = _chunk_window(rig, WINDOW_S)
    # 4096x4096 (inside the 16.7-megapixel limit) in ~50 KB, 10 times a second beside camera 1's own frames
    rig.extra_png = valid_png(4096, 4096, np.random.default_rng(3))
    assert len(rig.extra_png) < 100_000
    rate_with, gap_with = _chunk_window(rig, WINDOW_S)
    rig.extra_png = b""
    assert rate_with >= 0.9 * rate_before, (rate_before, rate_with, rig.log())
    assert gap_with <= 2 / ACT_HZ, (gap_before, gap_with)
    refusals = _values(rig.last_status())
    assert f"last_refusal.{cam1}" in refusals, refusals
    assert refusals[f"last_refusal.{cam1}"].startswith("image_budget: 4096x4096 frame"), refusals
    assert f"last_refusal.{cam0}" not in refusals, refusals


def test_diagnostics_go_on_and_say_so_when_use_sim_time_is_set_and_nothing_publishes_the_clock(rig_factory):
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    rig = rig_factory("simclock_node", autostart=True)
    assert rig.wait(lambda: len(rig.chunks) >= 3, 60), rig.log()
    assert _values(rig.last_status())["ros_clock"] == "advancing"
    sim = Parameter(name="use_sim_time", value=ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=True))
    assert rig.call(SetParameters, "set_parameters", SetParameters.Request(parameters=[sim])).results[0].successful
    said = "the node's clock has not advanced for"
    assert rig.wait(lambda: said in rig.last_status().message, 10), (rig.last_status(), rig.log())
    status = rig.last_status()
    assert status.level == b"\x02" and "use_sim_time is true and no /clock message arrived" in status.message
    assert _values(status)["ros_clock"].startswith(said)
    # /diagnostics keeps its period (0.2 s) on the wall clock while ROS time stands still
    since = time.monotonic()
    rig.wait(lambda: False, 2.0)
    assert len([t for t in rig.status_times if t >= since]) >= 5
    chunks = len(rig.chunks)
    rig.wait(lambda: False, 0.5)
    assert len(rig.chunks) == chunks  # (nor does anything run on it)
