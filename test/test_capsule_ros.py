"""Capsules of a running policy_node (a separate process, loopback ROS): the capsule parameters (budget,
eviction, capsule_dir kept across a cleanup and configure), ~/export_capsule and ~/import_capsule, the
rewind_time field of ~/restore, and `flashrt capsule list|export|import --node` against the node."""
import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]
pytest.importorskip("rclpy")

import policy_rig  # noqa: E402
from policy_rig import ACTIVATE, CLEANUP, CONFIGURE, DEACTIVATE, Rig  # noqa: E402

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


@pytest.fixture
def capsule_rig(ros_context, tmp_path, monkeypatch):
    """A node with a 1 MB device budget (6 tiny-model capsules), eviction of the oldest, a capsule_dir and the test's
    folder as a capsule_io_dirs folder."""
    folder = tmp_path / "caps"
    extra = ["-p", "capsule_budget_mb.device:=1", "-p", "capsule_eviction:=oldest", "-p", f"capsule_dir:={folder}",
             "-p", f"capsule_io_dirs:=['{tmp_path}']"]  # (exports and imports beside capsule_dir, in the test's folder)
    base = policy_rig.node_command
    monkeypatch.setattr(policy_rig, "node_command", lambda name, **kw: base(name, **kw) + extra)
    rig = Rig(ros_context, "caps_node", str(tmp_path / "caps_node.log"), autostart=True)
    from flashrt_ros.srv import ExportCapsule, ImportCapsule

    rig.client(ExportCapsule, "export_capsule")  # created early: discovery is complete when they are used
    rig.client(ImportCapsule, "import_capsule")
    yield rig, folder
    rig.close()


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "flashrt_ros.cli", "capsule", *args, "--node", "/caps_node"],
                          env=dict(os.environ), capture_output=True, text=True, timeout=timeout)


