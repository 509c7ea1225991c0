"""pi0.5 prompt: task text + discretized state -> token ids, as LeRobot 0.6.1's processors build it.

LeRobot (`Pi05PrepareStateTokenizerProcessorStep` + `TokenizerProcessorStep`): the normalized state
(in [-1, 1]) is cut into 256 bins, the task is cleaned (strip, '_' and newlines -> spaces), the text is
"Task: {task}, State: {b0 b1 ...};\\nAction: ", tokenized with BOS first (the PaliGemma tokenizer's
default), truncated to `max_length` and right-padded with the pad id.
"""
from __future__ import annotations


import numpy as np
import torch

from flashrt_core.errors import InputError

STATE_BINS = 256


def discretize_state(state) -> np.ndarray:
    """Normalized state [..., D] -> int bins in 0..255 (values below -1 give -1, as in LeRobot).

    The input keeps its dtype (LeRobot digitizes the fp32 state), because a float64 copy of a value can
    fall on the other side of a bin edge.
    """
    arr = state.detach().cpu().numpy() if isinstance(state, torch.Tensor) else np.asarray(state)
    if not np.issubdtype(arr.dtype, np.floating):
        try:
            arr = arr.astype(np.float32)
        except (TypeError, ValueError):
            raise InputError(f"state: expected numbers, got {arr.dtype} values") from None
    if not np.all(np.isfinite(arr)):
        raise InputError("state: contains NaN or infinity")
    edges = np.linspace(-1, 1, STATE_BINS + 1)[:-1]
    return np.digitize(arr, bins=edges) - 1


def clean_task(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def format_prompt(task: str, state_normalized) -> str:
    """One prompt for one robot: `state_normalized` is a 1-D vector in [-1, 1] (not padded)."""
    if not isinstance(task, str):
        raise InputError(f"task: expected a string, got {type(task).__name__}")
    if state_normalized is None:
        raise InputError("state: missing (None)")
    bins = discretize_state(state_normalized)
    if bins.ndim != 1:
        raise InputError(f"state: expected a 1-D vector, got shape {bins.shape}")
    digits = " ".join(str(int(b)) for b in bins)
    return f"Task: {clean_task(task)}, State: {digits};\nAction: "


