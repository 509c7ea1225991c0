"""LeRobot 0.6.1 normalization of the robot state (pre-processor) and actions (post-processor).

pi0.5 sees its state normalized to [-1, 1] (it is discretized into the prompt) and emits actions in the same
normalized space; a real checkpoint ships the dataset statistics beside `model.safetensors` as
`policy_preprocessor_step_<i>_normalizer_processor.safetensors` (keys `observation.state.<stat>`) and
`policy_postprocessor_step_<i>_unnormalizer_processor.safetensors` (keys `action.<stat>`), with the mode per
feature type in `policy_preprocessor.json` / `policy_postprocessor.json` (`norm_map`, `eps`).

Formulas (LeRobot's, same operation order, fp32, no clipping):
  MEAN_STD    n = (x - mean) / (std + eps)          x = n * std + mean
  MIN_MAX     n = 2 (x - min) / d - 1, d = max - min (eps where 0); x = (n + 1) / 2 * d + min
  QUANTILES   as MIN_MAX with q01 / q99;  QUANTILE10 with q10 / q90
  IDENTITY    unchanged
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import torch
from safetensors import safe_open

from flashrt_core.errors import CheckpointError

STATE_KEY = "observation.state"
ACTION_KEY = "action"
DEFAULT_EPS = 1e-8
# pi0.5's defaults (PI05Config.normalization_mapping) when a stats file has no JSON config beside it
DEFAULT_MODE = "QUANTILES"
_STATS = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
          "QUANTILE10": ("q10", "q90"), "IDENTITY": ()}


@dataclasses.dataclass(frozen=True)
class FeatureNorm:
    """One feature's mode and its two statistics (lo/hi: mean/std, min/max, q01/q99 or q10/q90; fp32 1-D)."""
    mode: str = "IDENTITY"
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    eps: float = DEFAULT_EPS
    missing: str | None = None  # why the statistics this feature needs are not there (robot units refused)

    @property
    def dim(self) -> int | None:
        return None if self.lo is None else self.lo.shape[0]

    def _denom(self) -> torch.Tensor:
        # No tensor from a Python value here: on a GPU that is a blocking host-to-device copy, which would
        # break the CUDA graph the un-normalization is captured in.
        d = self.hi - self.lo
        return d.masked_fill(d == 0, self.eps)

    def _check(self) -> None:
        if self.missing is not None:
            raise CheckpointError(self.missing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check()
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            return (x - self.lo) / (self.hi + self.eps)
        return 2.0 * (x - self.lo) / self._denom() - 1.0

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        self._check()
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            return x * self.hi + self.lo
        return (x + 1.0) * self._denom() / 2.0 + self.lo

    def to(self, device) -> FeatureNorm:
        if self.lo is None:
            return self
        return dataclasses.replace(self, lo=self.lo.to(device), hi=self.hi.to(device))


@dataclasses.dataclass(frozen=True)
class Normalizer:
    """State normalization and action un-normalization; `source` says where the statistics came from
    ("identity" or the stats file paths)."""
    state: FeatureNorm = FeatureNorm()
    action: FeatureNorm = FeatureNorm()
    source: str = "identity"

    @classmethod
    def identity(cls) -> Normalizer:
        return cls()

    @property
    def missing(self) -> str | None:
        """Why robot units cannot be had from this checkpoint (statistics its config.json needs are not in the
        folder), or None. Normalized-space use (`sample_actions`) needs no statistics and still works."""
        return self.state.missing or self.action.missing

    @property
    def is_identity(self) -> bool:
        return self.state.mode == "IDENTITY" and self.action.mode == "IDENTITY"

    def normalize_state(self, x: torch.Tensor) -> torch.Tensor:
        """Robot-unit state [..., state_dim] -> normalized (what pi0.5 discretizes)."""
        return self.state.forward(x)

    def unnormalize_actions(self, a: torch.Tensor) -> torch.Tensor:
        """Model-space actions [..., D] -> robot units for the first len(stats) columns; the rest (the model's
        padding columns) pass through unchanged. Elementwise only: safe inside a CUDA graph."""
        self.action._check()
        n = self.action.dim
        if self.action.mode == "IDENTITY" or n is None:
            return a
        if n > a.shape[-1]:
            raise ValueError(f"action stats have {n} columns, actions only {a.shape[-1]}")
        head = self.action.inverse(a[..., :n])
        return head if n == a.shape[-1] else torch.cat([head, a[..., n:]], dim=-1)

    def to(self, device) -> Normalizer:
        return dataclasses.replace(self, state=self.state.to(device), action=self.action.to(device))

    @classmethod
    def from_checkpoint(cls, path, state_dim: int | None = None, action_dim: int | None = None) -> Normalizer:
        """Statistics beside `model.safetensors` (path: the folder or the weights file). No stats files: identity
        (source "identity"), unless the folder's config.json normalizes that feature (`normalization_mapping`:
        then the checkpoint is incomplete, CheckpointError). state_dim / action_dim, when given, must match the
        stats' lengths. A folder whose config.json normalizes a feature but holds no statistics for it (config.json
        + model.safetensors, as `save_pretrained` writes the policy alone) loads: that feature refuses robot
        units, by the missing file's name, where they are used (`missing`)."""
        folder = pathlib.Path(path)
        folder = folder if folder.is_dir() else folder.parent
        state, s_src = _load_feature(folder, "policy_preprocessor", "normalizer_processor", STATE_KEY, state_dim)
        action, a_src = _load_feature(folder, "policy_postprocessor", "unnormalizer_processor", ACTION_KEY,
                                      action_dim)
        sources = [s for s in (s_src, a_src) if s]
        return cls(state=state, action=action, source=", ".join(sources) if sources else "identity")


def _declared_state_file(config_file: pathlib.Path, step: str) -> str | None:
    """The `state_file` the pipeline JSON names for `step` (None without a JSON, a step entry or the field)."""
    if not config_file.is_file():
        return None
    try:
        steps = json.loads(config_file.read_text())["steps"]
        entry = next((s for s in steps if s.get("registry_name") == step), None)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{config_file}: malformed processor config ({e})") from e
    name = entry.get("state_file") if isinstance(entry, dict) else None
    if name is not None and (not isinstance(name, str) or "/" in name or "\\" in name):
        raise CheckpointError(f"{config_file}: {step}.state_file must be a file name, got {name!r}")
    return name


def _load_feature(folder: pathlib.Path, pipeline: str, step: str, key: str, dim: int | None):
    declared = _declared_state_file(folder / f"{pipeline}.json", step)
    if declared is not None and not (folder / declared).is_file():  # never silently un-normalized
        raise CheckpointError(f"{folder / (pipeline + '.json')}: {step} names its statistics file {declared}, "
                              f"which is not in {folder}")
    files = [folder / declared] if declared is not None else \
        sorted(folder.glob(f"{pipeline}_step_*_{step}.safetensors"))
    if not files:
        missing = _stats_needed(folder, pipeline, step, "STATE" if key == STATE_KEY else "ACTION")
        return (FeatureNorm() if missing is None else FeatureNorm("MISSING", missing=missing)), None
    if len(files) > 1:
        raise CheckpointError(f"{folder}: several {step} stats files ({', '.join(f.name for f in files)})")
    file = files[0]
    mode, eps = _mode(folder / f"{pipeline}.json", step, "STATE" if key == STATE_KEY else "ACTION")
    if mode not in _STATS:
        raise CheckpointError(f"{folder / (pipeline + '.json')}: norm_map mode {mode!r} unknown "
                              f"(expected: {', '.join(_STATS)})")
    if mode == "IDENTITY":
        return FeatureNorm(eps=eps), str(file)
    stats = []
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for name in _STATS[mode]:
                k = f"{key}.{name}"
                if k not in keys:
                    raise CheckpointError(f"{file}: key {k} missing ({mode} needs {' and '.join(_STATS[mode])})")
                stats.append(f.get_tensor(k).to(torch.float32))
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or non-safetensors file
        raise CheckpointError(f"{file}: unreadable stats file ({e})") from e
    for name, t in zip(_STATS[mode], stats):
        k = f"{key}.{name}"
        if t.ndim != 1:
            raise CheckpointError(f"{file}: key {k} has shape {tuple(t.shape)}, expected 1-D")
        if dim is not None and t.shape[0] != dim:
            raise CheckpointError(f"{file}: key {k} has length {t.shape[0]}, expected {dim}")
        if t.shape[0] != stats[0].shape[0]:
            raise CheckpointError(f"{file}: key {k} has length {t.shape[0]}, {key}.{_STATS[mode][0]} has "
                                  f"{stats[0].shape[0]}")
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{file}: key {k} has non-finite values")
    return FeatureNorm(mode, stats[0], stats[1], eps), str(file)


def _stats_needed(folder: pathlib.Path, pipeline: str, step: str, feature_type: str) -> str | None:
    """Why robot units are refused where the policy's config.json maps `feature_type` to a mode that needs
    statistics the folder lacks (a folder copied without its processor files would otherwise run
    un-normalized; LeRobot refuses it too), or None."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    try:
        mapping = json.loads(config_file.read_text()).get("normalization_mapping")
    except (ValueError, AttributeError):
        return None  # (config.json itself is checked, with its own message, where the model is read)
    mode = mapping.get(feature_type, "IDENTITY") if isinstance(mapping, dict) else "IDENTITY"
    if mode != "IDENTITY":
        return (f"{config_file}: normalization_mapping.{feature_type} is {mode}, but {folder} holds no "
                f"{pipeline}_step_*_{step}.safetensors with its statistics, so robot units cannot be had (actions "
                f"in normalized space, sample_actions, still work): copy the checkpoint folder whole "
                f"(save_pretrained writes {pipeline}.json and its step files beside model.safetensors)")
    return None


def _mode(config_file: pathlib.Path, step: str, feature_type: str) -> tuple[str, float]:
    """(mode, eps) of `feature_type` from the pipeline JSON's `step` entry; pi0.5 defaults without one."""
    if not config_file.is_file():
        return DEFAULT_MODE, DEFAULT_EPS
    try:
        steps = json.loads(config_file.read_text())["steps"]
        conf = next(s.get("config", {}) for s in steps if s.get("registry_name") == step)
    except StopIteration:
        return DEFAULT_MODE, DEFAULT_EPS
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{config_file}: malformed processor config ({e})") from e
    if not isinstance(conf, dict) or not isinstance(conf.get("norm_map", {}), dict):
        raise CheckpointError(f"{config_file}: {step}.config and its norm_map must be JSON objects")
    eps = conf.get("eps", DEFAULT_EPS)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise CheckpointError(f"{config_file}: {step}.eps must be a number >= 0, got {eps!r}")
    return str(conf.get("norm_map", {}).get(feature_type, "IDENTITY")), float(eps)
