"""Declared parameters of policy_node, with descriptors and validation (defaults: config/policy_node.yaml)."""
from __future__ import annotations

from dataclasses import dataclass

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType

# name: (default, type, description, range)
PARAMETERS = {
    "contract": ("", ParameterType.PARAMETER_STRING,
                 "execution contract YAML; empty = the packaged one of the checkpoint's model (config/pi05.yaml "
                 "or config/pi0.yaml), config/pi05_tiny.yaml without a checkpoint", None),
    "checkpoint": ("", ParameterType.PARAMETER_STRING,
                   "LeRobot pi0 or pi0.5 checkpoint folder as save_pretrained writes it (config.json, "
                   "model.safetensors, processor files); empty = the contract's model (built-in tiny)", None),
    "device": ("auto", ParameterType.PARAMETER_STRING, "cpu | cuda | cuda:N | auto (cuda when available)", None),
    "dtype": ("", ParameterType.PARAMETER_STRING,
              "float32 | bfloat16 | float16; empty = the contract's (config/pi05.yaml: auto, bfloat16 on CUDA)", None),
    "engine": ("auto", ParameterType.PARAMETER_STRING,
               "auto | fused | reference; auto = the contract's choice (default: fused on CUDA, reference on CPU)",
               None),
    "precision": ("", ParameterType.PARAMETER_STRING,
                  "bf16 | fp8 (the prefix's GEMMs in fp8) | w4a16 (the action expert's weights in 4 bits) | "
                  "fp8+w4a16 | fp8+mxfp4 (the expert in MXFP4, sm_100+), checked at load against the unquantized "
                  "model; empty = the contract's "
                  "model.options.precision (default bf16)", None),
    "tokenizer": ("", ParameterType.PARAMETER_STRING,
                  "tokenizer.json / tokenizer.model file or folder; empty = the tokenizer the checkpoint names, "
                  "from the Hugging Face hub cache (offline)", None),
    "seed": (0, ParameterType.PARAMETER_INTEGER, "seed of the flow-matching noise generator", None),
    "camera_topics": (["camera0/image_raw"], ParameterType.PARAMETER_STRING_ARRAY,
                      "one topic per camera feature of the checkpoint, in the order of its config.json "
                      "input_features (observation.images.*; fewer topics = the last features missing); a topic "
                      "ending in /compressed subscribes to sensor_msgs/CompressedImage", None),
    "joint_state_topic": ("joint_states", ParameterType.PARAMETER_STRING, "sensor_msgs/JointState topic", None),
    "joint_names": ([""], ParameterType.PARAMETER_STRING_ARRAY,
                    "joints in the model's state order; [''] = take JointState order as is", None),
    "state_topic": ("", ParameterType.PARAMETER_STRING,
                    "std_msgs/Float64MultiArray topic carrying the robot state (e.g. an end-effector pose) in "
                    "the checkpoint's observation.state order; empty = the state comes from joint_state_topic",
                    None),
    "prompt": ("", ParameterType.PARAMETER_STRING, "initial task prompt (also settable on ~/prompt)", None),
    "observe_rate_hz": (0.0, ParameterType.PARAMETER_DOUBLE,
                        "rate of the observe stage; 0 = the contract's", FloatingPointRange(from_value=0.0, to_value=1000.0)),
    "act_rate_hz": (0.0, ParameterType.PARAMETER_DOUBLE,
                    "rate of the act stage; 0 = the contract's", FloatingPointRange(from_value=0.0, to_value=1000.0)),
    "max_observation_age_ms": (0.0, ParameterType.PARAMETER_DOUBLE,
                               "refuse to publish actions from older observations; 0 = the contract's",
                               FloatingPointRange(from_value=0.0, to_value=600000.0)),
    "image_height": (0, ParameterType.PARAMETER_INTEGER,
                     "height frames are fitted to (letterboxed, aspect kept); 0 = the contract's",
                     IntegerRange(from_value=0, to_value=8192)),
    "image_width": (0, ParameterType.PARAMETER_INTEGER,
                    "width frames are fitted to (letterboxed, aspect kept); 0 = the contract's",
                    IntegerRange(from_value=0, to_value=8192)),
    "camera_pixel_budget_mpx_s": (16.0, ParameterType.PARAMETER_DOUBLE,
                                  "megapixels each camera may have decoded and fitted per second: a frame over what "
                                  "is left is refused before decoding, naming the camera (16 = a 4K frame twice a "
                                  "second, 720p at 17 Hz; a larger frame is never taken); 0 = no budget",
                                  FloatingPointRange(from_value=0.0, to_value=1000.0)),
    "action_dt": (0.02, ParameterType.PARAMETER_DOUBLE, "seconds between two actions of a chunk",
                  FloatingPointRange(from_value=1e-4, to_value=10.0)),
    "action_dim": (0, ParameterType.PARAMETER_INTEGER,
                   "action columns to publish; 0 = the checkpoint's action width (without one: len(joint_names))",
                   IntegerRange(from_value=0, to_value=1024)),
    "rtc": (False, ParameterType.PARAMETER_BOOL,
            "real-time chunking in the act stage (LeRobot's RTC: each chunk guided towards the rest of the previous "
            "one, the robot taken to execute one action per action_dt); false = the contract's model.options.rtc",
            None),
    "rtc_execution_horizon": (10, ParameterType.PARAMETER_INTEGER,
                              "RTC: actions of the previous chunk that guide the next", IntegerRange(from_value=1,
                                                                                                    to_value=1024)),
    "rtc_max_guidance_weight": (10.0, ParameterType.PARAMETER_DOUBLE, "RTC: the guidance weight's clip",
                                FloatingPointRange(from_value=1e-3, to_value=1e3)),
    "rtc_schedule": ("linear", ParameterType.PARAMETER_STRING,
                     "RTC prefix weights past the delay: linear | exp | zeros | ones", None),
    "rtc_inference_delay": (-1, ParameterType.PARAMETER_INTEGER,
                            "RTC: actions executed while a chunk is computed; -1 = measured (the act stage's "
                            "latency / action_dt, rounded up)", IntegerRange(from_value=-1, to_value=1024)),
    "publish_joint_trajectory": (False, ParameterType.PARAMETER_BOOL,
                                 "also publish ~/joint_trajectory (trajectory_msgs/JointTrajectory)", None),
    "cpu_threads": (0, ParameterType.PARAMETER_INTEGER,
                    "torch intra-op threads on CPU; 0 = torch's default (1 is best for the tiny model)",
                    IntegerRange(from_value=0, to_value=256)),
    "autostart": (False, ParameterType.PARAMETER_BOOL, "configure and activate at start-up", None),
    "exit_on_failure": (False, ParameterType.PARAMETER_BOOL,
                        "with autostart: end the process (status 1) when configure or activate fails, instead of "
                        "staying unconfigured for a lifecycle manager (flashrt run sets it)", None),
    "diagnostics_period_s": (1.0, ParameterType.PARAMETER_DOUBLE, "period of /diagnostics",
                             FloatingPointRange(from_value=0.05, to_value=60.0)),
}