def test_capsule_parameters_services_and_cli_on_a_running_node(capsule_rig, tmp_path):
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    from flashrt_core.capsule import capsule_inspect
    from flashrt_ros.srv import ExportCapsule, ImportCapsule, ListCapsules, RestoreCapsule, SnapshotCapsule

    rig, folder = capsule_rig
    assert rig.wait(lambda: len(rig.chunks) >= 3, 60), rig.log()
    snap = lambda name, tier="device": rig.call(SnapshotCapsule, "snapshot", SnapshotCapsule.Request(name=name, tier=tier))
    listing = lambda: rig.call(ListCapsules, "list_capsules", ListCapsules.Request())

    # The device budget (1 MB) holds 6 capsules; the 7th drops the oldest and says so.
    made = [snap(f"s{i}") for i in range(7)]
    assert all(r.ok for r in made), [r.message for r in made]
    ids = [r.capsule_id for r in made]
    assert "dropped" not in made[5].message and f"dropped {ids[0]} to make room" in made[6].message
    kept = snap("kept on disk", tier="disk")
    assert kept.ok and (folder / kept.capsule_id).is_dir()
    rows = listing()
    assert [c.capsule_id for c in rows.capsules] == ids[1:] + [kept.capsule_id]
    assert all(c.size_bytes > 0 and re.fullmatch(ISO, c.created_utc) for c in rows.capsules)
    assert re.search(r"device 0\.9\d+ MB of 1\.0 MB, host 0\.0000 MB of 2048\.0 MB, disk 0\.\d+ MB of 10240\.0 MB",
                     rows.message), rows.message

    # export / import through the services
    out = tmp_path / "exported"
    exported = rig.call(ExportCapsule, "export_capsule", ExportCapsule.Request(id=ids[3], path=str(out)))
    assert exported.ok and exported.path == str(out) and capsule_inspect(out) == 0, exported.message
    again = rig.call(ExportCapsule, "export_capsule", ExportCapsule.Request(id=ids[3], path=str(out)))
    assert not again.ok and "already exists" in again.message
    unknown = rig.call(ExportCapsule, "export_capsule", ExportCapsule.Request(id="c-none", path=str(tmp_path / "n")))
    assert not unknown.ok and unknown.message.endswith(
        f"(known: {kept.capsule_id}, {', '.join(reversed(ids[-4:]))} and 2 more)"), unknown.message
    imported = rig.call(ImportCapsule, "import_capsule", ImportCapsule.Request(path=str(out), tier="host"))
    assert imported.ok and imported.id not in ids, imported.message
    assert {c.capsule_id: c.tier for c in listing().capsules}[imported.id] == "host"

    # both restore modes through the service
    for rewind, word in ((True, "rewind"), (False, "live")):
        restored = rig.call(RestoreCapsule, "restore", RestoreCapsule.Request(capsule_id=ids[6], rewind_time=rewind))
        assert restored.ok and word in restored.message, restored.message
    n = len(rig.chunks)
    assert rig.wait(lambda: len(rig.chunks) >= n + 3, 20), "no chunks after the restores"

    # the command line against the node
    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    assert all(cid in listed.stdout for cid in ids[1:] + [kept.capsule_id, imported.id])
    assert re.search(rf"{kept.capsule_id}\s+kept on disk\s+disk\s+[\d.]+ MB\s+\d+\s+{ISO}", listed.stdout), listed.stdout
    by_cli = tmp_path / "by_cli"
    done = cli("export", ids[2], str(by_cli))
    assert done.returncode == 0 and by_cli.is_dir() and str(by_cli) in done.stdout, done.stderr
    back = cli("import", str(by_cli), "--tier", "host")
    assert back.returncode == 0, back.stderr
    assert back.stdout.strip() in [c.capsule_id for c in listing().capsules] and "imported" in back.stderr
    refused = cli("export", "c-none", str(tmp_path / "none"))
    assert refused.returncode == 1 and "unknown capsule id 'c-none'" in refused.stderr
    # snapshot, fork, restore and drop from the command line (the id alone on stdout where one is made)
    made_id = cli("snapshot", "by cli", "--tier", "host")
    assert made_id.returncode == 0 and "snapshot 'by cli' -> " in made_id.stderr, made_id.stderr
    cid = made_id.stdout.strip()
    forked = cli("fork", cid, "its fork")
    assert forked.returncode == 0 and f"forked {cid} -> {forked.stdout.strip()}" in forked.stderr
    restored = cli("restore", forked.stdout.strip(), "--rewind-time")
    assert restored.returncode == 0 and restored.stdout.startswith(f"restored {forked.stdout.strip()} (rewind")
    dropped = cli("drop", cid)
    assert dropped.returncode == 0 and dropped.stdout.strip() == f"dropped {cid}"
    assert cli("drop", cid).returncode == 1
    assert cid not in [c.capsule_id for c in listing().capsules]

    # read at configure: a change while configured is refused
    change = rig.call(SetParameters, "set_parameters", SetParameters.Request(parameters=[Parameter(
        name="capsule_eviction", value=ParameterValue(type=ParameterType.PARAMETER_STRING, string_value="none"))]))
    assert not change.results[0].successful and "read at configure" in change.results[0].reason

    # a restart of the runtime: the disk capsule in capsule_dir is listed again, memory tiers start empty
    assert rig.transition(DEACTIVATE) and rig.transition(CLEANUP) and rig.transition(CONFIGURE), rig.log()
    after = listing()
    assert [(c.capsule_id, c.name, c.tier) for c in after.capsules] == [(kept.capsule_id, "kept on disk", "disk")]
    assert rig.transition(ACTIVATE)
    assert rig.call(RestoreCapsule, "restore", RestoreCapsule.Request(capsule_id=kept.capsule_id)).ok


