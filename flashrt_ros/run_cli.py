"""`flashrt run`: start the policy node on a robot from a LeRobot checkpoint folder (the pip-only way).

    flashrt run --checkpoint DIR --camera-topics /cam_high/image_raw /cam_wrist/image_raw/compressed --dry-run
    flashrt run --checkpoint DIR --camera-topics ... --joint-names j1 j2 ... --prompt "fold the towel"

`--dry-run` prints what would run (model, sizes, cameras by feature name with their topics, normalization,
relative actions, tokenizer file, engine, dtype, device) and exits 0, or 1 with the reason; nothing is loaded
onto the device. Without it the node starts configured and active (`autostart`), with the parameters given
here over those of `--params-file`. Either way a params file that rcl would refuse, or that holds no node section,
is refused first in one line (exit 1), and sections that miss the node (/NODE, in the root namespace) are warned of.
"""
from __future__ import annotations

import json
import re
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
    p.add_argument("--checkpoint", help="LeRobot pi0 or pi0.5 checkpoint folder, as save_pretrained writes it "
                                        "(its config.json's type picks the model)")
    p.add_argument("--config", help="execution contract YAML (default: the packaged pi05.yaml or pi0.yaml, as "
                                    "the checkpoint's model)")
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
    p.add_argument("--node-name", default="policy_node",
                   help="the node's name (its topics and services are under it; default policy_node)")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit (0 ok, 1 with the reason)")
    p.set_defaults(func=run_command)


def node_parameters(args) -> dict:
    """{parameter: value} for the flags that were given."""
    return {param: getattr(args, flag) for flag, param in _FLAGS.items() if getattr(args, flag) is not None}


# parameters a params file may set beside the node's own and the capsule ones (flashrt_ros.capsule_params): rclpy's
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


def _selects(section: str, node_name: str) -> bool:
    """Whether rcl gives a params-file section (`/**`, `/*`, `NODE`, `/NODE`, `/**/NODE`, `/ns/NODE`) to the node
    flashrt run starts: /NODE, in the root namespace."""
    pattern = "".join("(/[^/]+)*" if t == "**" else "/[^/]+" if t == "*" else "/" + re.escape(t)
                      for t in section.split("/") if t)
    return re.fullmatch(pattern, "/" + node_name.lstrip("/")) is not None


def _sections(data: dict, path: str, node_name: str, names: tuple = ()):
    """(section name, {parameter: value}) for each `ros__parameters` of a params file, in file order, with nested
    namespaces joined (`ns: {NODE: ...}` is `ns/NODE`) and nested parameters dotted, as rcl reads them.
    ValueError: what rcl refuses."""
    fix = f"put the parameters under `{node_name}: ros__parameters:` (or `/**: ros__parameters:` for every node)"
    for key, value in data.items():
        where = "/".join((*names, str(key)))
        if key == "ros__parameters" and names:
            if not isinstance(value, dict):
                raise ValueError(f"{path}: `ros__parameters` of {'/'.join(names)!r} is "
                                 f"{'empty' if value is None else repr(value)}, not a mapping; write the "
                                 "parameters under it as `name: value` lines (`ros__parameters: {}` for none)")
            yield "/".join(names), _flat(value, path)
        elif key == "ros__parameters" or not isinstance(value, dict):
            raise ValueError(f"{path}: {where!r} is outside any `NODE: ros__parameters:` section (ROS refuses the "
                             f"file); {fix}")
        else:
            yield from _sections(value, path, node_name, (*names, str(key)))


def _flat(params: dict, path: str, prefix: str = "") -> dict:
    """{dotted name: value} of a `ros__parameters` mapping (rcl's nested parameter names)."""
    out = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, path, name + "."))
        elif value is None:
            raise ValueError(f"{path}: parameter {name!r} has no value (ROS refuses the file); give it one or "
                             "delete the line")
        else:
            out[name] = value
    return out


