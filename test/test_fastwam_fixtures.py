"""The LeRobot 0.6.1 FastWAM golden fixture (test/fixtures/lerobot_fastwam_tiny, its README.md) is complete and its
cases decode bit for bit (digest-checked) with the shapes the README gives. No LeRobot import: the few value checks
redo only arithmetic simple enough to restate (MEAN_STD, the Euler update, the mask layout, frame / 255)."""
import json

import pytest
import torch
from safetensors import safe_open

from lerobot_cases import load_case_tensors

FOLDER = "lerobot_fastwam_tiny"
CHECKPOINT_FILES = ["config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json",
                    "policy_preprocessor_step_3_normalizer_processor.safetensors",
                    "policy_postprocessor_step_0_unnormalizer_processor.safetensors"]
HF_FILES = {"hf_wan_vae": ["config.json", "diffusion_pytorch_model.safetensors"],
            "hf_umt5_encoder": ["config.json", "model.safetensors"],
            "hf_umt5_tokenizer": ["config.json", "tokenizer.json", "tokenizer_config.json"]}
H, A, D_S, STEPS, LAYERS, TOKENS = 16, 7, 8, 10, 2, 32


@pytest.fixture(scope="module")
def fixture(fixtures_dir):
    root = fixtures_dir / FOLDER
    if not (root / "cases.safetensors").is_file():
        pytest.fail(f"FastWAM golden fixture {root} not found (scripts/lerobot_golden/make_fastwam_fixture.py)")
    summary = json.loads((root / "cases.json").read_text())
    raw = load_case_tensors(root / "cases.safetensors")  # raises unless every digest matches
    cases = {c["name"]: {k[len(c["name"]) + 1:]: v for k, v in raw.items() if k.startswith(c["name"] + ".")}
             for c in summary["cases"]}
    assert sum(len(c) for c in cases.values()) == len(raw)
    return root, summary, cases


