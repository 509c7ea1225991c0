"""launch/policy.launch.py and launch/replay.launch.py: a params_file value stays unless the matching launch
argument is given; the replay launch maps topics like the node and ends by itself.

The argument rules are plain Python in the launch files and are checked everywhere. The tests that run the
launch files through ROS launch's own LaunchService (as `ros2 launch` does) need `launch` and `launch_ros`,
which a ROS 2 install has and the pip set-up does not (they are not on PyPI): they are skipped there.
"""
import importlib
import importlib.util
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import spin_until

REPO = pathlib.Path(__file__).resolve().parents[1]
POLICY = REPO / "launch" / "policy.launch.py"
REPLAY = REPO / "launch" / "replay.launch.py"


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"launch_file_{path.stem.replace('.', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def policy():
    return _load(POLICY)


@pytest.fixture(scope="module")
def replay_launch():
    return _load(REPLAY)


def _user_params(path: pathlib.Path, **values) -> pathlib.Path:
    """A user's parameters file: the packaged one with `values` changed."""
    data = yaml.safe_load((REPO / "config" / "policy_node.yaml").read_text())
    data["/**"]["ros__parameters"].update(values)
    path.write_text(yaml.safe_dump(data))
    return path


USER = {"camera_topics": ["/user/cam_a/image_raw", "/user/cam_b/image_raw/compressed"],
        "joint_state_topic": "/user/joints", "device": "cpu", "image_height": 120, "image_width": 160,
        "engine": "reference", "tokenizer": "/user/tokenizer.model", "checkpoint": "/user/ckpt"}


# ---- the argument rules (no ROS launch needed) -------------------------------------------------------------
def test_no_argument_given_sets_no_parameter(policy, tmp_path):
    params = _user_params(tmp_path / "user.yaml", **USER)
    empty = {name: "" for name in policy.OVERRIDES}
    assert policy.node_parameters(empty) == {}
    assert policy.node_parameters({}) == {}
    # the user's file first, then only what the launch file itself decides (autostart; exit_on_failure follows it
    # unless given)
    assert policy.parameter_sources(str(params), empty, "true") == [str(params), {"autostart": True,
                                                                                   "exit_on_failure": True}]
    assert policy.parameter_sources(str(params), empty, "false") == [str(params), {"autostart": False,
                                                                                    "exit_on_failure": False}]
    assert policy.parameter_sources("", empty, "true", "false") == [{"autostart": True, "exit_on_failure": False}]


def test_given_arguments_override_with_the_node_parameter_types(policy):
    from flashrt_ros.params import PARAMETERS
    from rcl_interfaces.msg import ParameterType

    given = {"config": "/robot/contract.yaml", "checkpoint": "/models/pi05",
             "camera_topics": "['/cam_high/image_raw', '/cam_wrist/image_raw/compressed']",
             "joint_state_topic": "/arm/joint_states", "device": "cuda:1", "image_height": "240",
             "image_width": "320", "engine": "fused", "tokenizer": "/models/paligemma/tokenizer.model",
             "state_topic": "/arm/ee_pose"}
    assert set(given) == set(policy.OVERRIDES)
    got = policy.node_parameters(given)
    assert got == {"contract": "/robot/contract.yaml", "checkpoint": "/models/pi05",
                   "camera_topics": ["/cam_high/image_raw", "/cam_wrist/image_raw/compressed"],
                   "joint_state_topic": "/arm/joint_states", "device": "cuda:1", "image_height": 240,
                   "image_width": 320, "engine": "fused", "tokenizer": "/models/paligemma/tokenizer.model",
                   "state_topic": "/arm/ee_pose"}
    python_type = {ParameterType.PARAMETER_STRING: str, ParameterType.PARAMETER_INTEGER: int,
                   ParameterType.PARAMETER_STRING_ARRAY: list, ParameterType.PARAMETER_BOOL: bool}
    for name, value in got.items():  # every override is a declared node parameter, of its declared type
        assert name in PARAMETERS, name
        assert type(value) is python_type[PARAMETERS[name][1]], name
    # one argument given: only that parameter
    assert policy.node_parameters({"device": "cpu", "image_width": ""}) == {"device": "cpu"}
    # a single topic or comma-separated topics are lists too
    assert policy.node_parameters({"camera_topics": "/cam/image_raw"}) == {"camera_topics": ["/cam/image_raw"]}
    assert policy.node_parameters({"camera_topics": "a/image_raw, b/image_raw"}) == \
        {"camera_topics": ["a/image_raw", "b/image_raw"]}


