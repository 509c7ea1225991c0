"""The policy node under hostile input, end to end (separate processes, the tiny model on the CPU): a valid but
huge frame on one camera, a simulated clock that never moves, capsule folders left by a killed write, capsule
paths outside capsule_dir."""
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]
pytest.importorskip("rclpy")

from policy_rig import rig_factory  # noqa: E402,F401
from policy_rig import status_values as _values  # noqa: E402

ACT_HZ = 10.0
WINDOW_S = 6.0


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
    assert rig.wait(lambda: _values(rig.last_status()).get("ros_clock") == "advancing", 10), rig.last_status()
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


def _dead_pid() -> int:
    import os

    for pid in range(4_000_000, 4_100_000):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid found")


def test_capsule_dir_leftovers_are_reported_and_counted_and_export_import_stay_inside_it(rig_factory, tmp_path):
    """A write killed before its rename leaves `.ID.tmp-PID-HEX`: removed at configure and said (log, /diagnostics),
    never listed; other files in capsule_dir count against the disk budget. Export / import paths are confined to
    capsule_dir and capsule_io_dirs: `../x` and an absolute path elsewhere are refused with nothing written."""
    from flashrt_ros.srv import ExportCapsule, ImportCapsule, ListCapsules, SnapshotCapsule

    caps, shared, outside = tmp_path / "caps", tmp_path / "shared", tmp_path / "elsewhere"
    partial = caps / f".c0003-ab12.tmp-{_dead_pid()}-deadbeef"
    partial.mkdir(parents=True)
    (partial / "tensors.safetensors").write_bytes(bytes(300_000))
    (caps / "notes.bin").write_bytes(bytes(1_500_000))  # not a capsule: it fills the same disk
    rig = rig_factory("capsdir_node", autostart=True, params=[
        f"capsule_dir:={caps}", f"capsule_io_dirs:=['{shared}']", "capsule_budget_mb.disk:=2"])
    assert rig.wait(lambda: len(rig.chunks) >= 3, 60), rig.log()
    assert not partial.exists()
    assert f"removed {partial.name}: incomplete capsule c0003-ab12 (300000 bytes)" in rig.log()
    assert rig.wait(lambda: "capsule_dir.0" in _values(rig.last_status()), 5), rig.last_status()
    said = _values(rig.last_status())["capsule_dir.0"]
    assert said.startswith(f"removed {partial.name}: incomplete capsule c0003-ab12"), said
    listing = rig.call(ListCapsules, "list_capsules", ListCapsules.Request())
    assert listing.ok and not listing.capsules and "disk 1.4 MB of 2.0 MB" in listing.message, listing.message
    first = rig.call(SnapshotCapsule, "snapshot", SnapshotCapsule.Request(name="a", tier="disk"))
    assert first.ok, first.message
    size = rig.call(ListCapsules, "list_capsules", ListCapsules.Request()).capsules[0].size_bytes
    # whatever else lies there counts, when it is put there too: half a capsule left free refuses the next one
    (caps / "more.bin").write_bytes(bytes(2 * 2**20 - 1_500_000 - size - size // 2))
    second = rig.call(SnapshotCapsule, "snapshot", SnapshotCapsule.Request(name="b", tier="disk"))
    assert not second.ok and "the disk tier is full" in second.message, second.message
    assert f"other files in {caps}: {(2 * 2**20 - size - size // 2) / 2**20:.1f} MB" in second.message

    for path in ("../x", str(outside / "x"), str(shared / ".." / "x"), "", "~/x"):
        refused = rig.call(ExportCapsule, "export_capsule", ExportCapsule.Request(id=first.capsule_id, path=path))
        assert not refused.ok, (path, refused.message)
        if path:
            assert "outside the folders capsule export and import may use" in refused.message, refused.message
            assert f"'{path}'" in refused.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["caps", "capsdir_node.log"]  # nothing written
    (outside / "cap").mkdir(parents=True)
    (outside / "cap" / "manifest.json").write_text("{}")
    for path in (str(outside / "cap"), "../elsewhere/cap"):
        refused = rig.call(ImportCapsule, "import_capsule", ImportCapsule.Request(path=path))
        assert not refused.ok and "outside the folders" in refused.message, refused.message
    # inside: relative to capsule_dir, or an absolute path in capsule_io_dirs
    here = rig.call(ExportCapsule, "export_capsule", ExportCapsule.Request(id=first.capsule_id, path="exports/a"))
    assert here.ok and here.path == str(caps / "exports" / "a"), here.message
    there = rig.call(ExportCapsule, "export_capsule",
                     ExportCapsule.Request(id=first.capsule_id, path=str(shared / "a")))
    assert there.ok, there.message
    back = rig.call(ImportCapsule, "import_capsule", ImportCapsule.Request(path=str(shared / "a")))
    assert back.ok, back.message
