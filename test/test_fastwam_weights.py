"""FastWAM config (from LeRobot's config.json) and weights (LeRobot's state dict -> engine layout) against the
LeRobot 0.6.1 golden checkpoint (test/fixtures/lerobot_fastwam_tiny/checkpoint/)."""
import pytest
import torch

from fastwam_cases import config_json, model, state_dict
from flashrt_core.errors import CheckpointError
from flashrt_core.models.fastwam import FastWAMConfig, check_keys, convert, expected_keys
from flashrt_core.models.fastwam.weights import MOT


def test_config_reads_the_fixture_sizes():
    c = FastWAMConfig.from_lerobot(config_json())
    # make_fastwam_fixture.py's VIDEO_DIT / ACTION_DIT / POLICY
    assert (c.video.hidden, c.video.ffn, c.video.heads, c.video.head_dim, c.video.layers, c.video.freq_dim) == \
        (32, 64, 2, 16, 2, 32)
    assert (c.action.hidden, c.action.ffn, c.action.attn_dim) == (24, 48, 32)  # projected attention: 24 -> 2 x 16
    assert (c.action_dim, c.proprio_dim, c.text_dim, c.latent_channels) == (7, 8, 32, 48)
    assert (c.image_size, c.action_horizon, c.num_steps, c.context_len, c.shift) == ((64, 128), 16, 10, 32, 5.0)
    assert (c.latent_hw, c.video_grid, c.video_tokens, c.context_tokens) == ((4, 8), (1, 2, 4), 8, 33)
    assert FastWAMConfig.from_lerobot(config_json(), num_steps=4).num_steps == 4


def test_full_size_is_lerobots_default():
    c = FastWAMConfig.full_size()
    assert (c.video.hidden, c.video.heads, c.video.head_dim, c.video.ffn, c.video.layers) == (3072, 24, 128, 14336, 30)
    assert (c.action.hidden, c.action.heads, c.action.head_dim, c.action.ffn, c.action.layers) == (1024, 24, 128, 4096, 30)
    assert (c.text_dim, c.image_size, c.action_horizon, c.num_steps, c.context_len) == (4096, (224, 448), 32, 10, 128)
    assert (c.video_grid, c.video_tokens, c.context_tokens) == ((1, 7, 14), 98, 129)
    # a config.json with no DiT sections is LeRobot's defaults
    assert FastWAMConfig.from_lerobot({"type": "fastwam"}) == c


@pytest.mark.parametrize("edit,field", [
    ({"type": "smolvla"}, "type"),
    ({"video_dit_config": {"hidden_dim": "wide"}}, "video_dit_config.hidden_dim"),
    ({"action_dit_config": {"num_heads": 3}}, "share heads"),
    ({"video_dit_config": {"video_attention_mask_mode": "bidirectional"}}, "video_attention_mask_mode"),
    ({"video_dit_config": {"out_dim": 16}}, "out_dim"),
    ({"action_dit_config": {"text_dim": 16}}, "action_dit_config.text_dim"),
    ({"image_size": [64, 100]}, "image_size"),
    ({"proprio_dim": 0}, "proprio_dim"),
    ({"action_scheduler": {"infer_shift": -1}}, "action_scheduler.infer_shift"),
    ({"text_cfg_scale": 5.0}, "text_cfg_scale"),
])
def test_config_errors_name_the_field(edit, field):
    cj = config_json()
    for key, value in edit.items():
        cj[key] = {**cj[key], **value} if isinstance(value, dict) and isinstance(cj.get(key), dict) else value
    with pytest.raises(CheckpointError, match=field):
        FastWAMConfig.from_lerobot(cj)


def test_expected_keys_are_the_checkpoints():
    c, sd = FastWAMConfig.from_lerobot(config_json()), state_dict()
    want = expected_keys(c)
    assert set(want) == set(sd)
    assert all(tuple(sd[k].shape) == s for k, s in want.items())
    check_keys(c, sd)


def test_key_check_names_missing_unexpected_and_misshapen():
    c, sd = FastWAMConfig.from_lerobot(config_json()), state_dict()
    bad = dict(sd)
    del bad[MOT + "layers.1.blocks.action.cross_attn.k.weight"]
    bad["model.mot.mixtures.action.extra.weight"] = torch.ones(2)
    bad[MOT + "layers.0.blocks.video.ffn.0.weight"] = torch.ones(3, 3)
    with pytest.raises(CheckpointError) as err:
        convert(c, bad)
    msg = str(err.value)
    assert "missing (1): model.mot.layers.1.blocks.action.cross_attn.k.weight" in msg
    assert "unexpected (1): model.mot.mixtures.action.extra.weight" in msg
    assert "model.mot.layers.0.blocks.video.ffn.0.weight: (3, 3) (expected (64, 32))" in msg


def test_layout_merges_projections_and_legacy_keys_load():
    c, sd = FastWAMConfig.from_lerobot(config_json()), state_dict()
    w = model()[1]
    p = MOT + "layers.1.blocks.action."
    L = w.action_layers[1]
    assert torch.equal(L.qkv_w, torch.cat([sd[p + f"self_attn.{n}.weight"] for n in "qkv"]))
    assert torch.equal(L.cross_kv_b, torch.cat([sd[p + f"cross_attn.{n}.bias"] for n in "kv"]))
    assert L.modulation.shape == (6, c.action.hidden)
    assert w.action_t_mod.shape == (c.num_steps, 6, c.action.hidden) and w.deltas.sum().item() == pytest.approx(-1.0)
    # checkpoints saved before LeRobot's MoTLayer refactor: mot.mixtures.<expert>.blocks.<i>.
    legacy = {k.replace(f"{MOT}layers.", f"{MOT}mixtures.").replace(".blocks.video.", ".@video.")
              .replace(".blocks.action.", ".@action."): v for k, v in sd.items()}
    legacy = {(_legacy_name(k) if ".@" in k else k): v for k, v in legacy.items()}
    w2 = convert(c, legacy)
    assert torch.equal(w2.video_layers[1].ffn2_w, w.video_layers[1].ffn2_w)
    assert torch.equal(w2.action_layers[0].qkv_w, w.action_layers[0].qkv_w)


def _legacy_name(key: str) -> str:
    """model.mot.mixtures.<i>.@<expert>.rest -> model.mot.mixtures.<expert>.blocks.<i>.rest"""
    head, rest = key.split(".@", 1)
    index = head.rsplit(".", 1)[1]
    expert, tail = rest.split(".", 1)
    return f"{MOT}mixtures.{expert}.blocks.{index}.{tail}"


def test_to_keeps_time_tables_fp32():
    w = model()[1].to(dtype=torch.bfloat16)
    assert w.video_layers[0].qkv_w.dtype == torch.bfloat16 and w.action_out_w.dtype == torch.bfloat16
    assert w.action_t_mod.dtype == w.deltas.dtype == w.video_t_mod.dtype == torch.float32
