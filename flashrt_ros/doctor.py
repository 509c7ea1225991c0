"""`flashrt doctor`: what hardware, kernels and ROS pieces are available, and what a contract will run here.

    flashrt doctor [--config FILE] [--checkpoint DIR] [--tokenizer PATH] [--device auto]

The second part is the dry run of `flashrt run`: the contract (default: the packaged one `flashrt run` takes,
config/pi0.yaml for a pi0 checkpoint, else config/pi05.yaml) validated for this device, with the engine, dtypes, cameras,
normalization, relative actions and tokenizer it would use (nothing is loaded).
"""
from __future__ import annotations

import importlib
import os
import sys


def _try(fn):
    try:
        return True, fn()
    except Exception as exc:  # every probe reports its own failure instead of stopping the report
        return False, f"{type(exc).__name__}: {exc}"


def _ament_prefix():
    for prefix in [sys.prefix] + os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if prefix and os.path.isfile(os.path.join(prefix, "share/ament_index/resource_index/packages/flashrt_ros")):
            return prefix
    raise FileNotFoundError("share/ament_index/resource_index/packages/flashrt_ros in no prefix")


def probe() -> list[tuple[str, bool, str]]:
    rows = [("python", True, sys.version.split()[0])]
    ok, torch = _try(lambda: importlib.import_module("torch"))
    rows.append(("torch", ok, torch.__version__ if ok else torch))
    cuda = ok and torch.cuda.is_available()
    if ok:
        detail = "not available"
        if cuda:
            cap = torch.cuda.get_device_capability()
            detail = f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), CUDA {torch.version.cuda}"
        rows.append(("cuda", cuda, detail))
    ok_t, triton = _try(lambda: importlib.import_module("triton"))
    rows.append(("triton", ok_t, triton.__version__ if ok_t else triton))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    kernels = "Triton on CUDA" if (cuda and ok_t) else (
        "Triton interpreter on CPU (TRITON_INTERPRET=1; tests only, slow)" if (ok_t and interpret)
        else "plain torch references")
    rows.append(("kernel path", True, kernels))
    if ok:
        from flashrt_core.models.precision import dispatch_table

        for r in dispatch_table("cuda" if cuda else "cpu"):  # the precision presets' formats on this hardware
            rows.append((f"precision {r['format']}", r["runs"], f"{r['kernel']} ({r['why']})"))
    ok_r, rclpy = _try(lambda: importlib.import_module("rclpy"))
    rows.append(("rclpy", ok_r, getattr(rclpy, "__file__", rclpy) if ok_r else rclpy))
    ok_m, msg = _try(lambda: importlib.import_module("flashrt_ros.msg").ActionChunk)
    rows.append(("flashrt_ros interfaces", ok_m, "ActionChunk, capsule services" if ok_m else msg))
    ok_a, prefix = _try(_ament_prefix)
    rows.append(("ament index", ok_a, prefix))
    ok_c, _ = _try(lambda: importlib.import_module("cv_bridge"))
    rows.append(("cv_bridge", ok_c, "used for images" if ok_c else "absent: numpy conversion is used"))
    ok_l, _ = _try(lambda: importlib.import_module("launch_ros"))
    rows.append(("launch_ros", ok_l, "ros2 launch works" if ok_l else "absent (pip-only install): run nodes directly"))
    ok_b, bags = _try(lambda: importlib.import_module("rosbags"))
    rows.append(("rosbags", ok_b, "replay available" if ok_b else bags))
    return rows


def plan(config=None, checkpoint=None, device="auto", tokenizer=None) -> tuple[bool, str]:
    """(ok, text): what `config` with `checkpoint` will run on `device`; without a config, the packaged contract
    `flashrt run` takes for that checkpoint (pi0.yaml for a pi0 one, else pi05.yaml)."""
    from flashrt_core.contract.plan import describe_run, format_run
    from flashrt_core.models import registry
    from flashrt_ros.runtime_loader import checkpoint_contract, packaged_config

    try:
        default = registry.entry(registry.DEFAULT_KIND).contract  # (the full-size model, random weights)
        path = config or packaged_config(checkpoint_contract(checkpoint) if checkpoint else default)
        return True, format_run(describe_run(path, device=device, checkpoint=checkpoint, tokenizer=tokenizer))
    except Exception as exc:  # the reason is the report: a contract or checkpoint that would fail at configure
        return False, f"would fail at configure: {type(exc).__name__}: {exc}"


def doctor(config=None, checkpoint=None, device="auto", tokenizer=None) -> int:
    rows = probe()
    width = max(len(name) for name, _, _ in rows)
    for name, ok, detail in rows:
        print(f"{name:<{width}}  {'ok ' if ok else '-- '} {detail}")
    ok_plan, text = plan(config, checkpoint, device, tokenizer)
    if checkpoint or config:
        print("\nwhat runs (flashrt run --dry-run):")
    else:  # (flashrt run itself needs a checkpoint)
        print("\nwhat runs: no --checkpoint given, so this is config/pi05.yaml's full-size pi0.5 with random weights "
              "on this device (give --checkpoint DIR for your policy's plan, as flashrt run --dry-run shows it):")
    print("\n".join("  " + line for line in text.splitlines()))
    required = {"torch", "python"}
    return 0 if ok_plan and all(ok for name, ok, _ in rows if name in required) else 1
