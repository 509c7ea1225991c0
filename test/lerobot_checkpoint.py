"""The LeRobot 0.6.1 checkpoint fixture (test/fixtures/lerobot_pi05_ckpt): a folder exactly as LeRobot saves
it, the tokenizer files a hub cache would hold, and LeRobot's own pipeline outputs for three cases."""
from __future__ import annotations

import json
import pathlib
import shutil

from safetensors.torch import load_file

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "lerobot_pi05_ckpt"
PI0_FIXTURE = FIXTURE.parent / "lerobot_pi0_ckpt"
TOKENIZER = "google/paligemma-3b-pt-224"


def _tiny_dims(fixture: pathlib.Path) -> pathlib.Path:
    return fixture.parent / ("lerobot_pi0_tiny" if fixture.name.startswith("lerobot_pi0_") else
                             "lerobot_pi05_tiny") / "dims.json"


def checkpoint_copy(dest: pathlib.Path, fixture: pathlib.Path = FIXTURE) -> pathlib.Path:
    """The saved folder, plus dims.json: LeRobot's config.json names the full-size variants, and SigLIP's head
    count of the tiny sizes cannot be read off the tensor shapes (a real checkpoint needs no dims.json)."""
    folder = dest / "checkpoint"
    shutil.copytree(fixture / "checkpoint", folder)
    shutil.copy(_tiny_dims(fixture), folder / "dims.json")
    return folder


def hub_cache(dest: pathlib.Path, name: str = TOKENIZER, revision: str = "0123456789abcdef") -> pathlib.Path:
    """A Hugging Face hub cache folder holding the fixture tokenizer under `name`, laid out as the hub does."""
    repo = dest / ("models--" + name.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in (FIXTURE / "hf_tokenizer").iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return dest


def cases(fixture: pathlib.Path = FIXTURE) -> list[dict]:
    """[{name, task, frames (uint8 HWC or None, in camera order), state [6], noise [1,50,32], and LeRobot's
    lang_tokens, lang_mask, state_normalized, actions_model, actions}]"""
    meta = json.loads((fixture / "cases.json").read_text())
    tensors = load_file(str(fixture / "cases.safetensors"))
    out = []
    for c in meta["cases"]:
        n = c["name"]
        frames = [tensors.get(f"{n}.frame.{cam.split('.')[-1]}") for cam in meta["camera_order"]]
        out.append({"name": n, "task": c["task"], "frames": [None if f is None else f.numpy() for f in frames],
                    **{k: tensors[f"{n}.{k}"] for k in ("state", "noise", "lang_tokens", "lang_mask",
                                                       "state_normalized", "actions_model", "actions")}})
    return out


def unnormalized_copy(dest: pathlib.Path, model_fixture: pathlib.Path) -> pathlib.Path:
    """A model-only golden fixture (lerobot_pi0*_tiny: config.json and model.safetensors, no processor files) as
    a checkpoint the runtime loads: its config.json's normalization_mapping set to IDENTITY, since the folder has
    no statistics (a folder that asks for them and lacks them is refused)."""
    folder = dest / model_fixture.name
    shutil.copytree(model_fixture, folder)
    config = json.loads((folder / "config.json").read_text())
    config["normalization_mapping"] = {k: "IDENTITY" for k in config["normalization_mapping"]}
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    return folder
