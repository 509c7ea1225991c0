"""FastWAM's encoders (flashrt_core.models.fastwam.encoders: diffusers' Wan VAE, transformers' UMT5) against the
LeRobot 0.6.1 golden fixture's tiny VAE / UMT5 / tokenizer folders and the intermediates LeRobot recorded
(token ids, UMT5 embedding, first-frame latents). Needs diffusers and transformers (not in the base install)."""
import pytest
import torch

from fastwam_cases import folder, model
from flashrt_core.errors import CheckpointError, InputError

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from flashrt_core.models.fastwam import encoders as E  # noqa: E402
from flashrt_core.models.fastwam import reference as R  # noqa: E402

TOL = {
    "text_emb": 1e-5,  # same UMT5 module in fp32, same ids
    "latents": 1e-5,  # same VAE module in fp32, then the standardization
    "actions": 1e-4,  # the whole chain from pixels and prompt
}


def test_prompt_image_to_actions_match_lerobot():
    config, w, meta, cases = model()
    path = folder()
    tok = E.load_tokenizer(path / "hf_umt5_tokenizer")
    enc = E.load_text_encoder(path / "hf_umt5_encoder")
    vae = E.load_vae(path / "hf_wan_vae")
    for rec in meta["cases"]:
        c = cases[rec["name"]]
        ids, mask = E.tokenize(tok, rec["prompt"], config.context_len)
        assert torch.equal(ids, c.tensors["token_ids"]) and torch.equal(mask, c.tensors["token_mask"])
        text = E.encode_prompt(enc, ids, mask)
        assert (text - c.text_emb).abs().max().item() <= TOL["text_emb"], rec["name"]
        lat = E.encode_first_frame(vae, c.tensors["input_image"])
        assert (lat - c.first_frame_latents).abs().max().item() <= TOL["latents"], rec["name"]
        actions = R.sample_actions(w, lat, text, c.state, c.noise)
        assert (actions - c.actions).abs().max().item() <= TOL["actions"], rec["name"]


def test_missing_folders_and_bad_images_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="diffusion_pytorch_model.safetensors.*Wan2.2-TI2V-5B-Diffusers"):
        E.load_vae(tmp_path)
    with pytest.raises(CheckpointError, match="UMT5 text encoder"):
        E.load_text_encoder(tmp_path)
    vae = E.load_vae(folder() / "hf_wan_vae")
    with pytest.raises(InputError, match="image"):
        E.encode_first_frame(vae, torch.rand(1, 3, 60, 128))
