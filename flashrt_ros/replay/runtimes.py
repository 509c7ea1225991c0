"""Build the Runtime(s) a replay steps: the contract under test and, with --compare, a second one."""
from __future__ import annotations

from pathlib import Path

from flashrt_core.errors import FlashRTError
from flashrt_ros.replay.errors import ReplayError


def default_config() -> Path:
    from flashrt_ros.runtime_loader import packaged_config

    return packaged_config("pi05_tiny.yaml")


def build_runtime(config, *, seed: int, cameras: int, device: str = "cpu"):
    from flashrt_core import Runtime

    try:
        return Runtime.from_config(str(config), device=device, seed=seed, num_cameras=cameras)
    except FlashRTError as e:
        raise ReplayError(f"{config}: cannot build the runtime: {e}") from None
