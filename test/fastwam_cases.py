"""The LeRobot 0.6.1 FastWAM golden fixture (test/fixtures/lerobot_fastwam_tiny/, made by
scripts/lerobot_golden/make_fastwam_fixture.py; cases.json lists the fields) as the model's inputs."""
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_cases import load_case_tensors
from flashrt_core.models.fastwam import FastWAMConfig, convert

FOLDER = Path(__file__).resolve().parent / "fixtures" / "lerobot_fastwam_tiny"


@dataclass
class Case:
    name: str
    first_frame_latents: torch.Tensor  # [1, 48, 1, h, w]: LeRobot's VAE encode of input_image
    text_emb: torch.Tensor  # [1, tokenizer_max_len, text_dim]: encode_prompt (padding rows zeroed)
    state: torch.Tensor  # [1, proprio_dim], normalized (LeRobot's preprocessor)
    noise: torch.Tensor  # [1, horizon, action_dim]
    actions: torch.Tensor  # [1, horizon, action_dim]: model.infer_action
    tensors: dict  # every `<case>.<field>` of the file, prefix stripped

    def inputs(self):
        return self.first_frame_latents, self.text_emb, self.state


def folder() -> Path:
    if not (FOLDER / "cases.safetensors").is_file():
        pytest.fail(f"FastWAM golden fixture {FOLDER} not found (scripts/lerobot_golden/make_fastwam_fixture.py)")
    return FOLDER


_MODEL: list = []


def config_json() -> dict:
    return json.loads((folder() / "checkpoint" / "config.json").read_text())


def state_dict() -> dict:
    return load_file(str(folder() / "checkpoint" / "model.safetensors"))


def model():
    """(config, weights, cases.json, {case: Case}), loaded once per process."""
    if not _MODEL:
        path = folder()
        meta = json.loads((path / "cases.json").read_text())
        config = FastWAMConfig.from_lerobot(config_json())
        weights = convert(config, state_dict())
        raw = load_case_tensors(path / "cases.safetensors")
        cases = {}
        for rec in meta["cases"]:
            n = rec["name"]
            t = {k[len(n) + 1:]: v for k, v in raw.items() if k.startswith(n + ".")}
            cases[n] = Case(n, t["first_frame_latents"], t["text_emb"], t["state_normalized"], t["noise"],
                            t["actions"][None], t)
        _MODEL.append((config, weights, meta, cases))
    return _MODEL[0]


def case_names() -> list:
    meta = FOLDER / "cases.json"
    return [c["name"] for c in json.loads(meta.read_text())["cases"]] if meta.is_file() else [""]
