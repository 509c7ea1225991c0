"""`load()` -> `SmolVLAPolicy`: a SmolVLA checkpoint folder (as LeRobot 0.6.1 saves it) behind one engine, with
the LeRobot pipeline around it (`flashrt_core.lerobot.policy.FlowPolicy`).

What SmolVLA's processors do (LeRobot 0.6.1 `make_smolvla_pre_post_processors`): the task gets a newline
(`smolvla_new_line_processor`), the SmolVLM2 tokenizer encodes it without BOS and truncates it to max_length
(the state is a token of its own, never in the prompt, so cutting the prompt loses no proprioception);
the state is normalized and zero padded to max_state_dim; frames are resized with padding to the model's
square size and scaled to [-1, 1]; actions are un-normalized.
The VLM's configuration (its sizes: LeRobot reads it even without its weights) comes from `vlm=` (a folder),
else the hub cache of the config's `vlm_model_name`.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from flashrt_core.errors import CheckpointError, InputError
from flashrt_core.lerobot import policy as lerobot_policy
from flashrt_core.lerobot.hub_tokenizer import find_hub_folder
from flashrt_core.lerobot.policy import (FlowPolicy, checkpoint_folder, choose_tokenizer, parse_dtype,
                                         rtc_options, with_processor_settings)
from flashrt_core.lerobot.preprocess import preprocess_images
from flashrt_core.lerobot.processors import read_processors
from flashrt_core.lerobot.tokenize import newline_prompt, tokenize_prompt
from flashrt_core.models.rtc import RTCInputs, rtc_inputs
from flashrt_core.models.smolvla.config import SmolVLAConfig
from flashrt_core.models.smolvla.weights import convert

ENGINES = {"reference": "flashrt_core.models.smolvla.reference", "fused": "flashrt_core.models.smolvla.engine"}
ENGINE_CHOICES = ("auto", *ENGINES)
VLM_CONFIG = "config.json"


def resolve_engine(name: str | None, device) -> str:
    """"auto" (or None) -> "fused" on CUDA, "reference" elsewhere; other names are checked and kept."""
    return lerobot_policy.resolve_engine(name, device, model="SmolVLA")


def make_engine(name: str, weights, precision=None, gate: dict | None = None):
    """The engine `name` over `weights` (`lerobot.policy.make_engine`: a quantized precision is gated)."""
    return lerobot_policy.make_engine(ENGINES, name, weights, precision, gate)


smolvla_prompt = newline_prompt  # the text LeRobot's SmolVLA tokenizes (its smolvla_new_line_processor)


class SmolVLAPolicy(FlowPolicy):
    """SmolVLA with LeRobot's `model.sample_actions(images, img_masks, lang_tokens, lang_masks, state, noise=)`,
    its two stages (`encode_prefix` with the state: it is a prefix token; `denoise(prefix, noise, rtc)`),
    LeRobot's real-time chunking (`sample_actions(..., inference_delay=, prev_chunk_left_over=,
    execution_horizon=)` with config.json's rtc_config) and `predict_chunk` (`FlowPolicy`'s)."""

    def preprocess_images(self, frames, num_slots: int | None = None):
        return preprocess_images(frames, num_slots or self.config.num_image_slots, self.config.image_size,
                                 device=self.device, pad="top_left")

    def tokenize(self, task: str, state_normalized=None, truncate: bool = True):
        """Task -> (lang_tokens [1, L], lang_mask [1, L]) on device, cut at L as LeRobot cuts it."""
        if self.tokenizer is None:
            raise InputError("tokenizer: none loaded; pass tokenizer=")
        tokens, mask = tokenize_prompt(self.tokenizer, smolvla_prompt(task), self.config.tokenizer_max_length,
                                       truncate=truncate, bos=False)
        if int(tokens.max()) >= self.config.vocab_size:
            raise InputError(f"tokenizer: id {int(tokens.max())} is outside the model's vocabulary of "
                             f"{self.config.vocab_size} (a tokenizer of another model?)")
        return tokens.to(self.device), mask.to(self.device)

    def padded_state(self, state: torch.Tensor) -> torch.Tensor:
        """[B, n <= max_state_dim] normalized -> [B, max_state_dim] fp32 on device (LeRobot's pad_vector)."""
        n = state.shape[-1]
        if n > self.config.max_state_dim:
            raise InputError(f"state: {n} values but the model takes at most {self.config.max_state_dim}")
        return F.pad(state.float(), (0, self.config.max_state_dim - n)).to(self.device)

    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask, state):
        return self.engine.encode_prefix(images, image_masks, lang_tokens, lang_mask, self.padded_state(state))

    def denoise(self, prefix, noise: torch.Tensor | None = None, rtc: RTCInputs | None = None) -> torch.Tensor:
        """prefix (`encode_prefix`) + noise [B, chunk, max_action_dim] (None: drawn) -> actions; `rtc`
        (`guidance`): every flow step guided towards the previous chunk (LeRobot's real-time chunking)."""
        if noise is None:
            noise = self.make_noise(prefix.pad_mask.shape[0])
        return self.engine.denoise(prefix, noise, rtc)

    def guidance(self, batch: int, inference_delay=None, prev_chunk_left_over=None, execution_horizon=None):
        """LeRobot's RTC arguments -> `rtc.RTCInputs` [B, chunk, max_action_dim] (SmolVLA's flow is max_action_dim
        wide; a narrower previous chunk is zero padded, as LeRobot pads it), or None where RTC is off (no `rtc`
        options: a previous chunk is ignored, as LeRobot ignores it without rtc_config) or none is given."""
        if self.rtc is None or prev_chunk_left_over is None:
            return None
        return rtc_inputs(prev_chunk_left_over.to(self.device), 0 if inference_delay is None else inference_delay,
                          execution_horizon, self.rtc, self.config.chunk_size, self.config.max_action_dim, batch)

    def sample_actions(self, images, img_masks, lang_tokens, lang_mask, state, noise=None, *, inference_delay=None,
                       prev_chunk_left_over=None, execution_horizon=None) -> torch.Tensor:
        """images [B, S, 3, size, size] in [-1, 1] (or a list of S [B, 3, size, size]), masks [B, S] (or a list),
        state [B, <= max_state_dim] normalized -> actions [B, chunk, max_action_dim] fp32 in normalized space. With
        `rtc` options (config.json's rtc_config), LeRobot's real-time chunking arguments guide the chunk towards
        `prev_chunk_left_over` [B, T <= chunk, <= max_action_dim] (model space)."""
        if isinstance(images, (list, tuple)):
            images = torch.stack(list(images), dim=1)
        if isinstance(img_masks, (list, tuple)):
            img_masks = torch.stack(list(img_masks), dim=1)
        if img_masks is None:
            raise InputError("img_masks: missing (None); give [B, S] bools or a list of S [B] bools")
        guide = self.guidance(lang_tokens.shape[0], inference_delay, prev_chunk_left_over, execution_horizon)
        if guide is not None:  # the two stages (the fused engine's one-graph decision runs the plain flow)
            prefix = self.encode_prefix(images, img_masks, lang_tokens, lang_mask, state)
            return self.denoise(prefix, None if noise is None else noise.to(self.device), guide)
        if noise is None:
            noise = self.make_noise(images.shape[0])
        return self.engine.sample_actions(images, img_masks, lang_tokens, lang_mask, self.padded_state(state),
                                          noise.to(self.device))

    def make_noise(self, batch: int) -> torch.Tensor:
        return torch.randn((batch, self.config.chunk_size, self.config.max_action_dim), generator=self.generator,
                           device=self.device, dtype=torch.float32)

    def decide(self, images, image_masks, state_normalized: torch.Tensor, task: str, noise=None) -> torch.Tensor:
        tokens, mask = self.tokenize(task)
        return self.sample_actions(images, image_masks, tokens, mask, state_normalized[None], noise=noise)


def read_config(folder, vlm=None) -> SmolVLAConfig:
    """The sizes of the checkpoint in `folder`: its config.json and the VLM's (see the module docstring)."""
    cfg_file = folder / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{cfg_file}: not readable ({exc})") from None
    name = cfg.get("vlm_model_name") or "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    vlm_folder = find_hub_folder(name, VLM_CONFIG, explicit=vlm,
                                 how="contract model.options.vlm, or smolvla.load(DIR, vlm=FOLDER)")
    return SmolVLAConfig.from_lerobot(cfg, json.loads((vlm_folder / VLM_CONFIG).read_text())), vlm_folder


def load(ckpt_dir: str | os.PathLike, device="cpu", dtype="auto", engine: str = "auto", seed: int = 0,
         tokenizer=None, rtc="checkpoint", precision="bf16", vlm=None) -> SmolVLAPolicy:
    """Load a LeRobot SmolVLA checkpoint folder (config.json, model.safetensors and the processors, as
    `save_pretrained` writes them). dtype / engine / seed / precision as `pi05.load`'s; `tokenizer`: a path or a
    Tokenizer (default: the SmolVLM2 tokenizer beside the VLM config, else the hub cache); `vlm`: the folder of
    the VLM's config.json (default: the hub cache of its vlm_model_name). A folder without the statistics
    its config.json normalizes with loads for `sample_actions`; `predict_chunk` refuses it by name."""
    from safetensors.torch import load_file

    if ckpt_dir in (None, ""):
        raise CheckpointError("SmolVLA needs a checkpoint folder (there is no built-in SmolVLA model)")
    name = resolve_engine(engine, device)
    torch_dtype = parse_dtype(dtype, device)
    folder = checkpoint_folder(ckpt_dir)
    config, vlm_folder = read_config(folder, vlm)
    processors = read_processors(folder)
    config = with_processor_settings(config, processors)
    try:
        state = load_file(str(folder / "model.safetensors"))
    except Exception as exc:  # a missing, truncated or non-safetensors file
        raise CheckpointError(f"{folder / 'model.safetensors'}: unreadable ({exc})") from None
    weights = convert(config, state).to(device=device, dtype=torch_dtype)
    if tokenizer is None:
        tokenizer = vlm_folder  # (the tokenizer.json beside the VLM's config, as the hub snapshot holds it)
    return SmolVLAPolicy(config, weights, make_engine(name, weights, precision), device, torch_dtype, seed=seed,
                         tokenizer=choose_tokenizer(config, folder, tokenizer, processors), processors=processors,
                         rtc=rtc_options(rtc, folder))
