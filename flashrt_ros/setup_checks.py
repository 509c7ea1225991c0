"""Warnings about a node set-up that runs but is probably not what the user meant: told at configure (log and
/diagnostics) and by `flashrt run --dry-run`, from the same function.

- parameters in a params file or `-p` that the node does not have (a typo: ROS ignores such an override);
- camera features of the checkpoint without a topic (the model sees those views masked);
- the state taken in each JointState message's own order (no `joint_names`);
- an observation stage slower than the observation age limit (part of every period publishes nothing;
  `flashrt_core.contract.plan.rate_warnings`, also for the replay).
"""
from __future__ import annotations

import difflib

from flashrt_core.contract.plan import rate_warnings


def unknown_parameters(given, known=None) -> list[str]:
    """One warning per name in `given` the node does not declare (`known`; default: the node's own and its
    capsule parameters), with the closest known name."""
    if known is None:
        from flashrt_ros import capsule_params, params

        known = list(params.PARAMETERS) + list(capsule_params.PARAMETERS)
    out = []
    for name in sorted(set(given) - set(known)):
        near = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        out.append(f"parameter '{name}' is not a policy_node parameter; the node ignores it{hint}")
    return out


def undeclared_overrides(node) -> list[str]:
    """`unknown_parameters` of a node's overrides that name no declared parameter (a typo in a params file: ROS
    keeps such an override and never uses it)."""
    from flashrt_ros.params import overrides_of

    return unknown_parameters([n for n in overrides_of(node) if not node.has_parameter(n)])


def camera_warnings(features, topics) -> list[str]:
    """The checkpoint's camera features (config.json order) that no topic feeds."""
    missing = list(features)[len(topics):]
    if not missing or not topics:
        return []
    return [f"camera feature(s) {', '.join(missing)} have no topic (camera_topics lists {len(topics)} for "
            f"{len(features)} features): the model sees those views masked; add their topics to camera_topics, in "
            "config.json's order"]


def joint_warnings(joint_names, state_topic: str, action_names) -> list[str]:
    """The state in message order: right only if the robot's driver sends its joints in the model's order."""
    if joint_names or state_topic:
        return []
    named = (f"; the checkpoint names its actions {', '.join(action_names)}: if the state holds the same joints, "
             "set joint_names to them in that order") if action_names else ""
    return ["joint_names is empty: the state is each JointState message's positions in the order the message "
            f"lists them{named}"]


def grey_camera_warning(topic: str, encoding: str) -> str:
    """A camera sending one-channel frames (taken as grey RGB): most likely a depth or IR camera on a colour
    slot; "" for a colour encoding."""
    from flashrt_ros.conversions import GREY_ENCODINGS

    if encoding not in GREY_ENCODINGS:
        return ""
    return (f"camera {topic} sends {encoding} frames (one channel: depth, IR or mono); they are taken as grey RGB, "
            "but the model was trained on colour frames")


def configured_warnings(p, runtime) -> list[str]:
    """What configure says of node parameters `p` (flashrt_ros.params.NodeParams) with the runtime they built:
    cameras without a topic, joints in message order, an observe rate past the age limit, and what the
    checkpoint folder says twice and differently (`Processors.notes`)."""
    from flashrt_ros.runtime_loader import action_names, runtime_camera_names

    procs = getattr(runtime.binding, "processors", None)
    return (camera_warnings(runtime_camera_names(runtime), p.camera_topics)
            + joint_warnings(p.joint_names, p.state_topic, action_names(runtime))
            + rate_warnings(runtime.contract) + list(procs.notes if procs is not None else ()))
