"""Checkpoint I/O in LeRobot's layout: key set, size inference, typed errors, bit-exact tiny round trip."""
import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashrt_core.errors import CheckpointError
from flashrt_core.models import pi05
from flashrt_core.models.paligemma.checkpoint import EMBED_KEY, IGNORED_KEYS
from flashrt_core.models.pi05.config import Pi05Config

# Tolerances: every comparison in this file is exact (bit-for-bit); there is no numeric tolerance.
TOL = {"round_trip": 0.0}
FIXTURE = "lerobot_pi05_tiny"


def _full_key_table(fixtures_dir):
    """Expand test/fixtures/lerobot_pi05_state_dict.txt ('{i}' rows with a [0..n] range) into {key: shape}."""
    out = {}
    for line in (fixtures_dir / "lerobot_pi05_state_dict.txt").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"(\S+)\s+\[([\d, ]+)\]\s+\S+(?:\s+\[0\.\.(\d+)\])?", line)
        key, shape = m.group(1), tuple(int(s) for s in m.group(2).split(","))
        for i in range(int(m.group(3)) + 1 if m.group(3) else 1):
            out[key.replace("{i}", str(i))] = shape
    return out


def _copy_fixture(fixtures_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fixtures_dir / FIXTURE, dst)
    for f in dst.iterdir():
        f.chmod(0o644)  # writable, whatever the checkout's file modes
    return dst


def _rewrite(folder, edit):
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_expected_keys_match_lerobot_full_checkpoint(fixtures_dir):
    table = _full_key_table(fixtures_dir)
    assert len(table) == 813  # the count printed at the top of the table
    want = pi05.expected_keys(Pi05Config.full())
    assert set(want) | set(IGNORED_KEYS) == set(table)
    assert all(table[k] == shape for k, shape in want.items())
    # The shapes alone (no dims.json) are enough to recover the released sizes.
    assert Pi05Config.from_state_dict_shapes(table) == Pi05Config.full()


def test_fixture_loads_with_dims_from_dims_json(fixtures_dir):
    config, state = pi05.load_checkpoint(fixtures_dir / FIXTURE)
    dims = json.loads((fixtures_dir / FIXTURE / "dims.json").read_text())
    assert (config.vlm.width, config.vlm.depth, config.vlm.mlp, config.vlm.heads) == (64, 2, 128, 8)
    assert (config.expert.width, config.expert.heads, config.expert.head_dim) == (32, 8, 16)
    assert config.vision.heads == dims["vision"]["num_attention_heads"] == 4
    assert config.tokenizer_max_length == 16  # from LeRobot's config.json
    assert config.num_image_slots == 3 and config.vocab_size == 1024
    assert set(state) == set(pi05.expected_keys(config))  # lm_head dropped
    # Loading the file path directly gives the same result.
    config2, _ = pi05.load_checkpoint(fixtures_dir / FIXTURE / "model.safetensors")
    assert config2 == config


def test_missing_unexpected_and_misshaped_keys_are_listed(fixtures_dir, tmp_path):
    folder = _copy_fixture(fixtures_dir, tmp_path)
    gone = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj.weight"
    bent = "model.time_mlp_out.bias"

    def edit(t):
        del t[gone]
        t["model.state_proj.weight"] = torch.ones(32, 32)
        t[bent] = torch.ones(31)

    _rewrite(folder, edit)
    with pytest.raises(CheckpointError) as err:
        pi05.load_checkpoint(folder)
    msg = str(err.value)
    assert f"1 missing keys: {gone}" in msg
    assert "1 unexpected keys: model.state_proj.weight" in msg
    assert f"1 mis-shaped keys: {bent} [31] (expected [32])" in msg
    assert str(folder / "model.safetensors") in msg