@pytest.mark.parametrize("name,text,message", [
    ("image_height", "tall", "'image_height' must be an integer"),
    ("engine", "turbo", "'engine' must be one of auto, fused, reference"),
    ("camera_topics", "[]", "'camera_topics' must be a list of names"),
    ("camera_topics", "[1, 2]", "'camera_topics' must be a list of names"),
])
def test_bad_argument_values_are_refused_by_name(policy, name, text, message):
    with pytest.raises(ValueError, match=message):
        policy.node_parameters({name: text})


def test_a_missing_params_file_is_an_error(policy, tmp_path):
    with pytest.raises(FileNotFoundError, match="'params_file': no such file"):
        policy.parameter_sources(str(tmp_path / "nope.yaml"), {}, "true")
    with pytest.raises(ValueError, match="'autostart' must be true or false"):
        policy.parameter_sources("", {}, "maybe")


def _replay_values(**given):
    values = {name: "" for name in _load(POLICY).OVERRIDES}
    values.update(bag="/data/ep1", config="/c/tiny.yaml", report="/tmp/r", node_timeout="300", params_file="")
    values.update(given)
    return values


def _topic_map_of(command):
    """What `flashrt replay` makes of the command's options (its own parser and topic-map loader)."""
    import argparse

    from flashrt_ros.replay.cli import add_subparsers
    from flashrt_ros.replay.topics import load_topic_map

    parser = argparse.ArgumentParser()
    add_subparsers(parser.add_subparsers(dest="command"))
    assert command[0] == "flashrt"
    args = parser.parse_args(command[1:])
    assert args.realtime and args.command == "replay"
    return args, load_topic_map(args.topics, cameras=args.cameras, joint_states=args.joints)


def test_replay_maps_bag_topics_from_the_node_parameters(replay_launch, tmp_path):
    params = _user_params(tmp_path / "user.yaml", **USER)
    # from the params file alone: the node's camera and joint topics
    args, topics = _topic_map_of(replay_launch.replay_command(_replay_values(params_file=str(params))))
    assert (args.bag, args.config, args.report, args.timeout) == ("/data/ep1", "/c/tiny.yaml", "/tmp/r", 300.0)
    assert topics.cameras == tuple(USER["camera_topics"]) and topics.joint_states == "/user/joints"
    # the arguments over the file, exactly as the node gets them
    given = {"camera_topics": "['/cli/cam0/image_raw', 'cli/cam1/image_raw']", "joint_state_topic": "/cli/js"}
    _, topics = _topic_map_of(replay_launch.replay_command(_replay_values(params_file=str(params), **given)))
    assert topics.cameras == ("/cli/cam0/image_raw", "/cli/cam1/image_raw") and topics.joint_states == "/cli/js"
    # no params file and no argument: the replay's defaults, which are the packaged node parameters' topics
    _, topics = _topic_map_of(replay_launch.replay_command(_replay_values()))
    packaged = yaml.safe_load((REPO / "config" / "policy_node.yaml").read_text())["/**"]["ros__parameters"]
    assert topics.cameras == tuple("/" + t for t in packaged["camera_topics"])
    assert topics.joint_states == "/" + packaged["joint_state_topic"]


