"""`load()` -> `FastWAMPolicy`: a FastWAM checkpoint folder (as LeRobot 0.6.1 saves it) with its frozen encoders,
behind the fp32 reference, and the LeRobot pipeline around it (`flashrt_core.lerobot.policy.FlowPolicy`).

What LeRobot 0.6.1 does around `FastWAM.infer_action` (`processor_fastwam.py`, `modeling_fastwam.py`):
- pre-processor: rename (empty), batch, device, normalizer (state MEAN_STD; images IDENTITY, in [0, 1]). No
  resize and no tokenizer step: the policy does both.
- `predict_action_chunk`: the camera features in **sorted** key order, each resized to (H, W // N) (bilinear,
  antialias, half-pixel centres; untouched when already that size) and put side by side along the width, then the
  whole resized to `image_size` (a no-op unless W is not a multiple of N). Any aspect is accepted (LeRobot resizes
  rather than refuses). The prompt is `prompt_template.format(task=task)`, tokenized by the UMT5 tokenizer
  (padded / truncated to `tokenizer_max_len`) and encoded by UMT5; the normalized state is the proprio token.
  The action noise is `randn((1, horizon, action_dim), generator=Generator(rand_device).manual_seed(seed))` with
  `seed` = batch["seed"], default config.json's `inference_seed` (42): `predict_chunk(..., seed=)` is that.
- post-processor: un-normalize (MEAN_STD) -> cpu. A checkpoint with LeRobot's `fastwam_action_toggle_processor`
  (non-empty `toggle_action_dimensions`) is refused by `read_processors`, by that step's name.

The frozen parts are found as LeRobot finds them (offline): the Wan2.2 VAE in `Wan-AI/Wan2.2-TI2V-5B-Diffusers`
subfolder `vae`, the UMT5 encoder in config.json's `text_encoder_model_id` subfolder `text_encoder`, the tokenizer
in `tokenizer_model_id` (`google/umt5-xxl`), each in the hub cache (`find_hub_folder`) unless given as a folder
(`vae=`, `text_encoder=`, `tokenizer=`).
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flashrt_core.errors import CheckpointError, InputError
from flashrt_core.lerobot.hub_tokenizer import find_hub_folder, hub_cache_dirs
from flashrt_core.lerobot.policy import FlowPolicy, checkpoint_folder, parse_dtype
from flashrt_core.lerobot.preprocess import to_batched_chw_float01
from flashrt_core.lerobot.processors import read_processors
from flashrt_core.models.fastwam import encoders, reference
from flashrt_core.models.fastwam.config import FastWAMConfig
from flashrt_core.models.fastwam.weights import convert

ENGINE_CHOICES = ("auto", "reference")
VAE_REPO = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"  # a constant in LeRobot (load_pretrained_wan_vae), not a config field
PROMPT_TEMPLATE = "A video recorded from a robot's point of view executing the following instruction: {task}"
# (the files each frozen part needs, `encoders`'; the first is what the hub cache is searched for)
VAE_FILES, TEXT_ENCODER_FILES, TOKENIZER_FILES = encoders.VAE_FILES, encoders.TEXT_ENCODER_FILES, encoders.TOKENIZER_FILES


def resolve_engine(name: str | None) -> str:
    """"auto" (or None) -> "reference" (FastWAM's only engine so far); "fused" is refused by name."""
    if name in (None, "", "auto", "reference"):
        return "reference"
    if name == "fused":
        raise ValueError("engine 'fused': FastWAM has no fused engine yet; use engine='reference' (or 'auto')")
    raise ValueError(f"engine: {name!r} is not available for FastWAM (one of {', '.join(ENGINE_CHOICES)})")


class ReferenceEngine:
    """The eager fp32 reference (`reference.py`) over one set of weights, as an engine object."""

    name = "reference"

    def __init__(self, weights):
        self.weights = weights

    def prefill(self, video_latents, text_emb, state=None, text_mask=None) -> reference.VideoCache:
        return reference.prefill(self.weights, video_latents, text_emb, state, text_mask)

    def denoise(self, cache: reference.VideoCache, noise: torch.Tensor) -> torch.Tensor:
        return reference.denoise(self.weights, cache, noise)

    def sample_actions(self, video_latents, text_emb, state, noise, text_mask=None) -> torch.Tensor:
        return reference.sample_actions(self.weights, video_latents, text_emb, state, noise, text_mask)


@dataclass(frozen=True)
class Settings:
    """What config.json decides around the model (LeRobot's FastWAMConfig fields the sizes do not hold)."""
    prompt_template: str = PROMPT_TEMPLATE
    inference_seed: int | None = 42
    rand_device: str = "cpu"
    text_encoder_repo: str = VAE_REPO
    tokenizer_repo: str = "google/umt5-xxl"


class FastWAMPolicy(FlowPolicy):
    """FastWAM with the reference's stages (`prefill(video_latents, text_emb, state)` -> video cache,
    `denoise(cache, noise)`, `sample_actions(video_latents, text_emb, state, noise)`), the encoders in front of them
    (`tokenize`, `encode_prompt`, `encode_image`) and `predict_chunk` (LeRobot's whole pipeline)."""

    def __init__(self, config: FastWAMConfig, weights, engine, device, dtype, *, settings: Settings, vae,
                 text_encoder, tokenizer, seed: int = 0, processors=None):
        # (FlowPolicy's vocabulary check is for the VLA's own tokenizers; FastWAM's prompt goes to UMT5)
        super().__init__(config, weights, engine, device, dtype, seed=seed, tokenizer=None, processors=processors)
        self.tokenizer, self.vae, self.text_encoder, self.settings = tokenizer, vae, text_encoder, settings

    # ---- inputs ------------------------------------------------------------------------------------
    def camera_order(self) -> list[int]:
        """Indices into the checkpoint's camera features (config order) in LeRobot's concatenation order."""
        names = self.processors.camera_names if self.processors is not None else ()
        return sorted(range(len(names)), key=lambda i: names[i])

    def preprocess_images(self, frames, num_slots=None):
        """Frames (one per camera feature, in config.json's order; uint8 HxWx3 or float CHW in [0, 1]) ->
        (input_image [1, 3, H, W] in [0, 1] on device, None): LeRobot's `_stack_video_from_images` +
        `_prepare_infer_image`."""
        names = list(self.processors.camera_names) if self.processors is not None else []
        if not names:
            names = [f"camera{i}" for i in range(len(frames))]
        if len(frames) != len(names):
            raise InputError(f"images: {len(frames)} frames for {len(names)} camera features ({', '.join(names)})")
        for name, f in zip(names, frames):
            if f is None:
                raise InputError(f"images: camera {name} is missing; FastWAM puts every camera side by side in "
                                 "one image (LeRobot would silently widen the others), so each frame is needed")
        return stack_cameras([frames[i] for i in sorted(range(len(names)), key=lambda i: names[i])],
                             self.config.image_size, self.device), None

    def prompt(self, task: str) -> str:
        if not isinstance(task, str):
            raise InputError(f"task: expected a string, got {type(task).__name__}")
        return self.settings.prompt_template.format(task=task)

    def tokenize(self, task: str):
        """Task -> (ids [1, L], mask [1, L] bool), L = tokenizer_max_len, truncated as LeRobot's WanTokenizer."""
        from flashrt_core.models.fastwam.encoders import tokenize

        return tokenize(self.tokenizer, self.prompt(task), self.config.context_len)

    def encode_prompt(self, task: str) -> torch.Tensor:
        """Task -> text_emb [1, L, text_dim] fp32 on device (UMT5, padding rows zeroed; its mask is all true)."""
        from flashrt_core.models.fastwam.encoders import encode_prompt

        ids, mask = self.tokenize(task)
        return encode_prompt(self.text_encoder, ids, mask).to(self.device)

    def encode_image(self, input_image: torch.Tensor) -> torch.Tensor:
        """input_image [B, 3, H, W] in [0, 1] -> standardized first-frame latents [B, z, 1, H/16, W/16] fp32."""
        from flashrt_core.models.fastwam.encoders import encode_first_frame

        return encode_first_frame(self.vae, input_image).to(self.device)

    def make_noise(self, batch: int = 1, seed: int | None = None) -> torch.Tensor:
        """LeRobot's action noise: [1, horizon, action_dim] fp32 from a generator on `rand_device` seeded with
        `seed` (None: config.json's inference_seed, as `batch.get("seed", config.inference_seed)`), per sample."""
        seed = self.settings.inference_seed if seed is None else seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            if seed is None:  # inference_seed null in config.json: LeRobot draws unseeded noise
                gen = None
            else:
                raise InputError(f"seed: expected an integer, got {seed!r}")
        else:
            gen = torch.Generator(device=self.settings.rand_device).manual_seed(int(seed))
        one = torch.randn((1, self.config.action_horizon, self.config.action_dim), generator=gen,
                          device=self.settings.rand_device, dtype=torch.float32)
        return one.expand(batch, -1, -1).contiguous().to(self.device)

    # ---- stages (the reference's signatures) ---------------------------------------------------------
    def prefill(self, video_latents, text_emb, state=None, text_mask=None) -> reference.VideoCache:
        """First-frame latents [B, z, 1, h, w], text_emb [B, L, text_dim], state [B, proprio] normalized -> cache."""
        return self.engine.prefill(video_latents.to(self.device), text_emb.to(self.device),
                                   None if state is None else state.float().to(self.device), text_mask)

    def denoise(self, cache: reference.VideoCache, noise: torch.Tensor | None = None, seed: int | None = None):
        """cache + noise [B, horizon, action_dim] (None: `make_noise(seed)`) -> actions, normalized space."""
        if noise is None:
            noise = self.make_noise(cache.k.shape[1], seed)
        return self.engine.denoise(cache, noise.float().to(self.device))

    def sample_actions(self, video_latents, text_emb, state, noise=None, text_mask=None, seed=None) -> torch.Tensor:
        """LeRobot's infer_action from the encoders' outputs on -> actions [B, horizon, action_dim] (normalized)."""
        return self.denoise(self.prefill(video_latents, text_emb, state, text_mask), noise, seed)

    def decide(self, images, image_masks, state_normalized: torch.Tensor, task: str, noise=None) -> torch.Tensor:
        latents = self.encode_image(images)
        return self.sample_actions(latents, self.encode_prompt(task), state_normalized[None], noise=noise)

    # ---- the whole pipeline ------------------------------------------------------------------------------
    def predict_chunk(self, images, state, task: str, noise=None, seed: int | None = None) -> np.ndarray:
        """LeRobot's `preprocessor -> predict_action_chunk -> postprocessor` for one robot: images (a list in
        config.json's camera order, or a dict by feature name or its last part), robot-unit state, task ->
        actions [horizon, action_dim] float32 in robot units. The noise is LeRobot's: drawn from `seed` (None:
        config.json's inference_seed), or given as `noise` [1, horizon, action_dim]."""
        if isinstance(images, dict):
            images = self._frames_from_dict(images)
        if noise is not None and seed is not None:
            raise InputError("noise and seed: give one of them (the seed only draws the noise)")
        if noise is None:
            noise = self.make_noise(1, seed)
        return super().predict_chunk(images, state, task, noise=noise)

    def _frames_from_dict(self, images: dict) -> list:
        names = list(self.processors.camera_names) if self.processors is not None else []
        out = []
        for n in names:
            f = images.get(n, images.get(n.split(".")[-1]))
            if f is None:
                raise InputError(f"images: camera {n} is missing (given: {', '.join(map(str, images))})")
            out.append(f)
        extra = set(images) - set(names) - {n.split(".")[-1] for n in names}
        if extra:
            raise InputError(f"images: {', '.join(sorted(map(str, extra)))} not among the checkpoint's cameras "
                             f"({', '.join(names)})")
        return out


def resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[B, C, H, W] -> size (bilinear, antialias, half-pixel centres); untouched when already that size."""
    if tuple(img.shape[-2:]) == tuple(size):
        return img
    return F.interpolate(img, size=tuple(size), mode="bilinear", align_corners=False, antialias=True)


def stack_cameras(frames, image_size: tuple[int, int], device=None) -> torch.Tensor:
    """Frames already in LeRobot's (sorted-key) order -> [B, 3, H, W] in [0, 1]: each resized to (H, W // N), side
    by side along the width, then resized to image_size (a no-op unless W % N)."""
    if not frames:
        raise InputError("images: no camera frames")
    h, w = int(image_size[0]), int(image_size[1])
    if w // len(frames) < 1:
        raise InputError(f"images: {len(frames)} cameras do not fit side by side in a width of {w}")
    per_cam = (h, w // len(frames))
    imgs = [resize(to_batched_chw_float01(f, i, device), per_cam) for i, f in enumerate(frames)]
    if len({x.shape[0] for x in imgs}) != 1:
        raise InputError(f"images: batch sizes differ ({', '.join(str(x.shape[0]) for x in imgs)})")
    return resize(torch.cat(imgs, dim=-1), (h, w))


# ---- the frozen parts ----------------------------------------------------------------------------------------
def _fetch_command(repo: str, sub: str | None) -> str:
    return f"`hf download {repo}" + (f" --include '{sub}/*'`" if sub else "`")


def _alternatives(files) -> list[tuple[str, ...]]:
    """Each needed file as its alternatives (a weights file, or its shard index)."""
    return [(f,) if isinstance(f, str) else tuple(f) for f in files]


def _names(files) -> list[str]:
    return [" or ".join(alts) for alts in _alternatives(files)]


def frozen_folder(what: str, repo: str, sub: str | None, files: tuple[str, ...], explicit=None,
                  arg: str = "") -> pathlib.Path:
    """The folder of one frozen part: `explicit` (a folder) or `repo`'s snapshot (its `sub` folder) in the hub
    cache, offline. CheckpointError naming the missing file, where it looked and the `hf download` command."""
    fetch = _fetch_command(repo, sub)
    give = f", or give its folder (fastwam.load(DIR, {arg}=FOLDER))" if arg else ""
    if explicit is not None:
        folder = pathlib.Path(explicit).expanduser()
        if not folder.is_dir():
            raise CheckpointError(f"{what}: {folder} is not a folder (it should hold {', '.join(_names(files))}). "
                                  f"Fetch it once with {fetch}{give}")
    else:
        rel = f"{sub}/{files[0]}" if sub else files[0]
        try:
            snap = find_hub_folder(repo, rel)
        except CheckpointError:
            looked = ", ".join(str(c / ("models--" + repo.replace("/", "--"))) for c in hub_cache_dirs())
            raise CheckpointError(f"{what}: {rel} of {repo} not found in the hub cache (looked in {looked}). "
                                  f"Fetch it once with {fetch}{give}") from None
        folder = snap / sub if sub else snap
    missing = [" or ".join(str(folder / f) for f in alts) for alts in _alternatives(files)
               if not any((folder / f).is_file() for f in alts)]
    if missing:
        raise CheckpointError(f"{what}: {'; '.join(missing)} not found (LeRobot's "
                              f"FastWAM reads it from {repo}" + (f", subfolder {sub}" if sub else "")
                              + f"). Fetch it once with {fetch}{give}")
    return folder


def read_settings(cfg: dict) -> Settings:
    template = cfg.get("prompt_template", PROMPT_TEMPLATE)
    if not isinstance(template, str) or "{task}" not in template:
        raise CheckpointError(f"config.json prompt_template: expected a string with {{task}}, got {template!r}")
    seed = cfg.get("inference_seed", 42)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise CheckpointError(f"config.json inference_seed: expected an integer or null, got {seed!r}")
    rand_device = cfg.get("rand_device", "cpu")
    if not isinstance(rand_device, str):
        raise CheckpointError(f"config.json rand_device: expected a device name, got {rand_device!r}")
    if cfg.get("toggle_action_dimensions"):
        raise CheckpointError(f"config.json toggle_action_dimensions {cfg['toggle_action_dimensions']!r}: "
                              "LeRobot's fastwam_action_toggle_processor is not implemented in FlashRT; refusing "
                              "the checkpoint rather than skipping the step")
    return Settings(prompt_template=template, inference_seed=seed, rand_device=rand_device,
                    text_encoder_repo=str(cfg.get("text_encoder_model_id") or VAE_REPO),
                    tokenizer_repo=str(cfg.get("tokenizer_model_id") or "google/umt5-xxl"))


def load(ckpt_dir: str | os.PathLike, device="cpu", dtype="auto", engine: str = "auto", seed: int = 0, vae=None,
         text_encoder=None, tokenizer=None) -> FastWAMPolicy:
    """Load a LeRobot FastWAM checkpoint folder (config.json, model.safetensors and the processors, as
    `save_pretrained` writes them) with its frozen VAE, UMT5 encoder and tokenizer (each: a folder, a loaded
    module, or None = the hub cache under LeRobot's names). dtype: "auto" = bfloat16 on CUDA, float32 elsewhere
    (the DiTs and the encoders). engine: "auto" / "reference". seed: FlowPolicy's generator (FastWAM's noise
    follows config.json's inference_seed, as LeRobot's, unless predict_chunk is given `seed=` or `noise=`). A
    folder without the statistics its config.json normalizes with loads for `sample_actions`; `predict_chunk`
    refuses it by name."""
    from safetensors.torch import load_file

    if ckpt_dir in (None, ""):
        raise CheckpointError("FastWAM needs a checkpoint folder (there is no built-in FastWAM model)")
    name = resolve_engine(engine)
    torch_dtype = parse_dtype(dtype, device)
    folder = checkpoint_folder(ckpt_dir)
    cfg_file = folder / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{cfg_file}: not readable ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object")
    config = FastWAMConfig.from_lerobot(cfg)
    settings = read_settings(cfg)
    processors = read_processors(folder)
    n_state = processors.state_dim
    if n_state is not None and config.proprio_dim is not None and n_state != config.proprio_dim:
        raise CheckpointError(f"{cfg_file}: observation.state has {processors.state_dim} values, proprio_dim is "
                              f"{config.proprio_dim}")
    if processors.action_dim is not None and processors.action_dim != config.action_dim:
        raise CheckpointError(f"{cfg_file}: action has {processors.action_dim} values, action_dim is "
                              f"{config.action_dim}")
    try:
        state = load_file(str(folder / "model.safetensors"))
    except Exception as exc:  # a missing, truncated or non-safetensors file
        raise CheckpointError(f"{folder / 'model.safetensors'}: unreadable ({exc})") from None
    weights = convert(config, state).to(device=device, dtype=torch_dtype)

    def part(given, what, repo, sub, files, arg, loader, **kw):
        if given is not None and not isinstance(given, (str, os.PathLike)):
            return given  # already loaded
        return loader(frozen_folder(what, repo, sub, files, given, arg), **kw)

    vae_m = part(vae, "Wan2.2 VAE", VAE_REPO, "vae", VAE_FILES, "vae", encoders.load_vae, dtype=torch_dtype,
                 device=device)
    enc_m = part(text_encoder, "UMT5 text encoder", settings.text_encoder_repo, "text_encoder", TEXT_ENCODER_FILES,
                 "text_encoder", encoders.load_text_encoder, dtype=torch_dtype, device=device)
    tok = part(tokenizer, "UMT5 tokenizer", settings.tokenizer_repo, None, TOKENIZER_FILES, "tokenizer",
               encoders.load_tokenizer)
    z = getattr(getattr(vae_m, "config", None), "z_dim", config.latent_channels)
    if z != config.latent_channels:
        raise CheckpointError(f"Wan2.2 VAE: z_dim {z}, the video DiT takes {config.latent_channels} channels")
    d = getattr(getattr(enc_m, "config", None), "d_model", config.text_dim)
    if d != config.text_dim:
        raise CheckpointError(f"UMT5 text encoder: d_model {d}, the DiTs' text_dim is {config.text_dim}")
    return FastWAMPolicy(config, weights, ReferenceEngine(weights), device, torch_dtype, settings=settings,
                         vae=vae_m, text_encoder=enc_m, tokenizer=tok, seed=seed, processors=processors)
