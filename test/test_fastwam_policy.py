"""FastWAM through the policy API, from a checkpoint folder exactly as LeRobot 0.6.1 saves it: `load(DIR)` with the
frozen VAE / UMT5 / tokenizer (given as folders or found in a hub cache laid out as the hub lays it out),
`predict_chunk` (LeRobot's preprocessor -> predict_action_chunk -> postprocessor, with LeRobot's seeded noise)
against the robot-unit actions LeRobot produced for the same frames, state, task and seed; the staged methods
against the model-level goldens. Needs diffusers and transformers (as test_fastwam_encoders.py)."""
import shutil

import numpy as np
import pytest
import torch

from fastwam_cases import case_names, folder, model
from flashrt_core.errors import CheckpointError, InputError

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from flashrt_core.models.fastwam import policy as fastwam_policy  # noqa: E402

# max abs error allowed, and why
TOL = {
    "robot": 2e-4,  # relative to the largest robot-unit action (un-normalization scales errors by the std;
    # measured ~2e-7: same fp32 encoders, bit-equal resized image and noise, fp32 reference DiTs)
    "actions": 1e-4,  # model (normalized) space, absolute (measured ~5e-7)
    "text_emb": 1e-5,  # the same UMT5 module on the same ids
}
VAE_REPO, TOKENIZER_REPO = "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "google/umt5-xxl"


def load(checkpoint=None, engine="reference", **kw):
    f = folder()
    parts = {"vae": f / "hf_wan_vae", "text_encoder": f / "hf_umt5_encoder", "tokenizer": f / "hf_umt5_tokenizer"}
    parts.update(kw)
    return fastwam_policy.load(checkpoint or f / "checkpoint", engine=engine, dtype="float32", **parts)


@pytest.fixture(scope="module")
def policy():
    return load()


def record(name):
    return next(r for r in model()[2]["cases"] if r["name"] == name)


def frames_of(policy, case):
    """The case's raw frames in the checkpoint's camera order (config.json: wrist, front)."""
    return [case.tensors[f"frame.{n.split('.')[-1]}"].numpy() for n in policy.processors.camera_names]


def rel_err(got, want):
    return (got - want).abs().max().item() / want.abs().max().item()


@pytest.mark.parametrize("name", case_names())
def test_predict_chunk_is_lerobots_whole_pipeline(policy, name):
    case, rec = model()[3][name], record(name)
    want = case.tensors["actions_robot"][0]
    state = case.tensors["state_raw"][0]
    # the noise drawn from the seed, as LeRobot draws it (batch["seed"])
    got = torch.from_numpy(policy.predict_chunk(frames_of(policy, case), state, rec["task"], seed=rec["noise_seed"]))
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got, want) <= TOL["robot"], f"{name}: relative max error {rel_err(got, want):.2e}"
    # the same with the noise given, and with the frames by camera name
    by_name = {n.split(".")[-1]: f for n, f in zip(policy.processors.camera_names, frames_of(policy, case))}
    got2 = torch.from_numpy(policy.predict_chunk(by_name, state.numpy(), rec["task"], noise=case.noise))
    assert rel_err(got2, want) <= TOL["robot"]
    # LeRobot's side-by-side image (sorted keys: front | wrist, each resized with antialias) bit for bit
    image, _ = policy.preprocess_images(frames_of(policy, case))
    assert torch.equal(image, case.tensors["input_image"])
    ids, mask = policy.tokenize(rec["task"])
    assert torch.equal(ids, case.tensors["token_ids"]) and torch.equal(mask, case.tensors["token_mask"])


def test_the_default_seed_is_the_configs_inference_seed(policy):
    """predict_chunk without seed / noise draws LeRobot's default noise (config.json inference_seed 42)."""
    name = next(r["name"] for r in model()[2]["cases"] if r["noise_seed"] == 42)
    case = model()[3][name]
    assert torch.equal(policy.make_noise(), case.noise)
    got = torch.from_numpy(policy.predict_chunk(frames_of(policy, case), case.tensors["state_raw"][0],
                                                record(name)["task"]))
    assert rel_err(got, case.tensors["actions_robot"][0]) <= TOL["robot"]
    with pytest.raises(InputError, match="noise and seed"):
        policy.predict_chunk(frames_of(policy, case), case.tensors["state_raw"][0], "x", noise=case.noise, seed=1)


def test_staged_methods_have_the_references_signatures(policy):
    for name, case in model()[3].items():
        rec = record(name)
        text = policy.encode_prompt(rec["task"])
        assert (text - case.text_emb).abs().max().item() <= TOL["text_emb"]
        latents = policy.encode_image(case.tensors["input_image"])
        cache = policy.prefill(latents, text, case.state)
        staged = policy.denoise(cache, case.noise)
        whole = policy.sample_actions(case.first_frame_latents, case.text_emb, case.state, noise=case.noise)
        seeded = policy.sample_actions(case.first_frame_latents, case.text_emb, case.state, seed=rec["noise_seed"])
        for got in (staged, whole, seeded):
            assert (got - case.actions).abs().max().item() <= TOL["actions"], name