def test_replay_takes_the_nodes_contract_and_checkpoint(replay_launch, tmp_path):
    """config '' (the default) leaves the node's own choice: the replay's report then uses the contract the node
    takes for the checkpoint (argument or params_file), not the tiny model's."""
    args, _ = _topic_map_of(replay_launch.replay_command(_replay_values(config="", checkpoint="/m/pi0")))
    assert args.config is None and args.checkpoint == "/m/pi0"
    params = _user_params(tmp_path / "user.yaml", **{**USER, "checkpoint": "/m/from_file", "contract": "/c/file.yaml"})
    args, _ = _topic_map_of(replay_launch.replay_command(_replay_values(config="", params_file=str(params))))
    assert (args.config, args.checkpoint) == ("/c/file.yaml", "/m/from_file")
    args, _ = _topic_map_of(replay_launch.replay_command(_replay_values(params_file=str(params), checkpoint="/m/a")))
    assert (args.config, args.checkpoint) == ("/c/tiny.yaml", "/m/a")
    args, _ = _topic_map_of(replay_launch.replay_command(_replay_values(config="")))
    assert args.config is None and args.checkpoint is None


# ---- through ROS launch itself (a ROS 2 install) -----------------------------------------------------------
RUNNER = """
import sys
from launch import LaunchDescription, LaunchService
from launch.actions import IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
path, arguments = sys.argv[1], [tuple(a.split(":=", 1)) for a in sys.argv[2:]]
service = LaunchService(argv=sys.argv[2:])
service.include_launch_description(LaunchDescription([
    IncludeLaunchDescription(PythonLaunchDescriptionSource(path), launch_arguments=arguments)]))
sys.exit(service.run())
"""


@pytest.fixture
def ros_launch(tmp_path):
    """Run a launch file with LaunchService in a subprocess, as `ros2 launch FILE name:=value ...` does."""
    # (launch.launch_service: a bare `import launch` finds this checkout's launch/ folder as a namespace package)
    for module in ("launch.launch_service", "launch_ros.actions"):
        try:
            importlib.import_module(module)
        except ImportError as exc:  # (named: launch_ros may be there and one of its imports not)
            pytest.skip(f"ROS launch cannot run here: {module}: {exc} (launch and launch_ros are not on PyPI; a "
                        "ROS 2 install has them)")
    procs = []
    env = dict(os.environ)
    # the packaged share folder, lib/flashrt_ros/policy_node and the flashrt command of this environment
    env["AMENT_PREFIX_PATH"] = os.pathsep.join(p for p in (sys.prefix, env.get("AMENT_PREFIX_PATH")) if p)
    env["PATH"] = os.pathsep.join((os.path.join(sys.prefix, "bin"), env.get("PATH", "")))

    def start(path, *arguments, log):
        out = open(log, "w")
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(path), *arguments], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # launch passes it on to the node
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _node_parameters(node, name: str, names: list, timeout: float = 60.0) -> dict:
    from rcl_interfaces.srv import GetParameters
    from rclpy.parameter import parameter_value_to_python

    client = node.create_client(GetParameters, f"{name}/get_parameters")
    try:
        assert client.wait_for_service(timeout_sec=timeout), f"no {name}/get_parameters"
        for _ in range(5):  # the first response can be lost while discovery completes (see test_ros_interfaces)
            future = client.call_async(GetParameters.Request(names=names))
            if spin_until(node, future.done, timeout=5.0):
                break
            client.remove_pending_request(future)
        assert future.done(), "no response"
        return {n: parameter_value_to_python(v) for n, v in zip(names, future.result().values)}
    finally:
        node.destroy_client(client)


