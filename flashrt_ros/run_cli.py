"""`flashrt run`: start the policy node on a robot from a LeRobot checkpoint folder (the pip-only way).

    flashrt run --checkpoint DIR --camera-topics /cam_high/image_raw /cam_wrist/image_raw/compressed --dry-run
    flashrt run --checkpoint DIR --camera-topics ... --joint-names j1 j2 ... --prompt "fold the towel"

`--dry-run` prints what would run (model, sizes, cameras by feature name with their topics, normalization,
relative actions, tokenizer file, engine, dtype, device) and exits 0, or 1 with the reason; nothing is loaded
onto the device. Without it the node starts configured and active (`autostart`), with the parameters given
here over those of `--params-file`.
"""
from __future__ import annotations

import json
import sys

# CLI flag -> node parameter (None values are not passed: the params file or the node default applies)
_FLAGS = {"checkpoint": "checkpoint", "config": "contract", "camera_topics": "camera_topics",
          "joint_state_topic": "joint_state_topic", "joint_names": "joint_names", "state_topic": "state_topic",
          "device": "device", "dtype": "dtype", "engine": "engine", "tokenizer": "tokenizer", "prompt": "prompt",
          "act_rate": "act_rate_hz", "observe_rate": "observe_rate_hz", "rtc": "rtc",
          "precision": "precision"}


# the presets of flashrt_core.models.precision.PRESETS (not imported here: it would load torch for `--help`;
# test_precision checks that the two agree)
PRECISIONS = ("bf16", "fp8", "w4a16", "fp8+w4a16", "fp8+mxfp4")


def add_subparsers(sub) -> None:
    p = sub.add_parser("run", help="start the policy node from a LeRobot checkpoint folder (--dry-run: show the plan)")
    p.add_argument("--checkpoint", help="LeRobot pi0.5 checkpoint folder (as save_pretrained writes it)")
    p.add_argument("--config", help="execution contract YAML (default: the packaged pi05.yaml with a checkpoint)")
    p.add_argument("--camera-topics", nargs="+", help="one topic per camera feature, in config.json's order")
    p.add_argument("--joint-state-topic", help="sensor_msgs/JointState topic (default joint_states)")
    p.add_argument("--joint-names", nargs="+", help="joints in the checkpoint's observation.state order")
    p.add_argument("--state-topic", help="std_msgs/Float64MultiArray state topic instead of joint states")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: the contract's)")
    p.add_argument("--engine", choices=("auto", "fused", "reference"), help="default auto")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="bf16; fp8 (the prefix's GEMMs in fp8); w4a16 (the action expert's weights in 4 bits); "
                        "fp8+w4a16; fp8+mxfp4 (the expert in MXFP4: Blackwell / Thor) (default: the contract's, "
                        "bf16)")
    p.add_argument("--rtc", action="store_const", const=True, default=None,
                   help="real-time chunking in the act stage (node parameters rtc_*: its options)")
    p.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model file or folder (default: hub cache)")
    p.add_argument("--prompt", help="the task")
    p.add_argument("--act-rate", type=float, help="act stage rate in Hz (default: the contract's)")
    p.add_argument("--observe-rate", type=float, help="observe stage rate in Hz (default: the contract's)")
    p.add_argument("--params-file", help="a ROS parameters YAML for the node (the flags above win over it)")
    p.add_argument("--node-name", default="policy_node")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit (0 ok, 1 with the reason)")
    p.set_defaults(func=run_command)


def node_parameters(args) -> dict:
    """{parameter: value} for the flags that were given."""
    return {param: getattr(args, flag) for flag, param in _FLAGS.items() if getattr(args, flag) is not None}


# parameters a params file may set beside the node's own: the capsule ones (flashrt_ros.capsule_params) and rclpy's
CAPSULE_PARAMETERS = {"capsule_budget_mb", "capsule_eviction", "capsule_dir"}
ROS_PARAMETERS = {"use_sim_time"}


def _ros_value(v) -> str:
    """A `-p name:=value` value: rcl reads it as YAML, and JSON strings, lists and numbers are valid YAML (not
    escaped to ASCII: a surrogate pair is no YAML)."""
    return json.dumps(v, ensure_ascii=False)


def ros_arguments(args) -> list[str]:
    out = ["--ros-args", "-r", f"__node:={args.node_name}"]
    if args.params_file:
        out += ["--params-file", args.params_file]
    for name, value in {**node_parameters(args), "autostart": True, "exit_on_failure": True}.items():
        out += ["-p", f"{name}:={_ros_value(value)}"]
    return out


def _file_parameters(path: str | None, node_name: str) -> dict:
    """The node's parameters in a ROS params file (its own section over `/**`), for the dry run."""
    if not path:
        return {}
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    merged: dict = {}
    for key in ("/**", node_name, "/" + node_name.lstrip("/")):
        section = data.get(key) if isinstance(data, dict) else None
        if isinstance(section, dict):
            merged.update(section.get("ros__parameters") or {})
    return merged


def dry_run(args) -> int:
    from flashrt_core.contract.plan import describe_run, format_run
    from flashrt_core.errors import FlashRTError
    from flashrt_ros.params import PARAMETERS, validate
    from flashrt_ros.runtime_loader import runtime_arguments

    values = {name: default for name, (default, *_rest) in PARAMETERS.items()}
    try:
        values.update(_file_parameters(args.params_file, args.node_name))
    except (OSError, ValueError) as exc:
        print(f"flashrt run: --params-file: {exc}", file=sys.stderr)
        return 1
    values.update(node_parameters(args))
    unknown = sorted(set(values) - set(PARAMETERS) - CAPSULE_PARAMETERS - ROS_PARAMETERS)
    try:
        p = validate({k: values[k] for k in PARAMETERS})
        kwargs = runtime_arguments(p, len(p.camera_topics))
        info = describe_run(kwargs.pop("path"), device=p.device, tokenizer=kwargs.pop("tokenizer"),
                            prompt=p.prompt or None, **kwargs)
    except (FlashRTError, ValueError, OSError) as exc:
        print(f"flashrt run --dry-run: would fail at configure: {exc}", file=sys.stderr)
        return 1
    state = f"from {p.state_topic} (Float64MultiArray)" if p.state_topic else \
        f"from {p.joint_state_topic} (JointState; joints {', '.join(p.joint_names) or 'in message order'})"
    print(format_run(info, camera_topics=p.camera_topics))
    print(f"{'state input:':<22}{state}")
    for name in unknown:  # (a typo, most likely: ROS ignores an override of an undeclared parameter)
        print(f"{'warning:':<22}parameter {name!r} in {args.params_file} is not a policy_node parameter; the node "
              "ignores it")
    print("dry run: ok (nothing was loaded)")
    return 0


def run_command(args) -> int:
    if args.dry_run:
        return dry_run(args)
    from flashrt_ros.policy_node import main as node_main

    node_main(args=[sys.argv[0], *ros_arguments(args)])
    return 0
