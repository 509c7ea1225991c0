"""The eager SmolVLA reference (flashrt_core.models.smolvla.reference) against LeRobot 0.6.1's own outputs.

The golden cases (test/fixtures/lerobot_smolvla_*/) hold random tiny checkpoints saved by LeRobot and, per case,
the tensors given to `policy.model.sample_actions` and its actions (fp32, CPU); see `smolvla_cases.py`.
"""
import pytest
import torch

from smolvla_cases import case_ids, model
from flashrt_core.errors import CheckpointError, InputError
from flashrt_core.models.smolvla import SmolVLAConfig, check_keys
from flashrt_core.models.smolvla import reference as R

# What each comparison allows (max abs), and why.
TOL = {
    "actions": 1e-4,  # 10 Euler steps in fp32 vs LeRobot fp32 (measured ~2e-6)
    "prefix_kv": 1e-5,  # the RoPE'd K/V of the VLM layers, before any flow step
    "velocity": 1e-5,  # the first Euler step's velocity (same x_t = noise on both sides)
    "padding": 1e-5,  # padding the prompt / adding a masked slot changes nothing beyond fp32 noise
}


@pytest.mark.parametrize("folder,case", case_ids(), ids=lambda v: v)
def test_actions_match_lerobot(folder, case):
    _, w, _, cases = model(folder)
    c = cases[case]
    actions = R.sample_actions(w, *c.inputs(), c.noise)
    err = (actions - c.actions).abs().max().item()
    assert err <= TOL["actions"], f"{folder}/{case}: max abs {err:.2e} vs LeRobot"


@pytest.mark.parametrize("folder", ["lerobot_smolvla_three_cams", "lerobot_smolvla_empty_cam"])
def test_prefix_kv_and_first_velocity_match_lerobot(folder):
    """Where a mismatch would start: the VLM's K/V that self-attention expert layers read (LeRobot's cache rows are
    its real tokens, ours the same tokens among masked padding), then the first step's velocity."""
    config, w, meta, cases = model(folder)
    c = cases[meta["debug_case"]["name"]]
    prefix = R.encode_prefix(w, *c.inputs())
    real = prefix.pad_mask[0]
    assert int(real.sum()) == meta["debug_case"]["prefix_len"] - int((~c.tensors["debug.prefix_pad_masks"]).sum())
    lr_real = c.tensors["debug.prefix_pad_masks"][0].bool()
    checked = 0
    for j in range(config.expert.depth):
        i = j * config.expert_stride
        if config.is_cross(i):
            continue
        for ours, theirs in ((prefix.k[j], c.tensors[f"debug.prefix_k.{i}"]), (prefix.v[j], c.tensors[f"debug.prefix_v.{i}"])):
            err = (ours[:, :, real] - theirs[:, :, lr_real]).abs().max().item()
            assert err <= TOL["prefix_kv"], f"layer {i}: {err:.2e}"
        checked += 1
    assert checked >= 1
    v0 = R.velocity(w, prefix, c.noise, 0)
    err = (v0 - c.tensors["debug.velocity"][0]).abs().max().item()
    assert err <= TOL["velocity"], f"velocity of step 0: {err:.2e}"


def test_prompt_padding_and_masked_slots_change_nothing():
    """The fixed-length prefix (prompt padded to tokenizer_max_length, a masked extra camera) is LeRobot's
    variable-length one: same actions; and the inputs that are real do move them."""
    config, w, _, cases = model("lerobot_smolvla_three_cams")
    c = cases["side_missing"]  # two cameras given: the third slot is padding
    base = R.sample_actions(w, *c.inputs(), c.noise)
    images, masks, tokens, mask, state = c.inputs()
    junk = torch.full_like(images[:, :1], float("nan"))  # a masked slot's pixels never reach the actions
    padded = R.sample_actions(w, torch.cat([images, junk], 1), torch.cat([masks, masks[:, :1] & False], 1),
                              torch.cat([tokens, torch.full((1, 3), 7)], 1), torch.cat([mask, mask[:, :3] & False], 1),
                              state, c.noise)
    assert (padded - base).abs().max().item() <= TOL["padding"]
    for changed in ((images.flip(-1), masks, tokens, mask, state), (images, masks, tokens, mask, state + 0.5),
                    (images, masks, (tokens + 1) % config.vocab_size, mask, state)):
        assert (R.sample_actions(w, *changed, c.noise) - base).abs().max().item() > 1e-3


def test_staged_api_is_sample_actions_and_checks_inputs():
    _, w, _, cases = model("lerobot_smolvla_empty_cam")
    c = cases["two_128x128_padded_prompt"]
    engine = R.ReferenceEngine(w)
    prefix = engine.encode_prefix(*c.inputs())
    assert torch.equal(engine.denoise(prefix, c.noise), R.sample_actions(w, *c.inputs(), c.noise))
    images, masks, tokens, mask, state = c.inputs()
    with pytest.raises(InputError, match="state"):
        engine.encode_prefix(images, masks, tokens, mask, torch.zeros(1, 33))
    with pytest.raises(InputError, match="images"):
        engine.encode_prefix(images[..., :-16], masks, tokens, mask, state)
    with pytest.raises(InputError, match="noise"):
        engine.denoise(prefix, c.noise[:, :-1])


def test_config_from_lerobot_derives_the_expert_as_lerobot_does():
    for folder in ("lerobot_smolvla_three_cams", "lerobot_smolvla_empty_cam"):
        config, _, meta, cases = model(folder)
        d = meta["dims"]
        assert config.vlm.depth == d["num_vlm_layers"] and config.expert.depth == d["num_expert_layers"]
        assert (config.expert.width, config.expert.mlp, config.expert.head_dim) == \
            (d["expert_hidden_size"], d["expert_intermediate_size"], d["expert_head_dim"])
        assert [i for i in range(config.vlm.depth) if config.is_cross(i)] == d["cross_attn_layers"]
        assert config.image_tokens == d["image_seq_len"]
    full = SmolVLAConfig.full_size()
    assert (full.expert.width, full.expert.mlp, full.image_tokens, full.prefix_len) == (720, 2048, 64, 3 * 64 + 48 + 1)
    vlm = {"vision_config": {"hidden_size": 32}, "text_config": {"hidden_size": 64, "num_attention_heads": 4,
                                                                 "num_hidden_layers": 2, "intermediate_size": 96}}
    with pytest.raises(CheckpointError, match="num_vlm_layers"):
        SmolVLAConfig.from_lerobot({"num_vlm_layers": 3}, vlm)
    with pytest.raises(CheckpointError, match="text_config vocab_size"):
        SmolVLAConfig.from_lerobot({"num_vlm_layers": 2}, vlm)
    with pytest.raises(CheckpointError, match="text_config"):
        SmolVLAConfig.from_lerobot({}, {"vision_config": {}})


def test_state_dict_check_names_missing_unexpected_and_misshapen_keys():
    from safetensors.torch import load_file
    from smolvla_cases import folder
    config = model("lerobot_smolvla_three_cams")[0]
    sd = load_file(str(folder("lerobot_smolvla_three_cams") / "checkpoint" / "model.safetensors"))
    check_keys(config, sd)  # LeRobot's own file passes
    bad = dict(sd)
    del bad["model.state_proj.bias"]
    bad["model.extra.weight"] = torch.zeros(1)
    bad["model.action_in_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match=r"missing \(1\): model.state_proj.bias.*unexpected \(1\): "
                                              r"model.extra.weight.*wrong shape \(1\): model.action_in_proj"):
        check_keys(config, bad)