@pytest.mark.ros
@pytest.mark.slow
def test_policy_launch_keeps_params_file_values_unless_given(ros_launch, ros_node, tmp_path):
    params = _user_params(tmp_path / "user.yaml", **USER)
    names = list(USER) + ["contract", "autostart"]
    runs = {
        "file only": [],
        "arguments": ["camera_topics:=['/cli/cam/image_raw']", "image_height:=240", "engine:=fused",
                      "device:=cuda:1"],
    }
    got = {}
    for label, arguments in runs.items():
        ns = f"launch_test_{random.randint(0, 1 << 30)}"
        proc = ros_launch(POLICY, f"params_file:={params}", f"namespace:={ns}", "autostart:=false", *arguments,
                          log=tmp_path / f"{label}.log")
        try:
            got[label] = _node_parameters(ros_node, f"/{ns}/policy_node", names)
        except AssertionError:
            raise AssertionError((tmp_path / f"{label}.log").read_text()[-3000:]) from None
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
    assert got["file only"] == {**USER, "contract": "", "autostart": False}
    assert got["arguments"] == {**USER, "camera_topics": ["/cli/cam/image_raw"], "image_height": 240,
                                "engine": "fused", "device": "cuda:1", "contract": "", "autostart": False}


@pytest.mark.ros
@pytest.mark.slow
def test_replay_launch_ends_by_itself(ros_launch, tmp_path):
    from flashrt_ros.replay.make_bag import make_bag

    contract = tmp_path / "tiny.yaml"
    data = yaml.safe_load((REPO / "config" / "pi05_tiny.yaml").read_text())
    data["stages"]["act"]["trigger"]["rate_hz"] = 10  # within reach of a 2-core CPU
    data["stages"]["observe"]["trigger"]["rate_hz"] = 5
    contract.write_text(yaml.safe_dump(data, sort_keys=False))
    bag = tmp_path / "bag"
    make_bag(bag, duration=1.5, height=224, width=224, config=contract)
    params = _user_params(tmp_path / "user.yaml", device="cpu", max_observation_age_ms=5000.0,
                          camera_topics=["camera0/image_raw", "camera1/image_raw"])
    report = tmp_path / "report"
    log = tmp_path / "launch.log"
    start = time.monotonic()
    proc = ros_launch(REPLAY, f"bag:={bag}", f"config:={contract}", f"report:={report}", f"params_file:={params}",
                      "node_timeout:=120", log=log)
    try:
        rc = proc.wait(240)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the replay launch did not end:\n{log.read_text()[-3000:]}") from None
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "flashrt replay finished: shutting down" in text, text[-3000:]
    result = yaml.safe_load((report / "report.json").read_text())
    assert result["mode"] == "realtime" and result["status"] == "ok" and result["decisions"] >= 1, result
    assert time.monotonic() - start < 240


@pytest.mark.ros
@pytest.mark.slow
def test_a_node_that_cannot_configure_ends_the_policy_launch_with_an_error(ros_launch, tmp_path):
    """autostart (default) implies exit_on_failure: a missing checkpoint ends the node and the launch, status 1,
    instead of an unconfigured node that idles until Ctrl-C."""
    log = tmp_path / "launch.log"
    proc = ros_launch(POLICY, f"checkpoint:={tmp_path / 'nope'}", "device:=cpu",
                      f"namespace:=launch_fail_{random.randint(0, 1 << 30)}", log=log)
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launch did not end:\n{log.read_text()[-3000:]}") from None
    text = log.read_text()
    assert rc != 0 and "not found" in text and "policy_node ended with exit code" in text, text[-3000:]


@pytest.mark.ros
@pytest.mark.slow
def test_a_failed_replay_ends_the_replay_launch_with_an_error(ros_launch, tmp_path):
    log = tmp_path / "launch.log"
    proc = ros_launch(REPLAY, f"bag:={tmp_path / 'no_bag'}", f"report:={tmp_path / 'report'}", "device:=cpu",
                      log=log)
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launch did not end:\n{log.read_text()[-3000:]}") from None
    text = log.read_text()
    assert rc != 0 and "flashrt replay failed (exit code 1)" in text, text[-3000:]
