"""`load()` -> `Pi05Policy`: a pi0.5 checkpoint (or the built-in tiny model) behind one engine.

An engine is a module with `make_engine(weights, precision)` returning an object with
`encode_prefix(images, image_masks, lang_tokens, lang_mask) -> PrefixCache` and
`denoise(prefix, noise) -> actions` (and optionally `sample_actions(...)`, a whole decision in one go):
`ENGINES["reference"]` is the eager torch model, `ENGINES["fused"]` the fused one (imported only when asked
for); "auto" picks the fused engine on CUDA and the reference on a CPU.

`predict_chunk(images, state, task)` is the whole LeRobot pipeline (pre-processor -> model -> post-processor)
of the checkpoint folder (`flashrt_core.lerobot.policy.FlowPolicy`).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from flashrt_core.errors import InputError
from flashrt_core.lerobot import policy as lerobot_policy
from flashrt_core.lerobot.policy import (FlowPolicy, checkpoint_folder, choose_tokenizer, parse_dtype,
                                         rtc_options, with_processor_settings)
from flashrt_core.lerobot.processors import read_processors
from flashrt_core.lerobot.tokenize import tokenize_prompt
from flashrt_core.models.paligemma.checkpoint import load_checkpoint
from flashrt_core.models.paligemma.inputs import check_model_inputs, check_prefix
from flashrt_core.models.paligemma.reference import PrefixCache
from flashrt_core.models.paligemma.tiny import build_tiny
from flashrt_core.models.pi05.prompt import format_prompt
from flashrt_core.models.pi05.weights import Pi05Weights, convert
from flashrt_core.models.rtc import RTCInputs

ENGINES = {"reference": "flashrt_core.models.pi05.reference", "fused": "flashrt_core.models.pi05.engine"}
ENGINE_CHOICES = ("auto", *ENGINES)


def resolve_engine(name: str | None, device) -> str:
    """"auto" (or None) -> "fused" on CUDA, "reference" elsewhere; other names are checked and kept."""
    return lerobot_policy.resolve_engine(name, device, model="pi0.5")


def make_engine(name: str, weights: Pi05Weights, precision=None, gate: dict | None = None):
    """The engine `name` over `weights` (`lerobot.policy.make_engine`: a quantized precision is gated)."""
    return lerobot_policy.make_engine(ENGINES, name, weights, precision, gate)


class Pi05Policy(FlowPolicy):
    """pi0.5 with LeRobot's `sample_actions` signature, plus the two stages it is made of."""

    def tokenize(self, task: str, state_normalized, truncate: bool = True):
        """Task + normalized state -> (lang_tokens [1, L], lang_mask [1, L]) on device. The state may have at
        most config.state_dim values, and the tokenizer must stay inside the model's vocabulary. truncate:
        cut a long prompt as LeRobot's tokenizer step does (True) or refuse it (False, InputError)."""
        if self.tokenizer is None:
            raise InputError("tokenizer: none loaded; pass tokenizer= (see hub_tokenizer.resolve_tokenizer)")
        shape = tuple(state_normalized.shape) if hasattr(state_normalized, "shape") else np.shape(state_normalized)
        if len(shape) == 1 and shape[0] > self.config.state_dim:  # (other ranks: format_prompt says so)
            raise InputError(f"state: {shape[0]} values but the model takes at most {self.config.state_dim} "
                             "(max_state_dim)")
        tokens, mask = tokenize_prompt(self.tokenizer, format_prompt(task, state_normalized),
                                       self.config.tokenizer_max_length, truncate=truncate)
        if int(tokens.max()) >= self.config.vocab_size:
            raise InputError(f"tokenizer: id {int(tokens.max())} is outside the model's vocabulary of "
                             f"{self.config.vocab_size} (a tokenizer of another model?)")
        return tokens.to(self.device), mask.to(self.device)

    def denoise(self, prefix: PrefixCache, noise: torch.Tensor | None = None, rtc: RTCInputs | None = None
                ) -> torch.Tensor:
        if noise is None:
            noise = self.make_noise(check_prefix(self.config, prefix))
        return self.engine.denoise(prefix, noise, rtc)

    def sample_actions(self, images, img_masks, lang_tokens, lang_mask, noise=None, *, inference_delay=None,
                       prev_chunk_left_over=None, execution_horizon=None) -> torch.Tensor:
        """images [B, S, 3, 224, 224] in [-1, 1] (or a list of S [B, 3, 224, 224] as LeRobot passes them),
        masks [B, S] (or a list of [B]) -> actions [B, chunk, action_dim] fp32 in normalized space. With
        `rtc` options, LeRobot's real-time chunking arguments guide the chunk towards `prev_chunk_left_over`."""
        if isinstance(images, (list, tuple)):
            images = torch.stack(list(images), dim=1)
        if isinstance(img_masks, (list, tuple)):  # a [B, S] tensor is already in place (stacking it would
            img_masks = torch.stack(list(img_masks), dim=1)  # transpose it, unnoticed where B == S)
        if img_masks is None:
            raise InputError("img_masks: missing (None); give [B, S] bools or a list of S [B] bools")
        guide = self.guidance(lang_tokens.shape[0], inference_delay, prev_chunk_left_over, execution_horizon)
        whole = getattr(self.engine, "sample_actions", None)  # the fused engine's one-graph decision
        if whole is None or guide is not None:
            return self.denoise(self.encode_prefix(images, img_masks, lang_tokens, lang_mask), noise, guide)
        if noise is None:  # (the batch size is read from checked inputs: a bad call says what is wrong)
            check_model_inputs(self.config, images, img_masks, lang_tokens, lang_mask)
            noise = self.make_noise(images.shape[0])
        return whole(images, img_masks, lang_tokens, lang_mask, noise)


    def decide(self, images, image_masks, state_normalized: torch.Tensor, task: str, noise=None) -> torch.Tensor:
        """One decision from pre-processed images and the normalized state: pi0.5 prints the state into the
        prompt (refused, never cut, when it does not fit) -> model-space actions [1, chunk, max_action_dim]."""
        tokens, mask = self.tokenize(task, state_normalized, truncate=False)
        return self.sample_actions(images, image_masks, tokens, mask, noise=noise)




