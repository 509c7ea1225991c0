"""`flashrt doctor` and `flashrt run --dry-run` say what a contract will really run on a device: engine, dtype,
cameras by feature name, normalization, relative actions and tokenizer (nothing loaded)."""
import subprocess
import sys

import pytest

from lerobot_checkpoint import checkpoint_copy, hub_cache


def flashrt(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "flashrt_ros.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_doctor_reports_the_shipped_gpu_contract_for_this_device():
    out = flashrt("doctor", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "engine:               reference" in text and "dtype:                float32" in text  # auto on a CPU
    assert "pi05.yaml" in text and "prompt 48 tokens" in text
    assert "no --checkpoint given, so this is config/pi05.yaml's full-size pi0.5 with random weights" in text


def test_doctor_and_dry_run_with_a_lerobot_checkpoint(tmp_path):
    env = {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "HF_HOME": str(tmp_path / "hf")}
    ckpt = checkpoint_copy(tmp_path)
    out = flashrt("doctor", "--checkpoint", str(ckpt), "--device", "cpu", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cameras:              observation.images.front; observation.images.wrist" in out.stdout
    assert "what runs (flashrt run --dry-run):" in out.stdout
    run = flashrt("run", "--dry-run", "--checkpoint", str(ckpt), "--device", "cpu", "--camera-topics", "/cam_a",
                  "--joint-names", "a", "b", "c", "d", "e", "f", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    text = run.stdout
    assert "observation.images.front <- /cam_a; observation.images.wrist <- (missing: no topic)" in text
    assert "relative actions:     on, columns shoulder_pan, shoulder_lift, elbow, wrist_flex, wrist_roll " \
           "(absolute: gripper)" in text
    assert "normalization:        state QUANTILES, action QUANTILES" in text
    assert "tokenizer:            HubTokenizer " in text and "tokenizer.json" in text
    assert "dry run: ok" in text


@pytest.mark.parametrize("args,reason", [
    (["--joint-names", "a", "b"], "config.json says 6"),  # 2 joints for a 6-value state
    ([], "hf download google/paligemma-3b-pt-224"),  # no tokenizer anywhere
])
def test_dry_run_says_why_configure_would_fail(tmp_path, args, reason):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty" if not args else hub_cache(tmp_path / "hub")),
           "HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path)}
    run = flashrt("run", "--dry-run", "--checkpoint", str(checkpoint_copy(tmp_path)), "--device", "cpu",
                  "--camera-topics", "/a", "/b", *args, env=env)
    assert run.returncode == 1 and reason in run.stderr, run.stdout + run.stderr


def test_run_passes_the_flags_given_as_node_parameters_over_the_params_file():
    from flashrt_ros.cli import build_parser
    from flashrt_ros.run_cli import ros_arguments

    args = build_parser().parse_args(["run", "--checkpoint", "/m/pi05", "--camera-topics", "/a", "/b/compressed",
                                      "--prompt", "it's the red cube", "--params-file", "robot.yaml",
                                      "--act-rate", "30"])
    ros = ros_arguments(args)
    assert ros[:5] == ["--ros-args", "-r", "__node:=policy_node", "--params-file", "robot.yaml"]
    params = dict(ros[i + 1].split(":=", 1) for i in range(5, len(ros), 2))
    assert params == {"checkpoint": '"/m/pi05"', "camera_topics": '["/a", "/b/compressed"]',
                      "prompt": '"it\'s the red cube"', "act_rate_hz": "30.0", "autostart": "true",
                      "exit_on_failure": "true"}
    assert all(ros[i] == "-p" for i in range(5, len(ros), 2))  # flags given after the file: they win


@pytest.mark.parametrize("args,reason", [
    (["--camera-topics", "/a", "/a"], "lists a topic twice"),
    (["--camera-topics", "/cam high/image"], "parameter 'camera_topics': Invalid topic name"),
    (["--joint-names", "a", "a", "c", "d", "e", "f"], "lists a joint twice"),
    (["--act-rate", "5000"], "must lie in [0.0, 1000.0]"),
    (["--dtype", "fp16"], "parameter 'dtype' must be float32"),
    (["--device", "gpu"], "parameter 'device' must be cpu, cuda"),
    (["--device", "cuda"], "no CUDA device"),
    (["--prompt", "pick " * 70], "more than the prompt buffer holds"),
    (["--prompt", "pick up the " * 20], "more than prompt_len = 48"),
])
def test_dry_run_refuses_what_configure_would_refuse(tmp_path, args, reason):
    env = {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "HF_HOME": str(tmp_path / "hf")}
    base = ["run", "--dry-run", "--checkpoint", str(checkpoint_copy(tmp_path)), "--device", "cpu",
            "--camera-topics", "/a", "/b"]
    run = flashrt(*base, *args, env=env)
    assert run.returncode == 1 and reason in run.stderr, run.stdout + run.stderr


def test_dry_run_reads_the_params_file_with_the_node_types(tmp_path):
    env = {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "HF_HOME": str(tmp_path / "hf")}
    params = tmp_path / "robot.yaml"
    params.write_text("/**:\n  ros__parameters:\n    act_rate_hz: 20\n    act_rate_hx: 5.0\n")
    ckpt = checkpoint_copy(tmp_path)
    run = flashrt("run", "--dry-run", "--checkpoint", str(ckpt), "--device", "cpu", "--camera-topics", "/a",
                  "--params-file", str(params), env=env)
    # an integer for a double is that number (the node takes it so too); a typo is named, with the closest name;
    # the camera feature without a topic is said to be masked
    assert run.returncode == 0 and "act 20 Hz" in run.stdout, run.stdout + run.stderr
    assert "parameter 'act_rate_hx' is not a policy_node parameter; the node ignores it (did you mean " \
           "'act_rate_hz'?)" in run.stdout, run.stdout
    assert "have no topic (camera_topics lists 1 for 2 features): the model sees those views masked" in run.stdout
    assert "joint_names is empty" in run.stdout and "the checkpoint names its actions shoulder_pan, shoulder_lift, " \
           "elbow, wrist_flex, wrist_roll, gripper" in run.stdout, run.stdout
    params.write_text("/**:\n  ros__parameters:\n    act_rate_hz: fast\n")  # a string: refused as the node does
    run = flashrt("run", "--dry-run", "--checkpoint", str(ckpt), "--device", "cpu", "--camera-topics", "/a",
                  "--params-file", str(params), env=env)
    assert run.returncode == 1 and "parameter 'act_rate_hz' must be of type double, got 'fast'" in run.stderr, \
        run.stderr


def test_run_exits_with_status_1_when_configure_fails(tmp_path):
    """flashrt run (autostart + exit_on_failure): a node that cannot configure ends instead of idling."""
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path)}
    run = flashrt("run", "--checkpoint", str(checkpoint_copy(tmp_path)), "--device", "cpu", "--camera-topics", "/a",
                  env=env)
    assert run.returncode == 1 and "configure failed" in run.stdout + run.stderr, run.stdout + run.stderr


def test_prompt_with_non_ascii_text_reaches_the_node_parameter():
    from flashrt_ros.cli import build_parser
    from flashrt_ros.run_cli import ros_arguments

    ros = ros_arguments(build_parser().parse_args(["run", "--prompt", "falte das Handtuch \U0001F9FA \u00f1"]))
    assert '-p' in ros and 'prompt:="falte das Handtuch \U0001F9FA \u00f1"' in ros


JOINTS = ("shoulder_pan", "shoulder_lift", "elbow", "wrist_flex", "wrist_roll", "gripper")  # (the fixture's state)

UNUSABLE_PARAMS_FILES = [  # (file, the reason given): files rcl refuses, or that hold no node section at all
    ("policy_node:\n  ros__parameters:\n    act_rate_hz: [1, 2\n",
     "line 4, column 1: not valid YAML: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence "
     "at line 3, column 18)"),
    ("act_rate_hz: 5.0\n", "'act_rate_hz' is outside any `NODE: ros__parameters:` section (ROS refuses the file); "
                           "put the parameters under `policy_node: ros__parameters:`"),
    ("fold the towel\n", "the file is a str, not a mapping of node sections; put the parameters under "
                         "`policy_node: ros__parameters:`"),
    ("- act_rate_hz: 5.0\n", "the file is a list"),
    ("policy_node:\n  act_rate_hz: 5.0\n", "'policy_node/act_rate_hz' is outside any `NODE: ros__parameters:`"),
    ("policy_node:\n  ros__parameters: 5.0\n", "`ros__parameters` of 'policy_node' is 5.0, not a mapping"),
    ("policy_node:\n  ros__parameters:\n", "`ros__parameters` of 'policy_node' is empty, not a mapping"),
    ("policy_node:\n  ros__parameters:\n    act_rate_hz:\n", "parameter 'act_rate_hz' has no value"),
]


@pytest.mark.parametrize("text,reason", UNUSABLE_PARAMS_FILES)
def test_dry_run_refuses_an_unusable_params_file_in_one_line(tmp_path, capsys, text, reason):
    from flashrt_ros.cli import main

    params = tmp_path / "robot.yaml"
    params.write_text(text)
    assert main(["run", "--dry-run", "--params-file", str(params)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flashrt run: --params-file: {params}") and reason in err, err
    assert err.count("\n") == 1, err  # one line: no traceback


@pytest.mark.parametrize("text,reason", [UNUSABLE_PARAMS_FILES[0], UNUSABLE_PARAMS_FILES[4]])
def test_run_refuses_an_unusable_params_file_before_the_node_starts(tmp_path, text, reason):
    params = tmp_path / "robot.yaml"
    params.write_text(text)
    run = flashrt("run", "--params-file", str(params))
    assert run.returncode == 1 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.startswith(f"flashrt run: --params-file: {params}") and reason in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr  # no traceback, nothing from rcl


@pytest.mark.parametrize("text,expected", [  # expected: what rclpy itself gives /policy_node
    ("policy_node:\n  ros__parameters:\n    act_rate_hz: 5.0\n", {"act_rate_hz": 5.0}),
    ("/policy_node:\n  ros__parameters:\n    act_rate_hz: 5.0\n", {"act_rate_hz": 5.0}),
    ("/**/policy_node:\n  ros__parameters:\n    act_rate_hz: 5.0\n", {"act_rate_hz": 5.0}),
    ("/*:\n  ros__parameters:\n    act_rate_hz: 5.0\n", {"act_rate_hz": 5.0}),
    ("/**:\n  policy_node:\n    ros__parameters:\n      act_rate_hz: 5.0\n", {"act_rate_hz": 5.0}),  # nested
    ("policy_node:\n  ros__parameters:\n    rtc: true\n    capsule:\n      budget: {mb: 3}\n",
     {"rtc": True, "capsule.budget.mb": 3}),  # nested parameter names
    ("/**:\n  ros__parameters:\n    act_rate_hz: 7.0\n    rtc: true\n"  # the later section wins, as in rcl
     "policy_node:\n  ros__parameters:\n    act_rate_hz: 5.0\n", {"act_rate_hz": 5.0, "rtc": True}),
    ("policy_node:\n  ros__parameters:\n    act_rate_hz: 5.0\n"
     "/**:\n  ros__parameters:\n    act_rate_hz: 7.0\n", {"act_rate_hz": 7.0}),
    ("/**:\n  ros__parameters:\n    act_rate_hz: 7.0\nother_node:\n  ros__parameters:\n    act_rate_hz: 5.0\n",
     {"act_rate_hz": 7.0}),
])
def test_params_file_sections_reach_the_node_as_rcl_gives_them(tmp_path, text, expected):
    import rclpy
    from rclpy.node import Node

    from flashrt_ros.run_cli import file_parameters

    params = tmp_path / "robot.yaml"
    params.write_text(text)
    context = rclpy.Context()
    rclpy.init(args=["flashrt", "--ros-args", "-r", "__node:=policy_node", "--params-file", str(params)],
               context=context)
    try:
        node = Node("policy_node", context=context, start_parameter_services=False, enable_rosout=False)
        rcl = {name: p.value for name, p in node._parameter_overrides.items()}
        node.destroy_node()
    finally:
        rclpy.shutdown(context=context)
    assert rcl == expected
    assert file_parameters(str(params), "policy_node") == (expected, [])


@pytest.mark.parametrize("text", [
    "/**:\n  policy_node:\n    ros__parameters:\n      act_rate_hz: 7.0\n",
    "/**:\n  ros__parameters:\n    act_rate_hz: 5.0\n/**/policy_node:\n  ros__parameters:\n    act_rate_hz: 7.0\n",
])
def test_dry_run_merges_the_ros_forms_of_the_node_section(tmp_path, text):
    env = {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "HF_HOME": str(tmp_path / "hf")}
    params = tmp_path / "robot.yaml"
    params.write_text(text)
    run = flashrt("run", "--dry-run", "--checkpoint", str(checkpoint_copy(tmp_path)), "--device", "cpu",
                  "--camera-topics", "/a", "/b", "--joint-names", *JOINTS, "--params-file", str(params),
                  "--prompt", "fold it", env=env)
    assert run.returncode == 0, run.stderr
    assert "act 7 Hz" in run.stdout and "warning:" not in run.stdout, run.stdout


def test_dry_run_warns_when_no_section_of_the_params_file_reaches_the_node(tmp_path):
    env = {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "HF_HOME": str(tmp_path / "hf")}
    params = tmp_path / "robot.yaml"
    params.write_text("other_node:\n  ros__parameters:\n    act_rate_hz: 7.0\n"  # legal ROS, for other nodes
                      "robot1:\n  policy_node:\n    ros__parameters:\n      act_rate_hz: 7.0\n")  # /robot1/policy_node
    run = flashrt("run", "--dry-run", "--checkpoint", str(checkpoint_copy(tmp_path)), "--device", "cpu",
                  "--camera-topics", "/a", "/b", "--joint-names", *JOINTS, "--params-file", str(params),
                  "--prompt", "fold it", env=env)
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == [f"{'warning:':<22}{params}: the node /policy_node (flashrt run starts it in the root "
                        "namespace) gets nothing from section(s) other_node, robot1/policy_node; name the section "
                        "`policy_node:` or `/**:`"], run.stdout
    assert "act 7 Hz" not in run.stdout
