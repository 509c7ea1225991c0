"""The LeRobot 0.6.1 SmolVLA golden fixtures (test/fixtures/lerobot_smolvla_*/, made by
scripts/lerobot_golden/make_smolvla_fixture.py; their README says the fields) as the model's batched inputs."""
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_cases import load_case_tensors
from flashrt_core.models.smolvla import SmolVLAConfig, convert

FOLDERS = ("lerobot_smolvla_three_cams", "lerobot_smolvla_empty_cam")
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@dataclass
class Case:
    name: str
    folder: str
    images: torch.Tensor  # [1, slots LeRobot built, 3, S, S]
    image_masks: torch.Tensor  # [1, slots]
    lang_tokens: torch.Tensor
    lang_mask: torch.Tensor
    state: torch.Tensor  # [1, max_state_dim]
    noise: torch.Tensor
    actions: torch.Tensor  # LeRobot's model.sample_actions
    tensors: dict  # every `<case>.<field>` of the file, prefix stripped

    def inputs(self):
        return self.images, self.image_masks, self.lang_tokens, self.lang_mask, self.state


def folder(name: str) -> Path:
    path = FIXTURES / name
    if not (path / "cases.safetensors").is_file():
        pytest.fail(f"SmolVLA golden fixture {path} not found (scripts/lerobot_golden/make_smolvla_fixture.py)")
    return path


_MODELS: dict = {}


def model(name: str):
    """(config, weights, cases.json, {case: Case}) of a fixture folder, loaded once per process."""
    if name not in _MODELS:
        path = folder(name)
        meta = json.loads((path / "cases.json").read_text())
        config = SmolVLAConfig.from_lerobot(json.loads((path / "checkpoint" / "config.json").read_text()),
                                            json.loads((path / "hf_vlm" / "config.json").read_text()))
        weights = convert(config, load_file(str(path / "checkpoint" / "model.safetensors")))
        raw = load_case_tensors(path / "cases.safetensors")
        cases = {}
        for rec in meta["cases"]:
            n, slots = rec["name"], rec["image_slots"]
            t = {k[len(n) + 1:]: v for k, v in raw.items() if k.startswith(n + ".")}
            cases[n] = Case(n, name, torch.stack([t[f"image.{i}"] for i in range(slots)], 1),
                            torch.stack([t[f"image_mask.{i}"] for i in range(slots)], 1).bool(),
                            t["lang_tokens"], t["lang_mask"].bool(), t["state"], t["noise"], t["actions"], t)
        _MODELS[name] = (config, weights, meta, cases)
    return _MODELS[name]


def case_ids() -> list:
    """[(folder, case)] of every fixture case, read from the cases.json files (none where a folder is missing:
    the tests that need it fail in `folder`)."""
    out = []
    for name in FOLDERS:
        meta = FIXTURES / name / "cases.json"
        out += [(name, c["name"]) for c in json.loads(meta.read_text())["cases"]] if meta.is_file() else [(name, "")]
    return out
