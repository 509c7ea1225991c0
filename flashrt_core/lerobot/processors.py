"""What a LeRobot 0.6.1 pi0.5 (or pi0) checkpoint folder says happens around the model: its processors.

`policy.save_pretrained()` + the processors' `save_pretrained()` write `config.json` (features with shapes,
the camera features in order, `use_relative_actions`, `action_feature_names`, ...), `policy_preprocessor.json`
and `policy_postprocessor.json` (the steps by registry name, with their configs) and the statistics files of
the (un)normalizer steps. `read_processors(folder)` turns them into one `Processors` value; a step this
project does not implement is refused with its registry name, never skipped.

The whole pipeline, as LeRobot runs it for pi0.5:
  pre:  rename -> batch -> relative actions (caches the raw state) -> normalize (state) -> prompt with the
        discretized state -> tokenize (BOS, right padding to max_length) -> device
  post: unnormalize (actions) -> absolute actions (+ the cached raw state on the masked columns) -> cpu
A folder without processor files (the project's own saved models) gets pi0.5's defaults.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

from flashrt_core.errors import CheckpointError
from flashrt_core.lerobot.hub_tokenizer import PALIGEMMA_TOKENIZER
from flashrt_core.lerobot.normalize import Normalizer

PRE_FILE, POST_FILE, CONFIG_FILE = "policy_preprocessor.json", "policy_postprocessor.json", "config.json"
STATE_FEATURE, ACTION_FEATURE = "observation.state", "action"
# Steps implemented here (registry name -> what it does, for messages).
PRE_STEPS = {"rename_observations_processor", "to_batch_processor", "relative_actions_processor",
             "normalizer_processor", "pi05_prepare_state_tokenizer_processor_step", "tokenizer_processor",
             "device_processor", "pi0_new_line_processor", "smolvla_new_line_processor"}
POST_STEPS = {"unnormalizer_processor", "absolute_actions_processor", "device_processor"}


@dataclasses.dataclass(frozen=True)
class Processors:
    """The checkpoint's pre/post-processing, as data.

    camera_names: the VISUAL input features in the model's slot order; state_dim / action_dim: the robot's
    widths (None when the folder does not say); action_names: names of the action columns (or None);
    relative_mask: per action column, whether the observation's raw state is added back (None: absolute
    actions); normalizer: state normalization and action un-normalization."""
    camera_names: tuple[str, ...]
    state_dim: int | None
    action_dim: int | None
    action_names: tuple[str, ...] | None
    relative_mask: tuple[bool, ...] | None
    tokenizer_name: str | None  # None: the pre-processor names none (not a LeRobot-saved pi0.5 folder)
    tokenizer_max_length: int | None
    normalizer: Normalizer
    source: str
    exclude_joints: tuple[str, ...] = ()  # LeRobot's relative_exclude_joints (names matched as substrings)
    notes: tuple[str, ...] = ()  # what the folder says twice and differently (the node and the plan warn of it)

    @property
    def relative(self) -> bool:
        return self.relative_mask is not None and any(self.relative_mask)

    def describe_relative(self) -> str:
        if not self.relative:
            return "off"
        unmatched = [x for x in self.exclude_joints
                     if self.action_names and not any(str(x).lower() in n.lower() for n in self.action_names)]
        note = f"; excluded {', '.join(unmatched)} matches no action name" if unmatched else ""
        absolute = [self._col(i) for i, m in enumerate(self.relative_mask) if not m]
        return ("on, columns " + ", ".join(self._col(i) for i, m in enumerate(self.relative_mask) if m)
                + " (absolute: " + (", ".join(absolute) or "none") + note + ")")

    def describe(self) -> str:
        n = self.normalizer
        rel = self.describe_relative()
        return (f"cameras (slot order): {', '.join(self.camera_names) or '-'}; state {self.state_dim}, "
                f"actions {self.action_dim}" + (f" ({', '.join(self.action_names)})" if self.action_names else "")
                + f"; normalization state {n.state.mode}, action {n.action.mode}; relative actions {rel}; "
                f"tokenizer {self.tokenizer_name or '-'}, max length {self.tokenizer_max_length}")

    def _col(self, i: int) -> str:
        return self.action_names[i] if self.action_names and i < len(self.action_names) else str(i)


def _json(path: pathlib.Path):
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _steps(path: pathlib.Path, known: set[str]) -> dict[str, dict]:
    """registry name -> config of each step of a processor file; unknown steps refused by name."""
    doc = _json(path)
    if doc is None:
        return {}
    steps = doc.get("steps")
    if not isinstance(steps, list):
        raise CheckpointError(f"{path}: 'steps' must be a list")
    out: dict[str, dict] = {}
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise CheckpointError(f"{path}: steps[{i}] must be an object")
        name = step.get("registry_name") or step.get("class")
        if name not in known:
            raise CheckpointError(f"{path}: steps[{i}] {name!r} is a processor step FlashRT does not implement "
                                  f"(implemented: {', '.join(sorted(known))}); refusing the checkpoint rather "
                                  "than skipping it")
        conf = step.get("config", {})
        if not isinstance(conf, dict):
            raise CheckpointError(f"{path}: steps[{i}] ({name}).config must be an object")
        if name in out and name != "device_processor":
            raise CheckpointError(f"{path}: step {name} appears twice")
        out[name] = conf
    return out


def _shape0(features: dict, key: str, path: pathlib.Path) -> int | None:
    f = features.get(key)
    if f is None:
        return None
    shape = f.get("shape") if isinstance(f, dict) else None
    if not isinstance(shape, list) or len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
        raise CheckpointError(f"{path}: feature {key}.shape must be [n], got {shape!r}")
    return shape[0]


def relative_mask(action_dim: int, exclude: list, names) -> tuple[bool, ...]:
    """Columns converted relative <-> absolute: all but those whose name contains an excluded joint name
    (case-insensitive; LeRobot's rule, so "gripper" also excludes "left_gripper"). Without names: all."""
    tokens = [str(x).lower() for x in exclude or [] if x]
    if not tokens or names is None:
        return (True,) * action_dim
    mask = [not any(t in str(n).lower() for t in tokens) for n in list(names)[:action_dim]]
    return tuple(mask + [True] * (action_dim - len(mask)))


def read_processors(folder) -> Processors:
    """The processors of a checkpoint folder (see the module docstring); CheckpointError on anything malformed
    or not implemented."""
    folder = pathlib.Path(folder)
    folder = folder if folder.is_dir() else folder.parent
    cfg_path = folder / CONFIG_FILE
    cfg = _json(cfg_path) or {}
    inputs = cfg.get("input_features") or {}
    outputs = cfg.get("output_features") or {}
    if not isinstance(inputs, dict) or not isinstance(outputs, dict):
        raise CheckpointError(f"{cfg_path}: input_features / output_features must be objects")
    cameras = tuple(k for k, f in inputs.items() if isinstance(f, dict) and f.get("type") == "VISUAL")
    state_dim = _shape0(inputs, STATE_FEATURE, cfg_path)
    action_dim = _shape0(outputs, ACTION_FEATURE, cfg_path)
    pre = _steps(folder / PRE_FILE, PRE_STEPS)
    post = _steps(folder / POST_FILE, POST_STEPS)

    rename = pre.get("rename_observations_processor", {}).get("rename_map") or {}
    if rename:
        raise CheckpointError(f"{folder / PRE_FILE}: rename_observations_processor renames {sorted(rename)}; "
                              "FlashRT maps cameras by the feature names in config.json: rename them there")

    rel_conf = pre.get("relative_actions_processor")
    enabled = bool(rel_conf.get("enabled")) if rel_conf is not None else bool(cfg.get("use_relative_actions"))
    notes = []
    if rel_conf is not None and "use_relative_actions" in cfg and bool(cfg["use_relative_actions"]) != enabled:
        # LeRobot runs the saved processor steps whatever config.json's flag says: so does FlashRT, and says so
        notes.append(f"{cfg_path}: use_relative_actions is {bool(cfg['use_relative_actions'])}, but "
                     f"{PRE_FILE}'s relative_actions_processor is {'enabled' if enabled else 'disabled'}: the "
                     f"processor step decides, as in LeRobot (relative actions {'on' if enabled else 'off'})")
    if post and bool(post.get("absolute_actions_processor", {}).get("enabled", False)) != enabled:
        raise CheckpointError(f"{folder}: relative_actions_processor (enabled={enabled}) and "
                              "absolute_actions_processor disagree; the actions would be in the wrong frame")
    names = (rel_conf or {}).get("action_names", cfg.get("action_feature_names"))
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise CheckpointError(f"{folder}: action_feature_names must be a list of strings, got {names!r}")
    if names is not None and action_dim is not None and len(names) != action_dim:
        raise CheckpointError(f"{folder}: {len(names)} action names ({', '.join(names)}) for {action_dim} action "
                              "columns: the chunk's columns and the relative-action mask would be mislabelled")
    exclude = (rel_conf or {}).get("exclude_joints", cfg.get("relative_exclude_joints", []))
    mask = None
    if enabled:
        if action_dim is None:
            raise CheckpointError(f"{cfg_path}: relative actions need output_features.action.shape")
        if state_dim is not None and state_dim < action_dim:
            raise CheckpointError(f"{cfg_path}: relative actions add the state to the actions, but the state has "
                                  f"{state_dim} values and the actions {action_dim}")
        mask = relative_mask(action_dim, exclude, names)

    tok = pre.get("tokenizer_processor", {})
    # ("longest" and "max_length" give the same actions: pads are masked and positions count valid tokens only)
    if tok.get("padding_side", "right") != "right" or tok.get("padding", "max_length") not in ("max_length", "longest"):
        raise CheckpointError(f"{folder / PRE_FILE}: tokenizer_processor pads {tok.get('padding')!r} on the "
                              f"{tok.get('padding_side')!r}; FlashRT implements max_length padding on the right")
    max_len = tok.get("max_length", cfg.get("tokenizer_max_length"))
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise CheckpointError(f"{folder}: tokenizer max_length must be a positive integer, got {max_len!r}")
    normalizer = Normalizer.from_checkpoint(folder, state_dim, action_dim)
    return Processors(camera_names=cameras, state_dim=state_dim, action_dim=action_dim,
                      action_names=tuple(names) if names else None, relative_mask=mask,
                      tokenizer_name=(str(tok.get("tokenizer_name") or PALIGEMMA_TOKENIZER)
                                      if "tokenizer_processor" in pre else None),
                      tokenizer_max_length=max_len, normalizer=normalizer, source=str(folder),
                      exclude_joints=tuple(str(x) for x in exclude or []) if enabled else (), notes=tuple(notes))
