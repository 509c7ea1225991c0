"""FastWAM's frozen encoders, run through the libraries that define them (as LeRobot 0.6.1 does): the Wan2.2 VAE
(`diffusers.AutoencoderKLWan`) for the observed frame and the UMT5 encoder (`transformers.UMT5EncoderModel`) with
its tokenizer for the prompt. Their outputs are what `reference.prefill` takes. diffusers / transformers are
imported only when one of these is called.

Folders: LeRobot reads `Wan-AI/Wan2.2-TI2V-5B-Diffusers` subfolders `vae` and `text_encoder`, and the tokenizer
`google/umt5-xxl`, from the hub cache; here each loader takes the folder itself.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from flashrt_core.errors import CheckpointError, InputError

# each entry: the file, or the alternatives one of which must be there (the weights whole, or their shard index:
# the full-size UMT5 encoder and VAE are saved in shards)
VAE_FILES = ("config.json", ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json"))
TEXT_ENCODER_FILES = ("config.json", ("model.safetensors", "model.safetensors.index.json"))
TOKENIZER_FILES = ("tokenizer_config.json",)


def _folder(folder: str | os.PathLike, files: tuple, what: str, repo: str) -> Path:
    path = Path(folder)
    missing = [" or ".join(str(path / f) for f in ((e,) if isinstance(e, str) else e)) for e in files
               if not any((path / f).is_file() for f in ((e,) if isinstance(e, str) else e))]
    if missing:
        raise CheckpointError(f"{what}: {'; '.join(missing)} not found "
                              f"(LeRobot's FastWAM takes it from {repo}; `hf download` it)")
    return path


def load_vae(folder, dtype: torch.dtype = torch.float32, device="cpu"):
    """The Wan2.2 VAE (`AutoencoderKLWan`) of a diffusers folder (Wan2.2-TI2V-5B-Diffusers/vae)."""
    path = _folder(folder, VAE_FILES, "Wan2.2 VAE", "Wan-AI/Wan2.2-TI2V-5B-Diffusers (subfolder vae)")
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(str(path), torch_dtype=dtype).to(device).eval().requires_grad_(False)


def load_text_encoder(folder, dtype: torch.dtype = torch.float32, device="cpu"):
    """The UMT5 encoder (`UMT5EncoderModel`) of a transformers folder (Wan2.2-TI2V-5B-Diffusers/text_encoder)."""
    path = _folder(folder, TEXT_ENCODER_FILES, "UMT5 text encoder",
                   "Wan-AI/Wan2.2-TI2V-5B-Diffusers (subfolder text_encoder)")
    from transformers import UMT5EncoderModel

    return UMT5EncoderModel.from_pretrained(str(path), torch_dtype=dtype).to(device).eval().requires_grad_(False)


def load_tokenizer(folder):
    """The UMT5 tokenizer (google/umt5-xxl) of a folder."""
    path = _folder(folder, TOKENIZER_FILES, "UMT5 tokenizer", "google/umt5-xxl")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tokenize(tokenizer, prompts: str | list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) [B, max_len]: LeRobot's WanTokenizer (pad to max_len, truncate, </s> appended)."""
    out = tokenizer([prompts] if isinstance(prompts, str) else list(prompts), padding="max_length",
                    truncation=True, max_length=int(max_len), add_special_tokens=True, return_tensors="pt")
    return out.input_ids, out.attention_mask.to(torch.bool)


@torch.no_grad()
def encode_prompt(text_encoder, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, d_model] fp32: the encoder's last hidden state with the padding rows zeroed (FastWAM.encode_prompt;
    the context mask it then uses is all true, the default of `reference.build_context`)."""
    device = next(text_encoder.parameters()).device
    emb = text_encoder(input_ids=ids.to(device), attention_mask=mask.to(device).long()).last_hidden_state
    return emb.masked_fill(~mask.to(device)[..., None], 0).float()


@torch.no_grad()
def encode_first_frame(vae, image: torch.Tensor) -> torch.Tensor:
    """[B, z_dim, 1, H/16, W/16] fp32 standardized latents of images [B, 3, H, W] in [0, 1]: LeRobot's
    `_encode_input_image_latents_tensor` + WanVideoVAE38.encode (pixels to [-1, 1], one frame, the posterior's
    mode, then (mu - latents_mean) / latents_std from the VAE's config)."""
    if image.ndim != 4 or image.shape[1] != 3 or image.shape[2] % 16 or image.shape[3] % 16:
        raise InputError(f"image: expected [B, 3, H, W] with H, W multiples of 16, got {tuple(image.shape)}")
    p = next(vae.parameters())
    video = (image * 2.0 - 1.0)[:, :, None].to(device=p.device, dtype=p.dtype)
    mu = vae.encode(video).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=mu.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=mu.device).view(1, -1, 1, 1, 1)
    return (mu - mean) / std


@torch.no_grad()
def decode_frames(vae, latents: torch.Tensor) -> torch.Tensor:
    """uint8 frames [B, T, H, W, 3] of standardized latents [B, z_dim, T_lat, h, w] (T = 4 (T_lat - 1) + 1):
    LeRobot's `_decode_latents` + WanVideoVAE38.decode (z * latents_std + latents_mean in fp32, the VAE's
    decoder, clamp to [-1, 1], then (x + 1) * 127.5 truncated to uint8)."""
    if latents.ndim != 5 or latents.shape[1] != vae.config.z_dim:
        raise InputError(f"latents: expected [B, {vae.config.z_dim}, T, h, w], got {tuple(latents.shape)}")
    p = next(vae.parameters())
    z = latents.float()
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=z.device).view(1, -1, 1, 1, 1)
    x = vae.decode((z * std + mean).to(device=p.device, dtype=p.dtype)).sample.float().clamp(-1.0, 1.0)
    return ((x + 1.0) * 127.5).to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()