def load(ckpt_dir: str | os.PathLike | None = None, device="cpu", dtype="auto", engine: str = "auto",
         seed: int = 0, tokenizer=None, rtc="checkpoint", precision="bf16") -> Pi05Policy:
    """Load a LeRobot pi0.5 checkpoint folder (as `save_pretrained` writes it, processors included; or a bare
    model.safetensors); None or "" = the built-in tiny model.

    dtype "auto" = bfloat16 on CUDA, float32 elsewhere; engine "auto" = fused on CUDA, reference elsewhere;
    `seed` seeds the policy's noise generator (and the tiny model's weights); `tokenizer`: a path or a
    Tokenizer (default: `lerobot.policy.choose_tokenizer`); `rtc`: real-time chunking options ("checkpoint":
    the config.json's rtc_config, as LeRobot reads it; an `rtc.RTCOptions`; None: off); `precision`: "bf16"
    (every weight in `dtype`), "fp8" (the prefix's GEMMs in fp8), "w4a16" (the action expert's weights in 4
    bits), "fp8+w4a16", "fp8+mxfp4", or a mapping per part (`models.precision`), checked at load against the
    unquantized model (PrecisionError with the numbers). A folder without the statistics its config.json
    normalizes with loads for normalized-space use (`sample_actions`); `predict_chunk` refuses it by name.
    """
    torch_dtype = parse_dtype(dtype, device)
    processors = folder = None
    if ckpt_dir in (None, ""):
        config, state = build_tiny(seed)
    else:
        config, state = load_checkpoint(ckpt_dir)
        folder = checkpoint_folder(ckpt_dir)
        processors = read_processors(folder)
        config = with_processor_settings(config, processors)
    weights = convert(config, state).to(device=device, dtype=torch_dtype)
    impl = make_engine(resolve_engine(engine, device), weights, precision)
    return Pi05Policy(config, weights, impl, device, torch_dtype, seed=seed,
                      tokenizer=choose_tokenizer(config, folder, tokenizer, processors), processors=processors,
                      rtc=rtc_options(rtc, folder))