def file_parameters(path: str | None, node_name: str) -> tuple[dict, list[str]]:
    """The node's parameters in a ROS params file as rcl applies them (every section that selects the node, a
    later one over an earlier one), and warnings. ValueError: a file ROS refuses or that is no params file."""
    if not path:
        return {}, []
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
            at = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            if context:
                problem += f" ({exc.context} at line {context.line + 1}, column {context.column + 1})"
            raise ValueError(f"{path}{at}: not valid YAML: {problem}") from None
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the file is a {type(data).__name__}, not a mapping of node sections; put the "
                         f"parameters under `{node_name}: ros__parameters:`")
    merged: dict = {}
    reached, missed = False, []
    for name, params in _sections(data, path, node_name):
        if _selects(name, node_name):
            reached = True
            merged.update(params)
        else:
            missed.append(name)
    node = node_name.lstrip("/")
    if reached:  # the other sections are other nodes' unless they name this one (in another namespace)
        missed = [name for name in missed if name.rsplit("/", 1)[-1] == node]
    if not missed:
        return merged, []
    return merged, [f"{path}: the node /{node} (flashrt run starts it in the root namespace) gets nothing from "
                    f"section(s) {', '.join(missed)}; name the section `{node}:` or `/**:`"]


def dry_run(args, file_values: dict, warnings: list[str]) -> int:
    from flashrt_core.contract.plan import describe_run, format_run
    from flashrt_core.errors import FlashRTError
    from flashrt_ros.params import PARAMETERS, validate
    from flashrt_ros.runtime_loader import runtime_arguments

    from flashrt_ros import setup_checks

    values = {name: default for name, (default, *_rest) in PARAMETERS.items()}
    values.update(file_values)
    values.update(node_parameters(args))
    unknown = setup_checks.unknown_parameters(set(values) - ROS_PARAMETERS)
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
    cameras = info["cameras"] if kwargs.get("checkpoint") else []  # (feature names come with a checkpoint)
    warnings = unknown + setup_checks.camera_warnings(cameras, p.camera_topics) + \
        setup_checks.joint_warnings(p.joint_names, p.state_topic, _action_names(kwargs.get("checkpoint"))) + \
        info.get("warnings", []) + warnings
    for warning in warnings:
        print(f"{'warning:':<22}{warning}")
    if not p.prompt:
        print(f"{'warning:':<22}no prompt: the node publishes no actions until a task arrives on its ~/prompt "
              "topic (or give --prompt)")
    print("dry run: ok (nothing was loaded)")
    return 0


def _action_names(checkpoint) -> list[str]:
    """The checkpoint's action names (its processor files), [] without a checkpoint or names."""
    from flashrt_core.lerobot.processors import read_processors

    return list(read_processors(checkpoint).action_names or []) if checkpoint else []


def run_command(args) -> int:
    try:  # before the node starts: rcl refuses such a file too, but deep inside and less clearly
        file_values, warnings = file_parameters(args.params_file, args.node_name)
    except (OSError, ValueError) as exc:
        print(f"flashrt run: --params-file: {exc}", file=sys.stderr)
        return 1
    given = {**file_values, **node_parameters(args)}
    if not given.get("checkpoint") and not given.get("contract"):  # (the node alone would serve random weights)
        print("flashrt run: no checkpoint: give --checkpoint DIR (a LeRobot pi0.5 / pi0 folder), here or as the "
              "`checkpoint` parameter of --params-file; the built-in tiny model has random weights and publishes "
              "noise: to run it on purpose give --config with its contract (config/pi05_tiny.yaml), or try "
              "`flashrt demo`", file=sys.stderr)
        return 1
    if args.dry_run:
        return dry_run(args, file_values, warnings)
    for warning in warnings:
        print(f"flashrt run: warning: {warning}", file=sys.stderr)
    from flashrt_ros.policy_node import main as node_main

    node_main(args=[sys.argv[0], *ros_arguments(args)])
    return 0