@dataclass
class NodeParams:
    contract: str
    checkpoint: str
    device: str
    dtype: str
    engine: str
    precision: str
    tokenizer: str
    seed: int
    camera_topics: list
    joint_state_topic: str
    joint_names: list
    state_topic: str
    prompt: str
    observe_rate_hz: float
    act_rate_hz: float
    max_observation_age_ms: float
    image_height: int
    image_width: int
    camera_pixel_budget_mpx_s: float
    action_dt: float
    action_dim: int
    rtc: bool
    rtc_execution_horizon: int
    rtc_max_guidance_weight: float
    rtc_schedule: str
    rtc_inference_delay: int
    publish_joint_trajectory: bool
    cpu_threads: int
    autostart: bool
    exit_on_failure: bool
    diagnostics_period_s: float


def declare(node) -> dict[str, str]:
    """Declare every parameter with its descriptor (`declare_one`); -> {name: why its override was not taken}."""
    errors = {}
    for name, (default, ptype, description, value_range) in PARAMETERS.items():
        descriptor = ParameterDescriptor(name=name, type=ptype, description=description)
        if isinstance(value_range, FloatingPointRange):
            descriptor.floating_point_range = [value_range]
        elif isinstance(value_range, IntegerRange):
            descriptor.integer_range = [value_range]
        errors.update(declare_one(node, name, default, descriptor))
    return errors