def _stats(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_fixture_folder_is_complete(fixture):
    root, summary, _ = fixture
    assert sorted(p.name for p in (root / "checkpoint").iterdir()) == sorted(CHECKPOINT_FILES)
    for sub, names in HF_FILES.items():
        assert sorted(p.name for p in (root / sub).iterdir()) == sorted(names), sub
    for name in ["README.md", "cases.json", "cases.safetensors"]:
        assert (root / name).is_file(), name
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size < 3.0e6, size

    config = json.loads((root / "checkpoint" / "config.json").read_text())
    assert config["type"] == "fastwam" and config["torch_dtype"] == "float32"
    assert config["text_encoder_model_id"] == "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    assert config["tokenizer_model_id"] == "google/umt5-xxl"
    assert list(config["input_features"]) == ["observation.images.wrist", "observation.images.front",
                                              "observation.state"]
    assert config["image_size"] == [64, 128] and config["action_horizon"] == H
    assert config["normalization_mapping"] == {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    video, action = config["video_dit_config"], config["action_dit_config"]
    assert video["num_heads"] == action["num_heads"] and video["attn_head_dim"] == action["attn_head_dim"]
    assert video["num_layers"] == action["num_layers"] == LAYERS
    assert video["hidden_dim"] == video["num_heads"] * video["attn_head_dim"]
    assert action["hidden_dim"] != action["num_heads"] * action["attn_head_dim"]  # the projected-attention path
    pre = json.loads((root / "checkpoint" / "policy_preprocessor.json").read_text())
    assert [s["registry_name"] for s in pre["steps"]] == [
        "rename_observations_processor", "to_batch_processor", "device_processor", "normalizer_processor"]
    post = json.loads((root / "checkpoint" / "policy_postprocessor.json").read_text())
    assert [s["registry_name"] for s in post["steps"]] == ["unnormalizer_processor", "device_processor"]

    vae = json.loads((root / "hf_wan_vae" / "config.json").read_text())
    assert vae["_class_name"] == "AutoencoderKLWan" and vae["z_dim"] == 48 and vae["patch_size"] == 2
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 48
    enc = json.loads((root / "hf_umt5_encoder" / "config.json").read_text())
    assert enc["model_type"] == "umt5" and enc["d_model"] == video["text_dim"] == action["text_dim"]
    tok = json.loads((root / "hf_umt5_tokenizer" / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "Unigram" and [v[0] for v in tok["model"]["vocab"][:3]] == ["<pad>", "</s>", "<unk>"]
    with safe_open(str(root / "checkpoint" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    assert "model.proprio_encoder.weight" in keys
    assert {int(k.split(".")[3]) for k in keys if k.startswith("model.mot.layers.")} == set(range(LAYERS))
    assert not any("vae" in k or "text_encoder" in k for k in keys)  # frozen parts live in the hub folders
    assert all(v == {"actions_model": 0.0, "actions_robot": 0.0} for v in summary["reload_max_abs_diff"].values())


def test_cases_decode_with_the_recorded_shapes(fixture):
    root, summary, cases = fixture
    assert len(cases) >= 2
    pre = _stats(root / "checkpoint" / "policy_preprocessor_step_3_normalizer_processor.safetensors")
    post = _stats(root / "checkpoint" / "policy_postprocessor_step_0_unnormalizer_processor.safetensors")
    padded = truncated = 0
    for record in summary["cases"]:
        c = cases[record["name"]]
        assert {k: list(v.shape) for k, v in c.items() if not k.startswith("joint.")} == record["shapes"]
        for cam in ("wrist", "front"):
            assert c[f"frame.{cam}"].dtype == torch.uint8
        # cameras concatenated along the width in sorted key order (front | wrist); native-size frames are not resized
        if all(tuple(c[f"frame.{cam}"].shape[:2]) == (64, 64) for cam in ("front", "wrist")):
            cat = torch.cat([c["frame.front"], c["frame.wrist"]], dim=1).permute(2, 0, 1)[None].float() / 255.0
            assert torch.equal(c["input_image"], cat)
        assert c["input_image"].shape == (1, 3, 64, 128)

        valid = record["valid_tokens"]
        assert c["token_ids"].shape == c["token_mask"].shape == (1, TOKENS)
        assert int(c["token_mask"].sum()) == valid and bool(c["token_mask"][0, :valid].all())
        assert bool((c["token_ids"][0, valid:] == 0).all())  # <pad> 0
        assert int(c["token_ids"][0, valid - 1]) == 1  # </s> ends the prompt, also when truncated
        padded += valid < TOKENS
        truncated += record["prompt_truncated"]
        assert bool((c["text_emb"][0, valid:] == 0).all()) and bool((c["text_emb"][0, :valid] != 0).any())
        assert c["context"].shape == (1, TOKENS + 1, 32)
        assert torch.equal(c["context"][:, :TOKENS], c["text_emb"])  # the proprio token is appended last

        mean, std = pre["observation.state.mean"], pre["observation.state.std"]
        assert torch.allclose(c["state_normalized"], (c["state_raw"] - mean) / (std + 1e-8), rtol=1e-6, atol=1e-6)
        assert c["first_frame_latents"].shape == (1, 48, 1, 4, 8)
        s_v = record["video_seq_len"]
        assert s_v == 8
        for i in range(LAYERS):
            assert c[f"video_k.{i}"].shape == c[f"video_v.{i}"].shape == (1, s_v, 32)
        m = c["attention_mask"]
        assert m.shape == (s_v + H, s_v + H) and m.dtype == torch.bool
        assert bool(m[s_v:].all())  # one latent frame: actions see every video token and each other
        assert not bool(m[:s_v, s_v:].any())  # video never sees the actions

        assert c["noise"].shape == (1, H, A) and c["velocity"].shape == (STEPS, 1, H, A)
        t = c["timesteps"]
        assert t.shape == (STEPS,) and float(t[0]) == 1000.0 and bool((t[1:] < t[:-1]).all())
        sigma = torch.cat([t / 1000.0, torch.zeros(1)])
        x = c["noise"].clone()
        for k in range(STEPS):
            x = x + c["velocity"][k] * (sigma[k + 1] - sigma[k])
        assert torch.allclose(x[0], c["actions"], atol=1e-5)  # Euler from sigma 1 down to 0
        assert torch.equal(c["actions"][None], c["actions_model"])
        unnorm = c["actions_model"] * post["action.std"] + post["action.mean"]
        assert torch.allclose(c["actions_robot"], unnorm, rtol=1e-6, atol=1e-4)
    assert padded >= 1 and truncated >= 1

    joint = cases[summary["cases"][0]["name"]]
    assert joint["joint.video_noise"].shape == joint["joint.video_latents"].shape == (1, 48, 2, 4, 8)
    assert torch.equal(joint["joint.video_latents"][:, :, :1], joint["first_frame_latents"])
    assert joint["joint.frames"].shape == (5, 64, 128, 3) and joint["joint.frames"].dtype == torch.uint8
    assert (joint["joint.actions"] - joint["actions"]).abs().max() < 1e-5
