"""A node set-up that runs but is probably not what the user meant is said at configure (log and /diagnostics);
a parameter of the wrong type in a params file fails configure with the reason instead of killing the node;
lifecycle transitions are logged and a stopped stage does not keep its old rate."""
import random

import pytest

from flashrt_core.contract.plan import rate_warnings
from flashrt_core.contract.spec import load_contract
from flashrt_ros import setup_checks
from flashrt_ros.diagnostics import NodeHealth, StageStats
from flashrt_ros.runtime_loader import packaged_config


def test_unknown_parameters_are_named_with_the_closest_known_name():
    known = ["act_rate_hz", "observe_rate_hz", "camera_topics", "capsule_budget_mb.device"]
    out = setup_checks.unknown_parameters(["act_rate_hx", "camera_topic", "act_rate_hz", "zzz"], known)
    assert out == ["parameter 'act_rate_hx' is not a policy_node parameter; the node ignores it (did you mean "
                   "'act_rate_hz'?)",
                   "parameter 'camera_topic' is not a policy_node parameter; the node ignores it (did you mean "
                   "'camera_topics'?)",
                   "parameter 'zzz' is not a policy_node parameter; the node ignores it"]


def test_camera_features_without_a_topic_and_joints_in_message_order_are_warned_of():
    assert setup_checks.camera_warnings(["front", "wrist"], ["/a", "/b"]) == []
    [w] = setup_checks.camera_warnings(["front", "wrist", "top"], ["/a"])
    assert w.startswith("camera feature(s) wrist, top have no topic (camera_topics lists 1 for 3 features)")
    assert setup_checks.joint_warnings(["j1"], "", ["a"]) == [] and setup_checks.joint_warnings([], "/ee", []) == []
    [w] = setup_checks.joint_warnings([], "", ["shoulder_pan", "gripper"])
    assert "joint_names is empty" in w and "names its actions shoulder_pan, gripper" in w


@pytest.mark.parametrize("observe_hz,limit_ms,warned", [(10, 250, False), (4, 250, False), (2, 250, True),
                                                        (2, 600, False), (1, None, False)])
def test_an_observation_stage_slower_than_the_age_limit_is_warned_of(observe_hz, limit_ms, warned):
    contract = load_contract(packaged_config("pi05.yaml")).with_overrides(
        rates={"observe": observe_hz}, limits={"max_observation_age_ms": limit_ms})
    out = rate_warnings(contract)
    assert bool(out) == warned
    if warned:
        assert out == [f"stage observe runs every {1000 // observe_hz} ms ({observe_hz} Hz) but observations older "
                       f"than {limit_ms} ms give no actions (max_observation_age_ms): part of every period "
                       f"publishes nothing; raise its rate above {1000 / limit_ms:g} Hz or the age limit"]


def test_a_stopped_stage_reports_no_rate_and_an_inactive_node_no_staleness():
    stats = StageStats()
    for i in range(20):
        stats.add(5.0, now=100.0 + 0.1 * i)
    assert stats.rate_hz(now=102.0) == pytest.approx(10.0)
    assert stats.rate_hz(now=102.8) == pytest.approx(10.0)
    assert stats.rate_hz(now=103.0) == 0.0  # (over a second past its last run, at least three periods)
    health = NodeHealth()
    health.lifecycle = "inactive"
    assert dict(health.key_values())["staleness"] == "- (inactive)"
    health.lifecycle = "active"
    assert dict(health.key_values())["staleness"] == "fresh" and health.level_and_message() == (0, "ok")
    health.setup_warnings = ["joint_names is empty: ..."]
    assert health.level_and_message() == (1, "publishing; set-up: joint_names is empty: ...")
    assert dict(health.key_values())["setup_warning.0"] == "joint_names is empty: ..."


@pytest.mark.ros
def test_a_wrong_type_fails_configure_with_the_reason_and_a_typo_is_named(ros_context):
    pytest.importorskip("rclpy")
    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.parameter import Parameter

    from flashrt_ros.policy_node import PolicyNode

    overrides = [Parameter("act_rate_hx", value=10.0), Parameter("act_rate_hz", value=10),
                 Parameter("seed", value="abc"), Parameter("capsule_budget_mb.host", value=-5),
                 Parameter("device", value="cpu"), Parameter("cpu_threads", value=1), Parameter("prompt", value="go")]
    node = PolicyNode(f"setup_node_{random.randint(0, 1 << 30)}", context=ros_context, parameter_overrides=overrides)
    try:
        assert node.get_parameter("act_rate_hz").value == 10.0  # an integer for a double: that number
        assert node.get_parameter("seed").value == 0  # the wrong type was not taken
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
        assert "parameter 'seed' must be of type integer, got 'abc'" in node.health.last_error
        assert "parameter 'capsule_budget_mb.host' must be of type integer in [0, 1073741824], got -5" in \
            node.health.last_error
        # set right, the parameters configure (the typo stays a warning, beside the joints taken as sent)
        assert node.set_parameters([Parameter("seed", value=3), Parameter("capsule_budget_mb.host", value=64)]
                                   )[0].successful
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        warnings = node.health.setup_warnings
        assert any("'act_rate_hx' is not a policy_node parameter" in w and "'act_rate_hz'" in w for w in warnings)
        assert any(w.startswith("joint_names is empty") for w in warnings)
        assert node.runtime.stage_rates()["act"] == 10.0
        # a value of another type set on a running node is said in type names (rclpy's own reason gives codes)
        wrong = node.set_parameters([Parameter("act_rate_hz", value="fast")])[0]
        assert not wrong.successful
        assert wrong.reason == "Wrong parameter type: 'act_rate_hz' must be of type double, got string 'fast'"
        # a prompt with a NUL byte or invalid UTF-8 (as a C++ sender can send it) is refused, not cut or replaced
        for data, said in ((b"pick\x00up\x00", "a NUL byte at byte 4"), (b"pick\xffup\x00", "invalid UTF-8 at byte 4")):
            node._on_prompt_bytes(b"\x00\x01\x00\x00" + len(data).to_bytes(4, "little") + data)
            assert said in node.health.last_rejection and node.runtime.prompt == "go", node.health.last_rejection
        node._on_prompt_bytes(b"\x00\x01\x00\x00\x08\x00\x00\x00pick up\x00")
        assert node.runtime.prompt == "pick up"
        assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS and node.runtime is None
        assert node.trigger_shutdown() == TransitionCallbackReturn.SUCCESS and node.finalized
    finally:
        node.destroy_node()