def declare_one(node, name: str, default, descriptor: ParameterDescriptor) -> dict[str, str]:
    """Declare a parameter, taking the override a params file or `-p` gives. An integer for a double is taken as
    that number (`act_rate_hz: 10`); an override of another type, or out of range, is not taken: the parameter
    keeps its default and the returned list says why (the node's configure then fails with it, instead of the
    node dying at start with rclpy's traceback)."""
    from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException

    given = overrides_of(node).get(name)
    if descriptor.type == ParameterType.PARAMETER_DOUBLE and type(given) is int:
        try:
            node.declare_parameter(name, float(given), descriptor, ignore_override=True)
            return {}
        except InvalidParameterValueException:
            pass  # (out of range: reported below, as any other refused override)
    try:
        node.declare_parameter(name, default, descriptor)
        return {}
    except (InvalidParameterTypeException, InvalidParameterValueException):
        node.declare_parameter(name, default, descriptor, ignore_override=True)
    ranges = list(descriptor.floating_point_range) + list(descriptor.integer_range)
    expected = f"of type {ptype_name(descriptor.type)}" + \
        (f" in [{ranges[0].from_value}, {ranges[0].to_value}]" if ranges else "")
    return {name: f"parameter '{name}' must be {expected}, got {given!r} (from the params file or -p; not taken)"}


def overrides_of(node) -> dict:
    """{name: value} of the parameter overrides rcl gave the node (params files, `-p`): rclpy keeps them on the
    node until a parameter of that name is declared; it has no public accessor."""
    return {name: p.value for name, p in getattr(node, "_parameter_overrides", {}).items()}


def validate_one(name: str, v) -> None:
    """ValueError where `v` is not of the declared type or outside the declared range of parameter `name`."""
    _default, ptype, _doc, value_range = PARAMETERS[name]
    kinds = _TYPES[ptype]
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise ValueError(f"parameter '{name}' must be of type {ptype_name(ptype)}, got {v!r}")
    if ptype == ParameterType.PARAMETER_STRING_ARRAY and not all(isinstance(x, str) for x in v):
        raise ValueError(f"parameter '{name}' must be a list of strings, got {v!r}")
    if value_range is not None and not value_range.from_value <= v <= value_range.to_value:
        raise ValueError(f"parameter '{name}' must lie in [{value_range.from_value}, {value_range.to_value}], got {v}")


def read(node) -> NodeParams:
    """Current values, validated; raises ValueError naming the parameter."""
    return validate({name: node.get_parameter(name).value for name in PARAMETERS})


_TYPES = {ParameterType.PARAMETER_STRING: (str,), ParameterType.PARAMETER_INTEGER: (int,),
          ParameterType.PARAMETER_DOUBLE: (float,), ParameterType.PARAMETER_BOOL: (bool,),
          ParameterType.PARAMETER_STRING_ARRAY: (list, tuple)}


