"""Every model FlashRT runs, by kind: the one place that names them.

A kind is the `type` LeRobot writes into a checkpoint's config.json and the `model.name` a contract gives.
Each entry says where the model's parts live (as "module:attribute" strings, imported only when asked for,
so reading the registry loads no model):
- `package`: the model package, with `load(folder, ...)` -> a policy (`predict_chunk`, `sample_actions`);
- `config`: its config class; `binding`: its contract binding; `contract`: the packaged contract a
  checkpoint of this kind runs under (`config/<file>`);
- `lerobot`: where LeRobot 0.6.1 defines it (configuration module, config class, modeling module, policy
  class): the golden outputs and the benchmarks' baselines come from there;
- `family`: the backbone package whose checkpoint reader reads it (a kind without one reads its own).
Adding a model is one package plus one entry here; every place that picks by kind reads this table.
"""
from __future__ import annotations

import importlib
import json
import os
import pathlib
from dataclasses import dataclass

from flashrt_core.errors import CheckpointError


@dataclass(frozen=True)
class ModelEntry:
    kind: str
    title: str  # how tables and messages name it
    package: str
    config: str
    binding: str
    contract: str
    lerobot: tuple[str, str, str, str]
    family: str = ""


_ENTRIES = (
    ModelEntry("pi05", "pi0.5", "flashrt_core.models.pi05", "flashrt_core.models.pi05.config:Pi05Config",
               "flashrt_core.models.pi05.binding:Pi05Binding", "pi05.yaml",
               ("lerobot.policies.pi05.configuration_pi05", "PI05Config", "lerobot.policies.pi05.modeling_pi05",
                "PI05Policy"), family="paligemma"),
    ModelEntry("pi0", "pi0", "flashrt_core.models.pi0", "flashrt_core.models.pi0.config:Pi0Config",
               "flashrt_core.models.pi0.binding:Pi0Binding", "pi0.yaml",
               ("lerobot.policies.pi0.configuration_pi0", "PI0Config", "lerobot.policies.pi0.modeling_pi0",
                "PI0Policy"), family="paligemma"),
    ModelEntry("smolvla", "SmolVLA", "flashrt_core.models.smolvla", "flashrt_core.models.smolvla.config:SmolVLAConfig",
               "flashrt_core.models.smolvla.binding:SmolVLABinding", "smolvla.yaml",
               ("lerobot.policies.smolvla.configuration_smolvla", "SmolVLAConfig",
                "lerobot.policies.smolvla.modeling_smolvla", "SmolVLAPolicy")),
)
MODELS = {e.kind: e for e in _ENTRIES}
DEFAULT_KIND = "pi05"  # the built-in tiny model (demo, tests) and a folder whose config.json names no type
TINY_CONTRACT = "pi05_tiny.yaml"  # the contract of the built-in tiny model


class UnknownModel(CheckpointError, ValueError):
    """A kind no entry names (a CheckpointError where a folder said it, a ValueError where code did)."""


def kinds(family: str | None = None) -> tuple[str, ...]:
    return tuple(k for k, e in MODELS.items() if family is None or e.family == family)


def entry(kind: str) -> ModelEntry:
    try:
        return MODELS[kind]
    except (KeyError, TypeError):
        raise UnknownModel(f"unknown model {kind!r} (FlashRT runs {', '.join(MODELS)})") from None


def resolve(target: str):
    """The object a "module:attribute" string names."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def package(kind: str):
    return resolve(entry(kind).package)


def config_class(kind: str):
    return resolve(entry(kind).config)


def folder_kind(path: str | os.PathLike) -> str | None:
    """The kind a checkpoint folder (or a file in it) says it is: config.json's `type`, or None when the folder
    has no config.json or it names no type (a bare model.safetensors: its family's reader tells by its keys).
    An unknown type is refused by name."""
    p = pathlib.Path(path)
    cfg = (p if p.is_dir() else p.parent) / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{cfg}: not readable JSON ({exc})") from None
    kind = data.get("type") if isinstance(data, dict) else None
    if kind is None:
        return None
    entry(kind)  # (UnknownModel names the known kinds)
    return kind


def checkpoint_kind(path: str | os.PathLike) -> str:
    """The kind of a checkpoint folder: config.json's `type`; without one, what the default kind's family
    reader infers from the tensor names (pi0's state token, say)."""
    kind = folder_kind(path)
    if kind is not None:
        return kind
    family = entry(DEFAULT_KIND).family
    reader = resolve(f"flashrt_core.models.{family}.checkpoint:checkpoint_config")
    return reader(path).kind


def load(path: str | os.PathLike | None = None, **kwargs):
    """A policy for a checkpoint folder (its kind from `checkpoint_kind`), or the built-in tiny model (None)."""
    kind = DEFAULT_KIND if path in (None, "") else checkpoint_kind(path)
    return package(kind).load(path, **kwargs)
