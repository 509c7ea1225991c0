"""`load()` -> `Pi0Policy`: a pi0 checkpoint behind pi0's engine, with the LeRobot pipeline around it
(`flashrt_core.lerobot.policy.FlowPolicy`).

What differs from pi0.5 (LeRobot 0.6.1's pi0 processors): the prompt is the task with a newline appended
(no cleaning, no state in it); the normalized state goes to the model as a tensor (zero padded to
max_state_dim) and is read by every act step, not by the prefix.
"""
from __future__ import annotations

import os

import torch

from flashrt_core.errors import CheckpointError, InputError
from flashrt_core.lerobot import policy as lerobot_policy
from flashrt_core.lerobot.policy import (FlowPolicy, checkpoint_folder, choose_tokenizer, parse_dtype,
                                         rtc_options, with_processor_settings)
from flashrt_core.lerobot.processors import read_processors
from flashrt_core.lerobot.tokenize import newline_prompt, tokenize_prompt
from flashrt_core.models.paligemma.checkpoint import load_checkpoint
from flashrt_core.models.paligemma.inputs import check_model_inputs
from flashrt_core.models.pi0.weights import convert
from flashrt_core.models.rtc import RTCInputs

ENGINES = {"reference": "flashrt_core.models.pi0.reference", "fused": "flashrt_core.models.pi0.engine"}
ENGINE_CHOICES = ("auto", *ENGINES)


def resolve_engine(name: str | None, device) -> str:
    """"auto" (or None) -> "fused" on CUDA, "reference" elsewhere; other names are checked and kept."""
    return lerobot_policy.resolve_engine(name, device, model="pi0")


def make_engine(name: str, weights, precision=None, gate: dict | None = None):
    """The engine `name` over `weights` (`lerobot.policy.make_engine`: a quantized precision is gated)."""
    return lerobot_policy.make_engine(ENGINES, name, weights, precision, gate)


pi0_prompt = newline_prompt  # the text LeRobot's pi0 tokenizes (its pi0_new_line_processor)


class Pi0Policy(FlowPolicy):
    """pi0 with LeRobot's `model.sample_actions(images, img_masks, lang_tokens, lang_mask, state, noise=)`,
    its two stages (`encode_prefix`; `denoise(prefix, state, noise)`) and `predict_chunk` (`FlowPolicy`'s)."""

    def tokenize(self, task: str, state_normalized=None, truncate: bool = True):
        """Task -> (lang_tokens [1, L], lang_mask [1, L]) on device (pi0's prompt holds no state)."""
        if self.tokenizer is None:
            raise InputError("tokenizer: none loaded; pass tokenizer=")
        tokens, mask = tokenize_prompt(self.tokenizer, pi0_prompt(task), self.config.tokenizer_max_length,
                                       truncate=truncate)
        if int(tokens.max()) >= self.config.vocab_size:
            raise InputError(f"tokenizer: id {int(tokens.max())} is outside the model's vocabulary of "
                             f"{self.config.vocab_size} (a tokenizer of another model?)")
        return tokens.to(self.device), mask.to(self.device)

    def denoise(self, prefix, state: torch.Tensor, noise: torch.Tensor | None = None,
                rtc: RTCInputs | None = None) -> torch.Tensor:
        if noise is None:
            noise = self.make_noise(prefix.pad_mask.shape[0])
        return self.engine.denoise(prefix, state.to(self.device), noise, rtc)

    def sample_actions(self, images, img_masks, lang_tokens, lang_mask, state, noise=None, *, inference_delay=None,
                       prev_chunk_left_over=None, execution_horizon=None) -> torch.Tensor:
        """images [B, S, 3, 224, 224] in [-1, 1] (or a list of S [B, 3, 224, 224]), masks [B, S] (or a list),
        state [B, <= max_state_dim] normalized -> actions [B, chunk, action_dim] fp32 in normalized space. With
        `rtc` options, LeRobot's real-time chunking arguments guide the chunk towards `prev_chunk_left_over`."""
        if isinstance(images, (list, tuple)):
            images = torch.stack(list(images), dim=1)
        if isinstance(img_masks, (list, tuple)):
            img_masks = torch.stack(list(img_masks), dim=1)
        if img_masks is None:
            raise InputError("img_masks: missing (None); give [B, S] bools or a list of S [B] bools")
        check_model_inputs(self.config, images, img_masks, lang_tokens, lang_mask)
        guide = self.guidance(lang_tokens.shape[0], inference_delay, prev_chunk_left_over, execution_horizon)
        whole = getattr(self.engine, "sample_actions", None)  # the fused engine's one-graph decision
        if whole is None or guide is not None:
            return self.denoise(self.encode_prefix(images, img_masks, lang_tokens, lang_mask), state, noise, guide)
        if noise is None:
            noise = self.make_noise(images.shape[0])
        return whole(images, img_masks, lang_tokens, lang_mask, state.to(self.device), noise)

    def decide(self, images, image_masks, state_normalized: torch.Tensor, task: str, noise=None) -> torch.Tensor:
        tokens, mask = self.tokenize(task, truncate=False)
        return self.sample_actions(images, image_masks, tokens, mask, state_normalized[None], noise=noise)


def load(ckpt_dir: str | os.PathLike, device="cpu", dtype="auto", engine: str = "auto", seed: int = 0,
         tokenizer=None, rtc="checkpoint", precision="bf16") -> Pi0Policy:
    """Load a LeRobot pi0 checkpoint folder (as `save_pretrained` writes it, processors included).

    dtype "auto" = bfloat16 on CUDA, float32 elsewhere; engine "auto" = fused on CUDA, reference elsewhere
    ("fused": `engine.Pi0Engine`, "reference": the eager model); `tokenizer`: a path or a Tokenizer (default:
    the one the pre-processor names, from the hub cache); `rtc`: real-time chunking options ("checkpoint": the
    config.json's rtc_config; an `rtc.RTCOptions`; None: off); `precision`: as `pi05.load`'s."""
    name = resolve_engine(engine, device)
    torch_dtype = parse_dtype(dtype, device)
    config, state = load_checkpoint(ckpt_dir)
    if config.kind != "pi0":
        raise CheckpointError(f"{ckpt_dir}: a {config.kind} checkpoint (flashrt_core.models.{config.kind}.load)")
    folder = checkpoint_folder(ckpt_dir)
    processors = read_processors(folder)
    config = with_processor_settings(config, processors)
    weights = convert(config, state).to(device=device, dtype=torch_dtype)
    return Pi0Policy(config, weights, make_engine(name, weights, precision), device, torch_dtype, seed=seed,
                     tokenizer=choose_tokenizer(config, folder, tokenizer, processors), processors=processors,
                     rtc=rtc_options(rtc, folder))


__all__ = ["ENGINES", "Pi0Policy", "load", "make_engine", "pi0_prompt", "resolve_engine"]
