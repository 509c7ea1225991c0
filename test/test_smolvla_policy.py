"""SmolVLA through the policy API, from a checkpoint folder exactly as LeRobot 0.6.1 saves it: `load(DIR)`,
`sample_actions` (LeRobot's model call) and `predict_chunk` (LeRobot's whole pipeline: pre-processor -> model ->
post-processor) against the golden outputs LeRobot produced for the same folder, frames, state, task and noise."""
import json
import shutil

import pytest
import torch

from flashrt_core.errors import CheckpointError
from flashrt_core.models import registry
from flashrt_core.models.smolvla import policy as smolvla_policy
from smolvla_cases import FIXTURES, case_ids, model

# max abs error allowed, and why
TOL = {
    "actions": 1e-4,  # model space, fp32 reference vs LeRobot fp32 (measured ~2e-6)
    "robot": 2e-4,  # relative to the largest robot-unit action: the un-normalization scales errors by the std
}


def load(folder, engine="reference", **kw):
    path = FIXTURES / folder
    return smolvla_policy.load(path / "checkpoint", vlm=path / "hf_vlm", engine=engine, dtype="float32", **kw)


@pytest.mark.parametrize("engine", ["reference", "fused"])
@pytest.mark.parametrize("folder,case", case_ids(), ids=lambda v: v)
def test_predict_chunk_is_lerobots_whole_pipeline(folder, case, engine):
    policy = load(folder, engine)
    _, _, meta, cases = model(folder)
    c = cases[case]
    rec = next(r for r in meta["cases"] if r["name"] == case)
    names = [n.split(".")[-1] for n in policy.processors.camera_names]
    frames = [None if n in [m.split(".")[-1] for m in rec["cameras_missing"]] else c.tensors[f"frame.{n}"].numpy()
              for n in names]
    got = torch.from_numpy(policy.predict_chunk(frames, c.tensors["state_raw"][0], rec["task"], noise=c.noise))
    want = c.tensors["actions_robot"][0]
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= TOL["robot"], f"{folder}/{case}: relative max error {err:.2e} vs LeRobot's pipeline"
    tokens, mask = policy.tokenize(rec["task"])
    assert tokens[0, :rec["valid_tokens"]].tolist() == rec["token_ids"] and int(mask.sum()) == rec["valid_tokens"]


@pytest.mark.parametrize("folder,case", case_ids()[:1], ids=lambda v: v)
def test_sample_actions_has_lerobots_signature(folder, case):
    policy = load(folder)
    c = model(folder)[3][case]
    got = policy.sample_actions(c.images, c.image_masks, c.lang_tokens, c.lang_mask, c.state, noise=c.noise)
    assert (got - c.actions).abs().max().item() <= TOL["actions"]


def test_a_folder_without_statistics_loads_for_normalized_space_and_refuses_robot_units(tmp_path):
    """config.json + model.safetensors, as the policy's save_pretrained alone writes them: sample_actions works
    (it needs no statistics); predict_chunk refuses robot units, naming what is missing."""
    src = FIXTURES / "lerobot_smolvla_three_cams"
    ck = tmp_path / "ck"
    ck.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / "checkpoint" / name, ck / name)
    policy = smolvla_policy.load(ck, vlm=src / "hf_vlm", engine="reference", dtype="float32")
    case = next(iter(model("lerobot_smolvla_three_cams")[3].values()))
    got = policy.sample_actions(case.images, case.image_masks, case.lang_tokens, case.lang_mask, case.state,
                                noise=case.noise)
    assert (got - case.actions).abs().max().item() <= TOL["actions"]
    frames = [case.tensors[f"frame.{n}"].numpy() for n in ("top", "wrist", "side")]
    with pytest.raises(CheckpointError, match="normalization_mapping.STATE is MEAN_STD.*robot units cannot be had"):
        policy.predict_chunk(frames, case.tensors["state_raw"][0], "pick", noise=case.noise)


def test_the_registry_loads_smolvla_by_the_folders_type(tmp_path):
    src = FIXTURES / "lerobot_smolvla_empty_cam"
    assert registry.checkpoint_kind(src / "checkpoint") == "smolvla"
    assert json.loads((src / "checkpoint" / "config.json").read_text())["type"] == "smolvla"
    policy = registry.load(src / "checkpoint", vlm=src / "hf_vlm", engine="reference", dtype="float32")
    assert isinstance(policy, smolvla_policy.SmolVLAPolicy)
