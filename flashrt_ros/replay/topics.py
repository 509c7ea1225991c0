"""Which bag topic feeds which runtime input.

The contract YAML describes the model, not the robot's topics (and its schema rejects unknown keys), so the
mapping comes from a small YAML file, from a policy_node parameters file (the same file that configures the
node on the robot), or from command-line options, in that order of increasing precedence.
Defaults match `make-bag` and a policy_node named `policy_node` in the root namespace.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from flashrt_ros.replay.errors import ReplayError

_KEYS = ("cameras", "joint_states", "joint_names", "prompt", "actions")


@dataclass(frozen=True)
class TopicMap:
    cameras: tuple[str, ...] = ("/camera0/image_raw", "/camera1/image_raw")  # model slot order
    joint_states: str = "/joint_states"
    joint_names: tuple[str, ...] = ()  # () = take JointState order as is
    prompt: str = "/policy_node/prompt"  # std_msgs/String
    actions: str = "/policy_node/action_chunk"  # recorded flashrt_ros/ActionChunk (optional in the bag)

    def describe(self) -> dict:
        return {"cameras": list(self.cameras), "joint_states": self.joint_states,
                "joint_names": list(self.joint_names), "prompt": self.prompt, "actions": self.actions}


def absolute(topic: str, namespace: str = "/") -> str:
    """Resolve a relative or private (`~/x`) topic name the way a node in `namespace` would."""
    topic = str(topic).strip()
    if topic.startswith("/"):
        return topic
    if topic.startswith("~/"):
        return namespace.rstrip("/") + "/" + topic[2:]
    return "/" + topic


def _from_node_params(params: dict, node: str, where: str) -> dict:
    """policy_node parameters (camera_topics, joint_state_topic, joint_names) -> mapping keys."""
    # a wildcard key (`/**`, `policy_node/*`) names no node: the topics are the default node name's
    ns = "/" + node.strip("/") if "*" not in node else "/policy_node"
    out = {}
    if "camera_topics" in params:
        out["cameras"] = params["camera_topics"]
    if "joint_state_topic" in params:
        out["joint_states"] = params["joint_state_topic"]
    if "joint_names" in params:
        out["joint_names"] = [n for n in params["joint_names"] if n]
    out["prompt"] = f"{ns}/prompt"
    out["actions"] = f"{ns}/action_chunk"
    if not out.get("cameras"):
        raise ReplayError(f"{where}: {node}.ros__parameters.camera_topics is missing or empty")
    return out


# policy_node parameters a replay takes from a node params file given as --topics (its flags win)
RUN_PARAMETERS = ("contract", "checkpoint", "tokenizer", "seed", "action_dt")


def node_run_parameters(path) -> dict:
    """{name: value} of RUN_PARAMETERS set (non-empty) in `path` when it is a policy_node params file (its first
    node section, as `load_topic_map` reads it); {} for a topic mapping file. Errors: `load_topic_map`'s."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return {}  # (load_topic_map says what is wrong with the file)
    nodes = [v for v in data.values() if isinstance(v, dict) and "ros__parameters" in v] \
        if isinstance(data, dict) else []
    params = (nodes[0]["ros__parameters"] or {}) if nodes else {}
    return {k: params[k] for k in RUN_PARAMETERS if params.get(k) not in (None, "")}


def load_topic_map(path=None, **overrides) -> TopicMap:
    """A TopicMap from `path` (mapping YAML or policy_node params file) with `overrides` (None = unset)."""
    values: dict = {}
    if path is not None:
        where = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ReplayError(f"{where}: cannot read topic mapping ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ReplayError(f"{where}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ReplayError(f"{where}: expected a mapping of {', '.join(_KEYS)}")
        nodes = {k: v for k, v in data.items() if isinstance(v, dict) and "ros__parameters" in v}
        if nodes:
            node, section = next(iter(nodes.items()))
            values = _from_node_params(section["ros__parameters"] or {}, node, where)
        else:
            for key in data:
                if key not in _KEYS:
                    raise ReplayError(f"{where}: {key}: unknown key (expected one of {', '.join(_KEYS)})")
            values = dict(data)
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key in values:
        if key not in _KEYS:
            raise ReplayError(f"topic mapping: {key}: unknown key (expected one of {', '.join(_KEYS)})")
    m = TopicMap()
    if "cameras" in values:
        cams = values["cameras"]
        cams = [c for c in (cams.split(",") if isinstance(cams, str) else cams) if str(c).strip()]
        if not cams:
            raise ReplayError("topic mapping: cameras: at least one camera topic is required")
        m = replace(m, cameras=tuple(absolute(c) for c in cams))
    for key in ("joint_states", "prompt", "actions"):
        if key in values:
            if not isinstance(values[key], str) or not values[key].strip():
                raise ReplayError(f"topic mapping: {key}: expected a topic name, got {values[key]!r}")
            m = replace(m, **{key: absolute(values[key])})
    if "joint_names" in values:
        names = values["joint_names"]
        names = names.split(",") if isinstance(names, str) else names
        m = replace(m, joint_names=tuple(str(n).strip() for n in names if str(n).strip()))
    if len(set(m.cameras)) != len(m.cameras):
        raise ReplayError(f"topic mapping: cameras: a topic is listed twice: {list(m.cameras)}")
    return m