def test_a_capsule_call_stuck_at_its_files_holds_back_neither_ticks_nor_diagnostics(capsule_rig, tmp_path):
    """An import whose manifest is a FIFO nobody writes (a hung network disk): the call waits on the capsule
    thread while chunks, /diagnostics and ~/list_capsules go on; once it fails, the failure is answered, logged
    and counted on /diagnostics, and a successful snapshot is logged and shown there too."""
    from flashrt_ros.srv import ImportCapsule, ListCapsules, SnapshotCapsule

    rig, _ = capsule_rig
    listing = lambda timeout=5: rig.call(ListCapsules, "list_capsules", ListCapsules.Request(), timeout=timeout)
    rig.client(ListCapsules, "list_capsules")
    rig.client(SnapshotCapsule, "snapshot")
    assert rig.wait(lambda: len(rig.chunks) >= 3, 60), rig.log()
    assert listing(30).message.startswith("0 capsule(s)")  # (the client's first call, before the test's)
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    os.mkfifo(stuck / "manifest.json")
    future = rig.client(ImportCapsule, "import_capsule").call_async(ImportCapsule.Request(path=str(stuck)))
    time.sleep(0.5)
    n_chunks, n_diag = len(rig.chunks), len(rig.diagnostics)
    listed = listing()
    assert listed.message.startswith("0 capsule(s)"), listed.message
    assert rig.wait(lambda: len(rig.chunks) >= n_chunks + 10 and len(rig.diagnostics) >= n_diag + 2, 10), \
        f"{len(rig.chunks) - n_chunks} chunks, {len(rig.diagnostics) - n_diag} diagnostics while the import waits"
    assert not future.done()
    with open(stuck / "manifest.json", "w") as f:  # the disk answers: an empty manifest
        f.write("")
    assert rig.wait(future.done, 10)
    answer = future.result()
    assert not answer.ok and "manifest" in answer.message, answer.message
    made = rig.call(SnapshotCapsule, "snapshot", SnapshotCapsule.Request(name="after"))
    assert made.ok, made.message
    since = time.monotonic()
    assert rig.wait(lambda: any(t > since for t in rig.status_times[-1:]), 5)
    values = {kv.key: kv.value for kv in rig.last_status().values}
    assert values["capsule.import_capsule.failed"] == "1" and values["capsule.snapshot.ok"] == "1", values
    assert values["capsule.last"] == f"snapshot: {made.message}"
    failure = values["capsule.last_failure"]
    assert failure.startswith("import_capsule: ") and "manifest" in failure
    assert rig.wait(lambda: f"capsule snapshot: {made.message}" in rig.log(), 5), rig.log()
    assert "capsule import_capsule failed: " in rig.log()
    # deactivate and clean up while a call waits for its files: the call ends with its failure, the node lives
    # on (its reply still finds the service) and configures and runs again
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState

    os.remove(stuck / "manifest.json")
    os.mkfifo(stuck / "manifest.json")
    pending = rig.client(ImportCapsule, "import_capsule").call_async(ImportCapsule.Request(path=str(stuck)))
    time.sleep(0.5)
    assert rig.transition(DEACTIVATE)
    cleanup = rig.client(ChangeState, "change_state").call_async(
        ChangeState.Request(transition=Transition(id=CLEANUP)))
    time.sleep(0.5)
    with open(stuck / "manifest.json", "w") as f:
        f.write("")
    assert rig.wait(lambda: pending.done() and cleanup.done(), 20), rig.log()
    assert not pending.result().ok and cleanup.result().success
    assert rig.proc.poll() is None, rig.log()
    unconfigured = rig.call(ListCapsules, "list_capsules", ListCapsules.Request(), timeout=5)
    assert not unconfigured.ok and unconfigured.message == "policy node is not configured"
    assert rig.transition(CONFIGURE) and rig.transition(ACTIVATE), rig.log()
    n_chunks = len(rig.chunks)
    assert rig.wait(lambda: len(rig.chunks) >= n_chunks + 3, 30), rig.log()
    assert listing().ok

    # Ctrl-C while a call is stuck at its files: the node still ends (the capsule thread does not hold it)
    os.remove(stuck / "manifest.json")
    os.mkfifo(stuck / "manifest.json")
    rig.client(ImportCapsule, "import_capsule").call_async(ImportCapsule.Request(path=str(stuck)))
    time.sleep(0.5)
    rig.proc.send_signal(2)
    try:
        rig.proc.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the node did not end within 15 s of Ctrl-C with a capsule call stuck\n{rig.log()}")


def test_the_prompt_parameter_follows_the_task_a_restore_brings_back(ros_context):
    """A restore puts the capsule's task back in the runtime: the `prompt` parameter follows it (as it follows
    ~/prompt), so a cleanup and configure keep the task the robot was running, not the one before the restore."""
    import random

    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.parameter import Parameter
    from std_msgs.msg import String

    from flashrt_ros.policy_node import PolicyNode
    from flashrt_ros.srv import RestoreCapsule

    overrides = [Parameter("device", value="cpu"), Parameter("cpu_threads", value=1),
                 Parameter("prompt", value="task A")]
    node = PolicyNode(f"prompt_node_{random.randint(0, 1 << 30)}", context=ros_context, parameter_overrides=overrides)
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        cid = node.runtime.begin_snapshot("with task A")()
        node._on_prompt(String(data="task B"))
        assert node.runtime.prompt == "task B" and node.get_parameter("prompt").value == "task B"
        response = RestoreCapsule.Response()
        node.capsules._restore(node.runtime, RestoreCapsule.Request(capsule_id=cid), response)
        assert response.message.startswith(f"restored {cid}"), response.message
        assert node.runtime.prompt == "task A" and node.get_parameter("prompt").value == "task A"
        assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS and node.runtime.prompt == "task A"
        node.trigger_cleanup()
    finally:
        node.destroy_node()
