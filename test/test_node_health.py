"""NodeHealth (what the policy node reports on /diagnostics) on a clock the test moves: refusals carried per
topic with their reason and age, WARN while recent, OK again after RECOVERY_S seconds without one."""
import random

from flashrt_ros.diagnostics import RECOVERY_S, NodeHealth


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_refusals_are_kept_per_topic_and_the_level_recovers_after_the_stated_time():
    clock = Clock(float(random.Random(3).randint(100, 1000)))  # (steps below are exact binary fractions)
    health = NodeHealth(clock=clock)
    assert health.level_and_message() == (1, "unconfigured: not publishing actions (lifecycle state; activate the "
                                              "node to run the policy)")
    health.lifecycle = "active"
    assert health.level_and_message() == (0, "ok")
    health.reject("stamp_unset", "header.stamp is zero (not set by the sender)", source="/arm/joint_states")
    clock.t += 0.25
    health.reject("image", "size 8000x8000 (from its header, not decoded), expected 64x48", source="/cam1/compressed")
    health.reject("image", "size 8000x8000 (from its header, not decoded), expected 64x48", source="/cam1/compressed")
    clock.t += 0.5
    level, message = health.level_and_message()
    assert level == 1
    # the latest first, each with its topic, reason and how long ago
    assert message == ("refusing /cam1/compressed: image: size 8000x8000 (from its header, not decoded), expected "
                       "64x48 (0.5 s ago); /arm/joint_states: stamp_unset: header.stamp is zero (not set by the "
                       "sender) (0.8 s ago)")
    values = dict(health.key_values())
    assert values["rejected.image"] == "2" and values["rejected.stamp_unset"] == "1"
    assert values["last_refusal./cam1/compressed"].endswith("expected 64x48 (0.5 s ago) [2 refused]")
    assert values["last_refusal./arm/joint_states"] == ("stamp_unset: header.stamp is zero (not set by the sender) "
                                                        "(0.8 s ago) [1 refused]")
    # the joints' refusal ages out of the message first, then the camera's: OK again, the history kept
    clock.t += RECOVERY_S - 0.625  # the joints' refusal is RECOVERY_S + 0.125 s old, the camera's 0.125 s less
    level, message = health.level_and_message()
    assert level == 1 and "/arm/joint_states" not in message and message.startswith("refusing /cam1/compressed")
    clock.t += 0.125
    assert health.level_and_message() == (0, "ok")
    assert dict(health.key_values())["last_refusal./cam1/compressed"].endswith(f"({RECOVERY_S:.1f} s ago) [2 refused]")
    # one more refusal: WARN again, for RECOVERY_S
    health.reject("joint_state", "JointState names joints ['j1'] more than once", source="/arm/joint_states")
    clock.t += RECOVERY_S - 0.01
    assert health.level_and_message()[0] == 1
    clock.t += 0.02
    assert health.level_and_message()[0] == 0


def test_a_stale_observation_is_an_error_that_also_names_the_refused_inputs():
    clock = Clock(50.0)
    health = NodeHealth(clock=clock)
    health.lifecycle = "active"
    health.stale_reason = "waiting for a first complete observation: nothing accepted yet on /arm/joint_states"
    assert health.level_and_message() == (2, f"not publishing actions: {health.stale_reason}")
    health.reject("stamp_old", "stamp is 5000.0 ms behind the node's clock", source="/arm/joint_states")
    clock.t += 0.3
    level, message = health.level_and_message()
    assert level == 2 and message == (f"not publishing actions: {health.stale_reason}; refusing /arm/joint_states: "
                                      "stamp_old: stamp is 5000.0 ms behind the node's clock (0.3 s ago)")
    health.stale_reason = ""
    assert health.level_and_message()[0] == 1
    health.last_error = "step failed: boom"
    assert health.level_and_message()[1].startswith("step failed: boom; refusing /arm/joint_states")


def test_a_refusal_named_by_its_kind_says_it_once_and_a_state_width_refusal_names_the_fix():
    from types import SimpleNamespace

    from flashrt_core.errors import InputError
    from flashrt_ros.diagnostics import refusal_reason

    health = NodeHealth(clock=Clock(5.0))
    health.reject("observation", "state: shape (7,), expected (8,)")
    assert health.last_rejection == "observation: state: shape (7,), expected (8,)"
    health.reject("image", "size 1x1", source="/cam0")
    assert health.last_rejection == "/cam0: image: size 1x1"
    health.reject("prompt", "prompt: empty", source="/policy_node/prompt")
    assert health.last_rejection == "/policy_node/prompt: prompt: empty"
    exc = InputError("state: shape (7,), expected (8,)")
    as_sent = SimpleNamespace(joint_names=[], state_topic="")
    assert refusal_reason(exc, as_sent, 7) == ("state: shape (7,), expected (8,) (the joints come in message order, "
                                               "7 of them: set the node parameter `joint_names` to the joints the "
                                               "model reads, in its order)")
    named = SimpleNamespace(joint_names=["a"] * 7, state_topic="")
    assert refusal_reason(exc, named, 7) == str(exc)
    assert refusal_reason(InputError("images: 2 cameras"), as_sent, 7) == "images: 2 cameras"
