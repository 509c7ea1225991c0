"""The LeRobot 0.6.1 SmolVLA golden fixtures (test/fixtures/lerobot_smolvla_*, their README.md) are complete and
their cases decode bit for bit (digest-checked) with the shapes the README gives. No LeRobot import: the few value
checks below redo only LeRobot's arithmetic that is simple enough to restate (padding, MEAN_STD, frame / 255)."""
import json

import pytest
import torch
from safetensors import safe_open

from lerobot_cases import load_case_tensors

FOLDERS = {
    # folder: (cameras in config order, state dim, action dim, image size, image tokens per slot)
    "lerobot_smolvla_three_cams": (["top", "wrist", "side"], 8, 7, 96, 9),
    "lerobot_smolvla_empty_cam": (["front", "wrist", "empty_camera_0"], 6, 6, 128, 4),
}
CHECKPOINT_FILES = ["config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json",
                    "policy_preprocessor_step_5_normalizer_processor.safetensors",
                    "policy_postprocessor_step_0_unnormalizer_processor.safetensors"]
VLM_FILES = ["config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json"]

# Tolerances: the decode and the model-level / pipeline-level links are exact; MEAN_STD restated in float32 here
# may round differently from LeRobot's order of operations, so it is compared to 1e-6 relative.


def _load(fixtures_dir, folder):
    root = fixtures_dir / folder
    summary = json.loads((root / "cases.json").read_text())
    raw = load_case_tensors(root / "cases.safetensors")  # raises unless every digest matches
    cases = {c["name"]: {k[len(c["name"]) + 1:]: v for k, v in raw.items() if k.startswith(c["name"] + ".")}
             for c in summary["cases"]}
    assert sum(len(c) for c in cases.values()) == len(raw)
    return root, summary, cases