def hub_cache(dest, vae=True, text_encoder=True, tokenizer=True):
    """A hub cache laid out as the hub lays it out, holding the fixture's hf_* folders under LeRobot's names."""
    f = folder()
    wan = dest / ("models--" + VAE_REPO.replace("/", "--"))
    snap = wan / "snapshots" / "5a592417"
    snap.mkdir(parents=True)
    if vae:
        shutil.copytree(f / "hf_wan_vae", snap / "vae")
    if text_encoder:
        shutil.copytree(f / "hf_umt5_encoder", snap / "text_encoder")
    (wan / "refs").mkdir()
    (wan / "refs" / "main").write_text("5a592417")
    if tokenizer:
        tok = dest / ("models--" + TOKENIZER_REPO.replace("/", "--"))
        shutil.copytree(f / "hf_umt5_tokenizer", tok / "snapshots" / "c27d4dc2")
        (tok / "refs").mkdir()
        (tok / "refs" / "main").write_text("c27d4dc2")
    return dest


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # (the default ~/.cache/huggingface/hub: empty)
    return tmp_path


def test_the_frozen_parts_come_from_the_hub_cache(empty_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(empty_home / "hub")))
    policy = fastwam_policy.load(folder() / "checkpoint", engine="auto", dtype="float32")
    name = case_names()[0]
    case, rec = model()[3][name], record(name)
    got = torch.from_numpy(policy.predict_chunk(frames_of(policy, case), case.tensors["state_raw"][0], rec["task"],
                                                seed=rec["noise_seed"]))
    assert rel_err(got, case.tensors["actions_robot"][0]) <= TOL["robot"]


@pytest.mark.parametrize("part,file", [("vae", "vae/config.json"), ("text_encoder", "text_encoder/config.json"),
                                       ("tokenizer", "tokenizer_config.json")])
def test_a_missing_frozen_part_is_named_with_its_download_command(empty_home, monkeypatch, part, file):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(empty_home / "hub", **{part: False})))
    repo = TOKENIZER_REPO if part == "tokenizer" else VAE_REPO
    with pytest.raises(CheckpointError, match=rf"{file} of {repo} not found.*`hf download {repo}"):
        fastwam_policy.load(folder() / "checkpoint", dtype="float32")


def test_a_given_vae_folder_without_its_weights_is_named(tmp_path):
    vae = tmp_path / "vae"
    vae.mkdir()
    shutil.copy(folder() / "hf_wan_vae" / "config.json", vae / "config.json")
    with pytest.raises(CheckpointError, match=r"Wan2.2 VAE: .*diffusion_pytorch_model.safetensors or .*\.index\.json not found.*"
                                              r"`hf download Wan-AI/Wan2.2-TI2V-5B-Diffusers --include 'vae/\*'`"):
        load(vae=vae)
    with pytest.raises(CheckpointError, match="Wan2.2 VAE: .*nowhere is not a folder.*hf download"):
        load(vae=tmp_path / "nowhere")


def test_bad_inputs_are_refused_by_name(policy):
    name = case_names()[0]
    case, rec = model()[3][name], record(name)
    frames, state = frames_of(policy, case), case.tensors["state_raw"][0]
    with pytest.raises(InputError, match="camera observation.images.front is missing"):
        policy.predict_chunk([frames[0], None], state, rec["task"])
    with pytest.raises(InputError, match="camera observation.images.wrist is missing"):
        policy.predict_chunk({"front": frames[1]}, state, rec["task"])
    with pytest.raises(InputError, match="1 frames for 2 camera features"):
        policy.predict_chunk(frames[:1], state, rec["task"])
    with pytest.raises(InputError, match="state: 7 values"):
        policy.predict_chunk(frames, state[:7], rec["task"])
    with pytest.raises(InputError, match="task: expected a string"):
        policy.predict_chunk(frames, state, 3)
    # (any aspect is accepted, as LeRobot resizes every camera to H x W / N rather than refusing: the golden
    # case resized_96x128_and_48x80 covers it)


def test_engines(tmp_path):
    with pytest.raises(ValueError, match="engine 'fused': FastWAM has no fused engine yet"):
        load(engine="fused")
    with pytest.raises(ValueError, match="engine: 'turbo' is not available"):
        fastwam_policy.load(folder() / "checkpoint", engine="turbo")


def test_a_folder_without_statistics_loads_for_normalized_space_and_refuses_robot_units(tmp_path):
    """config.json + model.safetensors, as the policy's save_pretrained alone writes them: sample_actions works
    (it needs no statistics); predict_chunk refuses robot units, naming what is missing (FlowPolicy's rule)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder() / "checkpoint" / name, ck / name)
    policy = load(ck)
    name = case_names()[0]
    case, rec = model()[3][name], record(name)
    got = policy.sample_actions(case.first_frame_latents, case.text_emb, case.state, noise=case.noise)
    assert (got - case.actions).abs().max().item() <= TOL["actions"]
    with pytest.raises(CheckpointError, match="normalization_mapping.STATE is MEAN_STD.*robot units cannot be had"):
        policy.predict_chunk(frames_of(policy, case), case.tensors["state_raw"][0], rec["task"])
    assert isinstance(policy.make_noise(), torch.Tensor) and np.isfinite(policy.make_noise().numpy()).all()