def validate(values: dict) -> NodeParams:
    """Parameter values (the node's, or a params file's and flags' for `flashrt run --dry-run`) -> NodeParams,
    checked as the node checks them: types and ranges of the declarations, topic names, lists without
    repeats, device / engine / dtype names. Raises ValueError naming the parameter."""
    from rclpy.validate_topic_name import validate_topic_name

    values = dict(values)
    for name, (_default, ptype, _doc, _range) in PARAMETERS.items():
        if ptype == ParameterType.PARAMETER_DOUBLE and type(values[name]) is int:
            values[name] = float(values[name])  # (as the node declares it: `act_rate_hz: 10` is 10.0)
        validate_one(name, values[name])
    values["joint_names"] = [n for n in values["joint_names"] if n]
    cameras = [t for t in values["camera_topics"] if t]
    if not cameras:
        raise ValueError("parameter 'camera_topics' must name at least one camera topic")
    if len(set(cameras)) != len(cameras):
        raise ValueError(f"parameter 'camera_topics' lists a topic twice: {cameras}")
    values["camera_topics"] = cameras
    for name in ("camera_topics", "joint_state_topic", "state_topic"):
        for topic in (values[name] if isinstance(values[name], list) else [values[name]]):
            if topic:
                try:
                    validate_topic_name(topic)
                except Exception as exc:  # rclpy's InvalidTopicNameException, with a caret under the fault
                    raise ValueError(f"parameter '{name}': {exc}") from None
    if len(set(values["joint_names"])) != len(values["joint_names"]):
        raise ValueError(f"parameter 'joint_names' lists a joint twice: {values['joint_names']}")
    device = values["device"]
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"parameter 'device' must be cpu, cuda, cuda:N or auto, not '{device}'")
    if values["engine"] not in ("auto", "fused", "reference"):
        raise ValueError(f"parameter 'engine' must be auto, fused or reference, not '{values['engine']}'")
    from flashrt_core.models.precision import PRESETS

    if values["precision"] not in ("",) + tuple(PRESETS):
        raise ValueError(f"parameter 'precision' must be empty or one of {', '.join(PRESETS)}, not "
                         f"'{values['precision']}'")
    if values["rtc"] and values["action_dt"] < 1e-3:
        raise ValueError(f"parameter 'action_dt' must be at least 0.001 s with rtc (the robot's action rate is "
                         f"1 / action_dt, at most 1000 Hz), got {values['action_dt']}")
    if values["rtc_schedule"] not in ("linear", "exp", "zeros", "ones"):
        raise ValueError(f"parameter 'rtc_schedule' must be linear, exp, zeros or ones, not '{values['rtc_schedule']}'")
    if values["dtype"] not in ("", "float32", "bfloat16", "float16"):
        raise ValueError(f"parameter 'dtype' must be float32, bfloat16 or float16, not '{values['dtype']}'")
    return NodeParams(**{k: values[k] for k in NodeParams.__dataclass_fields__})


def ptype_name(ptype) -> str:
    return {ParameterType.PARAMETER_STRING: "string", ParameterType.PARAMETER_INTEGER: "integer",
            ParameterType.PARAMETER_DOUBLE: "double", ParameterType.PARAMETER_BOOL: "bool",
            ParameterType.PARAMETER_STRING_ARRAY: "string array", ParameterType.PARAMETER_BYTE_ARRAY: "byte array",
            ParameterType.PARAMETER_BOOL_ARRAY: "bool array", ParameterType.PARAMETER_INTEGER_ARRAY: "integer array",
            ParameterType.PARAMETER_DOUBLE_ARRAY: "double array"}.get(ptype, str(ptype))


def type_error_reason(name: str, value, declared: int) -> str:
    """rclpy's refusal of a value of another type says type codes ("Wrong parameter type, expected '3' got '4'"):
    the same, in words."""
    from rclpy.parameter import Parameter

    given = ptype_name(Parameter.Type.from_parameter_value(value).value) if value is not None else "nothing"
    # (the prefix is rclpy's: its declare path tells a type error by it)
    return f"Wrong parameter type: '{name}' must be of type {ptype_name(declared)}, got {given} {value!r}"
