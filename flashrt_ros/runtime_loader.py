"""Build the node's Runtime from its parameters: the contract file, rate and staleness overrides."""
from __future__ import annotations

import os
import sys
from pathlib import Path

def _tiny_contract() -> str:
    """Without a checkpoint: the built-in tiny model's contract (demo, tests)."""
    from flashrt_core.models import registry

    return registry.TINY_CONTRACT


def packaged_config(name: str) -> Path:
    """A config file shipped with the package: installed share/flashrt_ros/config, or the checkout's config/."""
    candidates = [Path(p) / "share" / "flashrt_ros" / "config" / name
                  for p in [sys.prefix] + os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p]
    candidates.append(Path(__file__).resolve().parents[1] / "config" / name)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"packaged config '{name}' not found in: {', '.join(map(str, candidates))}")


def checkpoint_contract(checkpoint: str) -> str:
    """The packaged contract for a checkpoint: its model's (`registry`, by config.json's "type"); a folder that
    cannot be read gets the default model's, and the runtime reports what is wrong with it."""
    from flashrt_core.errors import CheckpointError
    from flashrt_core.models import registry

    try:
        kind = registry.checkpoint_kind(checkpoint)
    except (CheckpointError, OSError):
        kind = registry.DEFAULT_KIND
    return registry.entry(kind).contract


def default_contract(checkpoint: str | None = None) -> Path:
    """The packaged contract a node takes without a `contract` parameter: the checkpoint model's (pi05.yaml /
    pi0.yaml), else the built-in tiny model's."""
    return packaged_config(checkpoint_contract(checkpoint) if checkpoint else _tiny_contract())


def names_checkpoint(contract) -> bool:
    """Whether a contract YAML names its own model.checkpoint (a file that cannot be read: False; loading it
    says what is wrong)."""
    import yaml

    try:
        data = yaml.safe_load(Path(contract).read_text())
        return bool(((data or {}).get("model") or {}).get("checkpoint"))
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return False


def model_widths(joint_names, action_dim: int = 0, checkpoint: bool = False, state_from_joints: bool = True) -> dict:
    """The model options the robot's joints set: they decide the state width (a checkpoint's config.json must
    agree; not with a Float64MultiArray state: state_from_joints=False), and the action width where no
    checkpoint gives it. No joints named: the contract's or checkpoint's widths."""
    n = len(joint_names)
    widths = {"state_dim": n if state_from_joints else 0, "action_dim": action_dim or (0 if checkpoint else n)}
    return {k: v for k, v in widths.items() if v > 0}


def runtime_arguments(p, n_cameras: int) -> dict:
    """`Runtime.from_config` arguments (all but device and seed) for the node parameters `p`."""
    contract = p.contract or str(default_contract(p.checkpoint or None))
    rates = {stage: hz for stage, hz in (("observe", p.observe_rate_hz), ("act", p.act_rate_hz)) if hz > 0}
    options = {k: v for k, v in (("image_height", p.image_height), ("image_width", p.image_width)) if v > 0}
    options.update(model_widths(p.joint_names, p.action_dim, bool(p.checkpoint) or names_checkpoint(contract),
                                state_from_joints=not p.state_topic))
    if p.engine != "auto":
        options["engine"] = p.engine
    if p.precision:
        options["precision"] = p.precision
    if p.rtc:  # the robot executes one action per action_dt
        options["rtc"] = {"execution_horizon": p.rtc_execution_horizon, "max_guidance_weight": p.rtc_max_guidance_weight,
                          "schedule": p.rtc_schedule,
                          "inference_delay": "auto" if p.rtc_inference_delay < 0 else p.rtc_inference_delay,
                          "action_rate_hz": 1.0 / p.action_dt}
    return dict(path=contract, checkpoint=p.checkpoint or None, dtype=p.dtype or None, tokenizer=p.tokenizer or None,
                rates=rates or None, max_observation_age_ms=p.max_observation_age_ms or None, num_cameras=n_cameras,
                options=options or None)


def load_runtime(p, n_cameras: int):
    """A configured Runtime for the node parameters `p` (flashrt_ros.params.NodeParams)."""
    from flashrt_core import Runtime

    import torch

    device = p.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if p.cpu_threads > 0:
        torch.set_num_threads(p.cpu_threads)  # the node owns its process: a process-wide choice is fine here
    runtime = Runtime.from_config(device=device, seed=p.seed, **runtime_arguments(p, n_cameras))
    # Stage timers fire with jitter around a phase of their own: a tenth of the fastest period is on time.
    runtime.set_timer_slack(0.1 * 1e3 / max(runtime.stage_rates().values()))
    runtime.warmup()  # capture graphs now, at configure time, not at the first tick
    return runtime


def action_names(runtime) -> list[str]:
    """The checkpoint's action column names (config.json action_feature_names), or [] when it has none."""
    return _processor_names(runtime, "action_names")


def runtime_camera_names(runtime) -> list[str]:
    """The checkpoint's camera features (config.json input_features order), or [] without a checkpoint."""
    return _processor_names(runtime, "camera_names")


def _processor_names(runtime, field: str) -> list[str]:
    procs = getattr(runtime.binding, "processors", None)
    return list(getattr(procs, field) or []) if procs is not None else []