def _stats(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_fixture_folder_is_complete(fixtures_dir, folder):
    root = fixtures_dir / folder
    for name in CHECKPOINT_FILES:
        assert (root / "checkpoint" / name).is_file(), name
    assert sorted(p.name for p in (root / "checkpoint").iterdir()) == sorted(CHECKPOINT_FILES)
    for name in VLM_FILES:
        assert (root / "hf_vlm" / name).is_file(), name
    for name in ["README.md", "cases.json", "cases.safetensors"]:
        assert (root / name).is_file(), name
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size < 3.2e6, size

    cams, d_s, d_a, img, _ = FOLDERS[folder]
    config = json.loads((root / "checkpoint" / "config.json").read_text())
    assert config["type"] == "smolvla" and config["vlm_model_name"] == "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    visual = [k for k, v in config["input_features"].items() if v["type"] == "VISUAL"]
    assert [k.rsplit(".", 1)[-1] for k in visual] == cams
    assert config["input_features"]["observation.state"]["shape"] == [d_s]
    assert config["output_features"]["action"]["shape"] == [d_a]
    assert config["resize_imgs_with_padding"] == [img, img]
    assert config["normalization_mapping"] == {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    pre = json.loads((root / "checkpoint" / "policy_preprocessor.json").read_text())
    assert [s["registry_name"] for s in pre["steps"]] == [
        "rename_observations_processor", "to_batch_processor", "smolvla_new_line_processor", "tokenizer_processor",
        "device_processor", "normalizer_processor"]
    post = json.loads((root / "checkpoint" / "policy_postprocessor.json").read_text())
    assert [s["registry_name"] for s in post["steps"]] == ["unnormalizer_processor", "device_processor"]

    vlm = json.loads((root / "hf_vlm" / "config.json").read_text())
    text, summary = vlm["text_config"], json.loads((root / "cases.json").read_text())
    assert vlm["model_type"] == "smolvlm" and vlm["vision_config"]["image_size"] == img
    assert text["num_key_value_heads"] < text["num_attention_heads"]
    assert config["num_vlm_layers"] < text["num_hidden_layers"]
    dims = summary["dims"]
    assert dims["expert_hidden_size"] == int(text["hidden_size"] * config["expert_width_multiplier"])
    assert dims["self_attn_layers"] and dims["cross_attn_layers"]
    with safe_open(str(root / "checkpoint" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
        layers = {int(k.split(".")[6]) for k in keys if ".text_model.layers." in k}
        assert layers == set(range(config["num_vlm_layers"]))  # LeRobot keeps the first num_vlm_layers only
        expert_in = f.get_slice("model.action_in_proj.weight").get_shape()
        assert expert_in == [dims["expert_hidden_size"], 32]
        for i in dims["cross_attn_layers"]:  # cross-attention layers read the VLM's K/V: input = VLM kv width
            shape = f.get_slice(f"model.vlm_with_expert.lm_expert.layers.{i}.self_attn.k_proj.weight").get_shape()
            assert shape[1] == text["num_key_value_heads"] * text["head_dim"]
    assert all(v == {"actions_model": 0.0, "actions_robot": 0.0} for v in summary["reload_max_abs_diff"].values())


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_cases_decode_with_the_recorded_shapes(fixtures_dir, folder):
    root, summary, cases = _load(fixtures_dir, folder)
    cams, d_s, d_a, img, tokens_per_slot = FOLDERS[folder]
    assert len(cases) >= 3
    pre = _stats(root / "checkpoint" / "policy_preprocessor_step_5_normalizer_processor.safetensors")
    post = _stats(root / "checkpoint" / "policy_postprocessor_step_0_unnormalizer_processor.safetensors")
    for record in summary["cases"]:
        c = cases[record["name"]]
        present = [cam for cam in cams if f"frame.{cam}" in c]
        assert [f"observation.images.{cam}" for cam in cams if cam not in present] == record["cameras_missing"]
        for cam in present:
            assert c[f"frame.{cam}"].dtype == torch.uint8 and list(c[f"frame.{cam}"].shape) == \
                record["frames"][f"observation.images.{cam}"]
        slots = record["image_slots"]
        assert not any(f"image.{i}" in c for i in range(slots, 4))
        for i in range(slots):
            assert c[f"image.{i}"].shape == (1, 3, img, img) and c[f"image.{i}"].dtype == torch.float32
            assert c[f"image_mask.{i}"].shape == (1,) and c[f"image_mask.{i}"].dtype == torch.bool
            if bool(c[f"image_mask.{i}"]):
                assert c[f"image.{i}"].min() >= -1 and c[f"image.{i}"].max() <= 1
            else:
                assert bool((c[f"image.{i}"] == -1).all())
        assert [bool(c[f"image_mask.{i}"]) for i in range(slots)] == record["image_mask"]
        # present cameras fill the first slots in config order; an image of the model's size is not resized
        for i, cam in enumerate(present):
            frame = c[f"frame.{cam}"]
            if tuple(frame.shape[:2]) == (img, img):
                assert torch.equal(c[f"image.{i}"], (frame.permute(2, 0, 1)[None].float() / 255.0) * 2.0 - 1.0)

        length = record["lang_len"]
        assert c["lang_tokens"].shape == (1, length) and c["lang_tokens"].dtype == torch.int64
        assert c["lang_mask"].shape == (1, length) and c["lang_mask"].dtype == torch.bool
        assert int(c["lang_mask"].sum()) == record["valid_tokens"]
        assert c["lang_tokens"][0, : record["valid_tokens"]].tolist() == record["token_ids"]
        assert record["prefix_len"] == slots * tokens_per_slot + length + 1

        assert c["state_raw"].shape == c["state_normalized"].shape == (1, d_s)
        assert c["state"].shape == (1, 32) and bool((c["state"][:, d_s:] == 0).all())
        assert torch.equal(c["state"][:, :d_s], c["state_normalized"])
        mean, std = pre["observation.state.mean"], pre["observation.state.std"]
        assert torch.allclose(c["state_normalized"], (c["state_raw"] - mean) / (std + 1e-8), rtol=1e-6, atol=1e-6)

        assert c["noise"].shape == c["actions"].shape == (1, 50, 32)
        assert c["actions_model"].shape == c["actions_robot"].shape == (1, 50, d_a)
        assert torch.equal(c["actions"][:, :, :d_a], c["actions_model"])
        unnorm = c["actions_model"] * post["action.std"] + post["action.mean"]
        assert torch.allclose(c["actions_robot"], unnorm, rtol=1e-6, atol=1e-5)

    first = cases[summary["debug_case"]["name"]]
    n_layers = summary["dims"]["num_vlm_layers"]
    assert first["debug.velocity"].shape == (10, 1, 50, 32)
    assert first["debug.prefix_embs"].shape[:2] == (1, summary["debug_case"]["prefix_len"])
    assert all(f"debug.prefix_k.{i}" in first and f"debug.prefix_v.{i}" in first for i in range(n_layers))
