"""A checkpoint folder exactly as LeRobot 0.6.1 saves it (processors with stats, relative actions with an
excluded gripper, tokenizer by name from a hub cache) through the project's pipeline, against LeRobot's own
`preprocessor -> predict_action_chunk(noise) -> postprocessor` outputs (test/fixtures/lerobot_pi05_ckpt)."""
import json
import pathlib

import numpy as np
import pytest
import torch

from flashrt_core import Runtime
from flashrt_core.errors import CheckpointError, ContractError, InputError
from flashrt_core.models import pi05
from flashrt_core.lerobot.hub_tokenizer import HubTokenizer
from flashrt_core.lerobot.processors import read_processors
from lerobot_checkpoint import FIXTURE, TOKENIZER, cases, checkpoint_copy, hub_cache

REPO = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-4  # fp32 against LeRobot's fp32 pipeline (actions reach about +-4 in robot units)
CASES = cases()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """(checkpoint folder, hub cache) with HF_HUB_CACHE pointing at the cache and no other cache visible."""
    cache = hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return checkpoint_copy(tmp_path), cache


@pytest.fixture
def policy(env):
    return pi05.load(env[0], device="cpu")


def test_processors_of_the_saved_folder(env):
    p = read_processors(env[0])
    assert p.camera_names == ("observation.images.front", "observation.images.wrist")
    assert (p.state_dim, p.action_dim) == (6, 6) and p.action_names[-1] == "gripper"
    assert p.relative_mask == (True,) * 5 + (False,)  # the gripper stays absolute
    assert p.tokenizer_name == TOKENIZER and p.tokenizer_max_length == 48
    assert (p.normalizer.state.mode, p.normalizer.action.mode) == ("QUANTILES", "QUANTILES")


def test_tokenizer_resolved_by_name_from_the_hub_cache(policy, env):
    assert isinstance(policy.tokenizer, HubTokenizer) and env[1] in policy.tokenizer.path.parents
    for c in CASES:  # the same ids as LeRobot's tokenizer step, BOS first, right padding
        tokens, mask = policy.tokenize(c["task"], c["state_normalized"][0])
        assert torch.equal(tokens, c["lang_tokens"]) and torch.equal(mask, c["lang_mask"])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_predict_chunk_matches_lerobot_pipeline(policy, case):
    state = case["state"][0].numpy()
    out = policy.predict_chunk(case["frames"], state, case["task"], noise=case["noise"])
    assert out.shape == (50, 6) and out.dtype == np.float32
    np.testing.assert_allclose(out, case["actions"][0].numpy(), atol=TOL, rtol=0)
    # the relative columns really carry the state (an implementation that skipped it would be ~|state| off)
    assert np.abs(state[:5]).min() > 10 * TOL


def test_predict_chunk_refuses_bad_inputs(policy):
    c = CASES[0]
    with pytest.raises(InputError, match="2 camera features"):
        policy.predict_chunk(c["frames"][:1], c["state"][0], c["task"])
    with pytest.raises(InputError, match="observation.state has 6"):
        policy.predict_chunk(c["frames"], np.zeros(7, np.float32), c["task"])
    with pytest.raises(InputError, match="NaN"):
        policy.predict_chunk(c["frames"], np.full(6, np.nan, np.float32), c["task"])
    with pytest.raises(InputError, match="more than prompt_len"):  # refused, never cut (LeRobot would cut)
        policy.predict_chunk(c["frames"], c["state"][0], "pick " * 60)


def _edit_json(path: pathlib.Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def test_unknown_processor_step_is_refused_by_name(env):
    pre = env[0] / "policy_preprocessor.json"
    _edit_json(pre, lambda d: d["steps"].insert(3, {"registry_name": "image_crop_resize_processor", "config": {}}))
    with pytest.raises(CheckpointError, match="'image_crop_resize_processor' is a processor step FlashRT does not"):
        pi05.load(env[0])


def test_relative_and_absolute_steps_must_agree(env):
    _edit_json(env[0] / "policy_postprocessor.json", lambda d: d["steps"][1]["config"].update(enabled=False))
    with pytest.raises(CheckpointError, match="disagree"):
        read_processors(env[0])


def test_missing_tokenizer_lists_every_place_and_the_command(env, tmp_path, monkeypatch):
    empty = tmp_path / "empty_cache"
    empty.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(empty))
    with pytest.raises(CheckpointError) as e:
        pi05.load(env[0])
    msg = str(e.value)
    assert str(env[0]) in msg and str(empty / "models--google--paligemma-3b-pt-224") in msg
    assert str(tmp_path / "hf_home" / "hub") in msg and f"hf download {TOKENIZER}" in msg