def test_long_key_lists_are_truncated(fixtures_dir, tmp_path):
    folder = _copy_fixture(fixtures_dir, tmp_path)

    def edit(t):
        for i in range(14):
            t[f"model.extra.{i:02d}"] = torch.zeros(1)

    _rewrite(folder, edit)
    with pytest.raises(CheckpointError, match=r"14 unexpected keys: model\.extra\.00, .* \(4 more\)"):
        pi05.load_checkpoint(folder)


def test_missing_and_corrupt_files(fixtures_dir, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        pi05.load_checkpoint(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=re.escape(str(empty / "model.safetensors"))):
        pi05.load_checkpoint(empty)
    folder = _copy_fixture(fixtures_dir, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        pi05.load_checkpoint(folder)
    (folder / "model.safetensors").write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        pi05.load_checkpoint(folder)


def test_dims_json_disagreeing_with_tensors_is_an_error(fixtures_dir, tmp_path):
    folder = _copy_fixture(fixtures_dir, tmp_path)
    dims = json.loads((folder / "dims.json").read_text())
    dims["vlm"]["mlp_dim"] = 256
    (folder / "dims.json").write_text(json.dumps(dims))
    with pytest.raises(CheckpointError, match=r"vlm\.mlp_dim=256"):
        pi05.load_checkpoint(folder)
    (folder / "dims.json").unlink()  # without dims.json, SigLIP's head count cannot be inferred for width 32
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        pi05.load_checkpoint(folder)


def test_given_config_is_enforced(fixtures_dir):
    with pytest.raises(CheckpointError, match="mis-shaped"):
        pi05.load_checkpoint(fixtures_dir / FIXTURE, config=Pi05Config.full())


def test_embedding_falls_back_to_lm_head(fixtures_dir, tmp_path):
    folder = _copy_fixture(fixtures_dir, tmp_path)
    _rewrite(folder, lambda t: t.pop(EMBED_KEY))
    _, state = pi05.load_checkpoint(folder)  # LeRobot fills the embedding from lm_head the same way
    assert torch.equal(state[EMBED_KEY], load_file(str(folder / "model.safetensors"))[IGNORED_KEYS[0]])


def test_tiny_round_trip_is_bit_exact(tmp_path):
    config, state = pi05.build_tiny(seed=0)
    path = pi05.tiny_checkpoint(tmp_path / "tiny", seed=0)
    loaded_config, loaded = pi05.load_checkpoint(path)
    assert loaded_config == config == Pi05Config.tiny()
    assert set(loaded) == set(state)
    for k, t in state.items():
        assert loaded[k].dtype == t.dtype and torch.equal(loaded[k], t), k
    # Deterministic from the seed; a different seed gives different weights.
    _, same = pi05.build_tiny(seed=0)
    _, other = pi05.build_tiny(seed=1)
    assert all(torch.equal(same[k], state[k]) for k in state)
    assert not torch.equal(other[EMBED_KEY], state[EMBED_KEY])
    # Every tensor is random and non-trivial (norms not at their neutral value, biases non-zero).
    for k, t in state.items():
        assert t.std() > 0.01, k
    assert (state["model.paligemma_with_expert.paligemma.model.language_model.norm.weight"].abs().mean() > 0.01)
    # The saved folder runs through load() like any checkpoint, with the same result as the in-memory model.
    g = torch.Generator().manual_seed(2)
    images = torch.rand(1, 3, 3, 224, 224, generator=g) * 2 - 1
    masks = torch.tensor([[True, False, True]])
    tokens = torch.randint(3, 259, (1, 9), generator=g)
    lang_mask = torch.ones(1, 9, dtype=torch.bool)
    noise = torch.randn(1, 50, 32, generator=g)
    a = pi05.load(path).sample_actions(images, masks, tokens, lang_mask, noise=noise)
    b = pi05.load(None).sample_actions(images, masks, tokens, lang_mask, noise=noise)
    assert torch.equal(a, b)


def test_config_json_round_trip():
    for config in (Pi05Config.full(), Pi05Config.tiny()):
        assert Pi05Config.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="vocab_size"):
        d = Pi05Config.tiny().to_dict()
        del d["vocab_size"]
        Pi05Config.from_dict(d)


@pytest.mark.parametrize("file,content,message", [
    ("config.json", [1, 2], "config.json: expected a JSON object, got list"),
    ("dims.json", [1], "dims.json: expected a JSON object, got list"),
    ("config.json", {"type": "pi05", "input_features": ["cam"]}, "input_features: expected an object"),
    ("config.json", {"type": "act"}, "'act' is not a model FlashRT runs"),
    ("config.json", {"type": "pi05", "num_inference_steps": 0}, "num_steps must be a positive integer"),
    ("config.json", {"type": "pi05", "chunk_size": 1.7}, "chunk_size: expected a whole number, got 1.7"),
    ("config.json", {"type": "pi05", "chunk_size": -5}, "chunk_size must be a positive integer, got -5"),
    ("config.json", {"type": "pi05", "min_period": 0}, "min_period must be a positive number"),
    ("config.json", {"type": "pi05", "min_period": 5.0, "max_period": 4.0}, "must be below max_period"),
    ("config.json", {"type": "pi05", "max_period": [1]}, "max_period: expected a number"),
])
def test_a_broken_json_file_is_named_and_never_blamed_on_the_weights(fixtures_dir, tmp_path, file, content, message):
    """The run-time fields come from dims.json / config.json: a malformed one is a CheckpointError that names
    the file or field (before, some surfaced as "unreadable safetensors file" or as a ZeroDivisionError at the
    first inference)."""
    folder = _copy_fixture(fixtures_dir, tmp_path)
    if file == "config.json":  # keep dims.json's sizes, but let config.json give the run-time fields
        dims = json.loads((folder / "dims.json").read_text())
        for key in ("chunk_size", "num_steps", "min_period", "max_period"):
            dims.pop(key, None)
        (folder / "dims.json").write_text(json.dumps(dims))
    (folder / file).write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=re.escape(message)) as caught:
        pi05.load_checkpoint(folder)
    assert "unreadable safetensors" not in str(caught.value)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        pi05.checkpoint_config(folder)


