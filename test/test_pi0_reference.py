"""The eager pi0 reference against LeRobot 0.6.1's own outputs (tiny pi0 fixture), and what makes pi0 pi0:
the act stage reads the state over a prefix that does not."""
import pytest
import torch

from flashrt_core.errors import CheckpointError, InputError
from flashrt_core.models import pi0, pi05
from flashrt_core.models.pi0 import reference as R
from lerobot_cases import PI05_CASES, model_inputs

TOL = {"actions_vs_lerobot": 1e-4}  # fp32 re-implementation vs LeRobot 0.6.1 golden actions (max abs)


def test_the_loader_reads_a_pi0_checkpoint(pi0_weights):
    c = pi0_weights.config
    assert c.kind == "pi0" and c.expert.width == 32 and c.state_dim == 32 and c.num_steps == 10
    with pytest.raises(ValueError, match="not pi0.5"):
        pi05.convert(c, {})


@pytest.mark.parametrize("name", PI05_CASES)
def test_actions_match_lerobot(pi0_weights, pi0_cases, name):
    c = pi0_cases[name]
    with torch.no_grad():
        actions = R.sample_actions(pi0_weights, *model_inputs(c), c["state_padded"], c["noise"])
    assert actions.shape == c["actions"].shape == (1, 50, 32)
    err = (actions - c["actions"]).abs().max().item()
    assert err < TOL["actions_vs_lerobot"], f"{name}: max abs error {err:.3g}"


def test_convert_keeps_the_tables_on_the_weights_device(fixtures_dir):
    """step times, time embedding and RoPE frequencies are made where the state dict lives (a state dict
    drawn on the GPU by the bench gave CPU tables before, and the reference failed on mixed devices)."""
    config, state = pi05.load_checkpoint(fixtures_dir / "lerobot_pi0_tiny")
    w = pi0.convert(config, {k: v.to("meta") for k, v in state.items()})
    assert {t.device.type for t in (w.step_times, w.time_emb, w.rope_inv_freq, w.action_in_w)} == {"meta"}


def test_act_reads_the_state_over_a_prefix_that_does_not(pi0_weights, pi0_cases):
    c = pi0_cases["two_views_padded_prompt"]
    engine = R.make_engine(pi0_weights)
    prefix = engine.encode_prefix(*model_inputs(c))
    same = engine.denoise(prefix, c["state_padded"], c["noise"])
    assert torch.equal(same, R.sample_actions(pi0_weights, *model_inputs(c), c["state_padded"], c["noise"]))
    moved = c["state_padded"].clone()
    moved[0, 0] += 0.5
    assert (engine.denoise(prefix, moved, c["noise"]) - same).abs().max() > 1e-3  # fresh state, new actions
    short = c["state_raw"]  # the unpadded state gives the padded one's actions (zero padding, as LeRobot)
    torch.testing.assert_close(engine.denoise(prefix, short, c["noise"]), same, atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="at most 32"):
        engine.denoise(prefix, torch.zeros(1, 33), c["noise"])


def test_a_pi0_checkpoint_with_a_pi05_type_is_refused(fixtures_dir, tmp_path, model_ckpt):
    import json
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(model_ckpt["pi0"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["type"] = "pi05"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="disagree"):
        pi05.load_checkpoint(folder)


def test_policy_api_as_lerobot_model_sample_actions(fixtures_dir, pi0_cases, model_ckpt):
    """`pi0.load(DIR).sample_actions(images, img_masks, lang_tokens, lang_mask, state, noise=)` as LeRobot's
    `PI0Pytorch.sample_actions` (lists of cameras, as LeRobot passes them)."""
    policy = pi0.load(model_ckpt["pi0"], device="cpu")
    assert policy.dtype == torch.float32 and policy.processors.camera_names[0] == "observation.images.cam0"
    c = pi0_cases["one_view_240x320_two_missing"]
    images, masks, tokens, lang_mask = model_inputs(c)
    out = policy.sample_actions(list(images.unbind(1)), list(masks.unbind(1)), tokens, lang_mask,
                                c["state_padded"], noise=c["noise"])
    assert (out - c["actions"]).abs().max().item() < TOL["actions_vs_lerobot"]


def test_pi0_prompt_is_the_task_with_a_newline(fixtures_dir, model_ckpt):
    policy = pi0.load(model_ckpt["pi0"], device="cpu")
    tokens, mask = policy.tokenize("stack the cups")
    ids = [policy.tokenizer.bos_id] + policy.tokenizer.encode("stack the cups\n")
    assert tokens[0, : len(ids)].tolist() == ids and int(mask.sum()) == len(ids)
    assert torch.equal(policy.tokenize("stack the cups\n")[0], tokens)  # one newline, not two


def test_predict_chunk_matches_lerobot_pipeline(tmp_path, monkeypatch):
    """A pi0 folder exactly as LeRobot saves it (MEAN_STD stats, relative actions with an excluded gripper, the
    task-plus-newline prompt, tokenizer by name from a hub cache) against LeRobot's whole pipeline."""
    import numpy as np

    from lerobot_checkpoint import PI0_FIXTURE, cases as ckpt_cases, checkpoint_copy, hub_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path / "hub")))
    policy = pi0.load(checkpoint_copy(tmp_path, PI0_FIXTURE))
    assert policy.processors.relative_mask == (True,) * 5 + (False,)
    assert policy.normalizer.state.mode == "MEAN_STD"
    for c in ckpt_cases(PI0_FIXTURE):
        tokens, mask = policy.tokenize(c["task"])
        assert torch.equal(tokens, c["lang_tokens"]) and torch.equal(mask, c["lang_mask"]), c["name"]
        out = policy.predict_chunk(c["frames"], c["state"][0].numpy(), c["task"], noise=c["noise"])
        np.testing.assert_allclose(out, c["actions"][0].numpy(), atol=TOL["actions_vs_lerobot"], rtol=0,
                                   err_msg=c["name"])
