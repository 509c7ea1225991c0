"""Build the Runtime(s) a replay steps: the contract under test and, with --compare, a second one."""
from __future__ import annotations

from pathlib import Path

from flashrt_core.errors import FlashRTError
from flashrt_ros.replay.errors import ReplayError


def default_config(checkpoint: str | None = None) -> Path:
    """The packaged contract a node takes (`runtime_loader.default_contract`)."""
    from flashrt_ros.runtime_loader import default_contract

    return default_contract(checkpoint)


def build_runtime(config, *, seed: int, cameras: int, device: str = "cpu", checkpoint: str | None = None,
                  joint_names=(), tokenizer: str | None = None):
    """The runtime a policy node builds from the same contract, checkpoint, cameras and joint_names (the joints
    set the state width, and the action width without a checkpoint: `runtime_loader.model_widths`)."""
    from flashrt_core import Runtime
    from flashrt_ros.runtime_loader import model_widths, names_checkpoint

    widths = model_widths(joint_names, checkpoint=bool(checkpoint) or names_checkpoint(config))
    try:
        return Runtime.from_config(str(config), device=device, seed=seed, num_cameras=cameras,
                                   checkpoint=checkpoint, tokenizer=tokenizer, options=widths or None)
    except FlashRTError as e:
        raise ReplayError(f"{config}: cannot build the runtime: {e}") from None