def test_explicit_tokenizer_path(env, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nowhere"))
    policy = pi05.load(env[0], tokenizer=FIXTURE / "hf_tokenizer")
    c = CASES[1]
    out = policy.predict_chunk(c["frames"], c["state"][0], c["task"], noise=c["noise"])
    np.testing.assert_allclose(out, c["actions"][0].numpy(), atol=TOL, rtol=0)


def _runtime_with_noise(checkpoint, noise, device="cpu", dtype="float32"):
    rt = Runtime.from_config(REPO / "config/pi05.yaml", device=device, checkpoint=str(checkpoint), dtype=dtype)
    host = rt.binding.host

    def host_with_noise(stage, io):  # LeRobot's noise instead of the runtime's own draw
        host(stage, io)
        if stage == "act":
            io.to_device("noise", noise[0])
    rt.binding.host = host_with_noise
    return rt


@pytest.mark.parametrize("case", [CASES[0]], ids=[CASES[0]["name"]])
def test_runtime_with_the_shipped_contract_matches_lerobot(env, case):
    rt = _runtime_with_noise(env[0], case["noise"])
    assert rt.binding.engine_name == "reference"  # engine auto on a CPU
    assert dict(rt.contract.dims)["views"] == 2 and rt.contract.buffers["actions"].shape == (50, 6)
    rt.set_prompt(case["task"])
    rt.set_observation(images=case["frames"], state=case["state"][0].numpy(), stamp_ns=1)
    out = rt.step(1).actions
    np.testing.assert_allclose(out, case["actions"][0].numpy(), atol=TOL, rtol=0)
    # an act-only tick reuses the prefix and its action offset: same noise, same actions
    again = rt.step(1 + 20_000_000)
    assert again.ran == ["act"]
    np.testing.assert_allclose(again.actions, out, atol=1e-6, rtol=0)


def test_contract_widths_must_agree_with_the_checkpoint(env):
    with pytest.raises(ContractError, match="config.json says 6"):
        Runtime.from_config(REPO / "config/pi05.yaml", checkpoint=str(env[0]), dtype="float32",
                            options={"state_dim": 7})
    with pytest.raises(ContractError, match="2 camera features"):
        Runtime.from_config(REPO / "config/pi05.yaml", checkpoint=str(env[0]), dtype="float32", num_cameras=3)


def _cosine_rel(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))), float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.gpu
def test_gpu_defaults_fused_bf16_match_lerobot(env):
    """On CUDA with no engine or dtype given: the fused engine in bf16, for predict_chunk and for the runtime
    with the shipped contract, against LeRobot's fp32 pipeline (bf16 targets: cosine >= 0.999)."""
    policy = pi05.load(env[0], device="cuda")
    assert policy.dtype == torch.bfloat16 and type(policy.engine).__module__.endswith("pi05.engine")
    for c in CASES:
        out = policy.predict_chunk(c["frames"], c["state"][0], c["task"], noise=c["noise"].cuda())
        cos, rel = _cosine_rel(out, c["actions"][0].numpy())
        assert cos >= 0.999 and rel <= 2e-2, (c["name"], cos, rel)
    c = CASES[0]
    rt = _runtime_with_noise(env[0], c["noise"], device="cuda", dtype=None)
    assert rt.binding.engine_name == "fused"
    rt.set_prompt(c["task"])
    rt.set_observation(images=c["frames"], state=c["state"][0].numpy(), stamp_ns=1)
    cos, rel = _cosine_rel(rt.step(1).actions, c["actions"][0].numpy())
    assert cos >= 0.999 and rel <= 2e-2, (cos, rel)



def test_a_stats_file_the_processor_names_must_be_there(env):
    (env[0] / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names its statistics file policy_postprocessor_step_0"):
        pi05.load(env[0])


def test_action_names_must_cover_the_action_columns(env):
    _edit_json(env[0] / "policy_preprocessor.json",
               lambda d: d["steps"][2]["config"].update(action_names=["shoulder_pan", "gripper"]))
    with pytest.raises(CheckpointError, match="2 action names .* for 6 action columns"):
        read_processors(env[0])


def test_a_frame_too_thin_to_letterbox_is_an_input_error(policy):
    c = CASES[0]
    with pytest.raises(InputError, match="too thin"):
        policy.predict_chunk([np.zeros((3000, 10, 3), np.uint8), None], c["state"][0], c["task"])
