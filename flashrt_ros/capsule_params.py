"""The policy node's capsule parameters: budgets per tier, eviction, the capsule folder (read at configure).

Declared by the capsule services (so they live beside what uses them); the defaults are the engine's
(flashrt_core.capsule.options: 1024 / 2048 / 10240 MB, why there), also in config/policy_node.yaml.
"""
from __future__ import annotations

from dataclasses import dataclass

from rcl_interfaces.msg import IntegerRange, ParameterDescriptor, ParameterType

from flashrt_core.capsule.options import DEFAULT_BUDGET_MB, EVICTIONS
from flashrt_ros.params import declare_one

BUDGET_PREFIX = "capsule_budget_mb."
MAX_BUDGET_MB = 1 << 30  # (1 PB: the range only keeps a typo's sign or size out)

# name: (default, type, description)
PARAMETERS = {
    **{BUDGET_PREFIX + tier: (mb, ParameterType.PARAMETER_INTEGER,
                              f"MB (2**20 bytes) the {tier} tier's capsules may hold; a snapshot past it is refused "
                              "(or makes room, see capsule_eviction); 0 = no capsules in this tier")
       for tier, mb in DEFAULT_BUDGET_MB.items()},
    "capsule_eviction": ("none", ParameterType.PARAMETER_STRING,
                         "when a tier is full: none = refuse the new capsule; oldest = drop that tier's oldest "
                         "capsules to make room (the service reply names them)"),
    "capsule_dir": ("", ParameterType.PARAMETER_STRING,
                    "folder of the disk tier, kept across restarts: the capsules found there at configure are "
                    "listed again; empty = a temporary folder removed at cleanup. ~/export_capsule and "
                    "~/import_capsule paths are taken relative to it and confined to it (and capsule_io_dirs)"),
    "capsule_io_dirs": ([""], ParameterType.PARAMETER_STRING_ARRAY,
                        "more folders ~/export_capsule may write into and ~/import_capsule read from (absolute "
                        "paths); any other path is refused, as any peer on the ROS domain may call them"),
}


@dataclass
class CapsuleParams:
    budget_mb: dict
    eviction: str
    capsule_dir: str
    io_dirs: list


def declare(node) -> dict[str, str]:
    """Declare the capsule parameters; -> {name: why its override was not taken} (`params.declare_one`)."""
    errors = {}
    for name, (default, ptype, description) in PARAMETERS.items():
        descriptor = ParameterDescriptor(name=name, type=ptype, description=description)
        if ptype == ParameterType.PARAMETER_INTEGER:
            descriptor.integer_range = [IntegerRange(from_value=0, to_value=MAX_BUDGET_MB)]
        errors.update(declare_one(node, name, default, descriptor))
    return errors


def read(node) -> CapsuleParams:
    """Current values, checked; raises ValueError naming the parameter."""
    eviction = node.get_parameter("capsule_eviction").value
    if eviction not in EVICTIONS:
        raise ValueError(f"parameter 'capsule_eviction' must be one of {', '.join(EVICTIONS)}, not '{eviction}'")
    budget = {tier: int(node.get_parameter(BUDGET_PREFIX + tier).value) for tier in DEFAULT_BUDGET_MB}
    io_dirs = [d for d in node.get_parameter("capsule_io_dirs").value if d]
    relative = [d for d in io_dirs if not d.startswith(("/", "~"))]
    if relative:
        raise ValueError(f"parameter 'capsule_io_dirs' must list absolute folders, not {relative}")
    return CapsuleParams(budget, eviction, node.get_parameter("capsule_dir").value, io_dirs)