def test_nan_or_infinite_weights_are_refused_at_load(fixtures_dir, tmp_path):
    folder = _copy_fixture(fixtures_dir, tmp_path)
    key = "model.action_in_proj.weight"

    def poison(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = float("nan")
    _rewrite(folder, poison)
    with pytest.raises(CheckpointError, match=re.escape(f"NaN or infinite values in 1 tensors: {key}")):
        pi05.load_checkpoint(folder)


@pytest.mark.parametrize("rename, message", [
    (lambda k: "_orig_mod." + k, "behind an extra prefix '_orig_mod.' (e.g. _orig_mod.model."),
    (lambda k: k[len("model."):], "they lack the leading 'model.' of a LeRobot PI05Policy state dict"),
    (lambda k: "net." + k.replace(".", "_"), "not a LeRobot pi0.5 checkpoint?"),
])
def test_keys_under_another_prefix_are_described_with_the_file(tmp_path, rename, message):
    """Sizes are inferred from the keys before any listing of missing / unexpected ones: when that fails,
    the error still names the file and what its keys look like (a torch.compile wrapper's '_orig_mod.', a
    state dict of the inner model without 'model.')."""
    path = pi05.tiny_checkpoint(tmp_path / "tiny", seed=0)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({rename(k): t for k, t in tensors.items()}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        pi05.load_checkpoint(path)
    text = str(e.value)
    assert text.startswith(str(path / "model.safetensors")) and "cannot infer pi0.5 sizes" in text, text
    assert f"{len(tensors)} keys" in text and message in text, text


def test_config_refuses_run_time_fields_out_of_range():
    base = pi05.build_tiny(0)[0]
    for field, value in (("num_steps", 0), ("chunk_size", 2.5), ("tokenizer_max_length", -1), ("state_dim", True),
                         ("vocab_size", 0), ("rms_eps", 0.0), ("min_period", float("nan"))):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(base, **{field: value})
