"""`load()` -> `Pi05Policy`: a pi0.5 checkpoint (or the built-in tiny model) behind one engine.

An engine is any module with `make_engine(weights)` returning an object with
`encode_prefix(images, image_masks, lang_tokens, lang_mask) -> PrefixCache` and
`denoise(prefix, noise) -> actions` (and optionally `sample_actions(...)`, a whole decision in one go);
"reference" is the eager torch model, "fused" the module `flashrt_core.models.pi05.engine` (imported only
when asked for).
"""
from __future__ import annotations

import importlib
import os
import pathlib

import numpy as np
import torch

from flashrt_core.errors import InputError
from flashrt_core.models.pi05.checkpoint import load_checkpoint
from flashrt_core.models.pi05.config import Pi05Config
from flashrt_core.models.pi05.inputs import check_model_inputs, check_prefix
from flashrt_core.models.pi05.preprocess import preprocess_images
from flashrt_core.models.pi05.prompt import (SentencePieceTokenizer, TinyTokenizer, Tokenizer, format_prompt,
                                             tokenize_prompt)
from flashrt_core.models.pi05.reference import PrefixCache
from flashrt_core.models.pi05.tiny import build_tiny
from flashrt_core.models.pi05.weights import Pi05Weights, convert

ENGINES = {"reference": "flashrt_core.models.pi05.reference", "fused": "flashrt_core.models.pi05.engine"}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
TOKENIZER_FILE = "tokenizer.model"  # an optional PaliGemma SentencePiece model beside the weights
PALIGEMMA_VOCAB = 257152


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r} (one of {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def make_engine(name: str, weights: Pi05Weights):
    if name not in ENGINES:
        raise ValueError(f"engine: unknown {name!r} (one of {', '.join(ENGINES)})")
    try:
        module = importlib.import_module(ENGINES[name])
    except ModuleNotFoundError as e:
        if e.name != ENGINES[name]:
            raise  # the engine exists but one of its own imports is missing
        raise ImportError(f"engine {name!r}: module {ENGINES[name]} is not available in this build") from None
    return module.make_engine(weights)


class Pi05Policy:
    """pi0.5 with LeRobot's `sample_actions` signature, plus the two stages it is made of."""

    def __init__(self, config: Pi05Config, weights: Pi05Weights, engine, device, dtype: torch.dtype,
                 seed: int = 0, tokenizer: Tokenizer | None = None):
        pieces = getattr(tokenizer, "vocab_size", None)
        if pieces is not None and pieces > config.vocab_size:
            raise InputError(f"tokenizer: {pieces} pieces but the model's vocabulary has {config.vocab_size} "
                             "(a tokenizer of another model?)")
        self.config, self.weights, self.engine = config, weights, engine
        self.device, self.dtype, self.tokenizer = torch.device(device), dtype, tokenizer
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    # ---- inputs --------------------------------------------------------------------------------------
    def preprocess_images(self, frames, num_slots: int | None = None):
        """Camera frames (uint8 HWC or float CHW in [0, 1]; None = missing) -> (images, masks) on device."""
        return preprocess_images(frames, num_slots or self.config.num_image_slots,
                                 self.config.vision.image_size, device=self.device)

    def tokenize(self, task: str, state_normalized):
        """Task + normalized state -> (lang_tokens [1, L], lang_mask [1, L]) on device. The state may have at
        most config.state_dim values, and the tokenizer must stay inside the model's vocabulary."""
        if self.tokenizer is None:
            raise InputError(f"tokenizer: none loaded; put {TOKENIZER_FILE} beside the checkpoint or pass tokenizer=")
        shape = tuple(state_normalized.shape) if hasattr(state_normalized, "shape") else np.shape(state_normalized)
        if len(shape) == 1 and shape[0] > self.config.state_dim:  # (other ranks: format_prompt says so)
            raise InputError(f"state: {shape[0]} values but the model takes at most {self.config.state_dim} "
                             "(max_state_dim)")
        tokens, mask = tokenize_prompt(self.tokenizer, format_prompt(task, state_normalized),
                                       self.config.tokenizer_max_length)
        if int(tokens.max()) >= self.config.vocab_size:
            raise InputError(f"tokenizer: id {int(tokens.max())} is outside the model's vocabulary of "
                             f"{self.config.vocab_size} (a tokenizer of another model?)")
        return tokens.to(self.device), mask.to(self.device)

    def make_noise(self, batch: int) -> torch.Tensor:
        return torch.randn((batch, self.config.chunk_size, self.config.action_dim), generator=self.generator,
                           device=self.device, dtype=torch.float32)

    # ---- stages (each engine checks its inputs before it writes anything: `inputs`) ------------------
    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask) -> PrefixCache:
        return self.engine.encode_prefix(images, image_masks, lang_tokens, lang_mask)

    def denoise(self, prefix: PrefixCache, noise: torch.Tensor | None = None) -> torch.Tensor:
        if noise is None:
            noise = self.make_noise(check_prefix(self.config, prefix))
        return self.engine.denoise(prefix, noise)

    def sample_actions(self, images, img_masks, lang_tokens, lang_mask, noise=None) -> torch.Tensor:
        """images [B, S, 3, 224, 224] in [-1, 1] (or a list of S [B, 3, 224, 224] as LeRobot passes them),
        masks [B, S] (or a list of [B]) -> actions [B, chunk, action_dim] fp32 in normalized space."""
        if isinstance(images, (list, tuple)):
            images = torch.stack(list(images), dim=1)
        if isinstance(img_masks, (list, tuple)):  # a [B, S] tensor is already in place (stacking it would
            img_masks = torch.stack(list(img_masks), dim=1)  # transpose it, unnoticed where B == S)
        if img_masks is None:
            raise InputError("img_masks: missing (None); give [B, S] bools or a list of S [B] bools")
        whole = getattr(self.engine, "sample_actions", None)  # the fused engine's one-graph decision
        if whole is None:
            return self.denoise(self.encode_prefix(images, img_masks, lang_tokens, lang_mask), noise)
        if noise is None:  # (the batch size is read from checked inputs: a bad call says what is wrong)
            check_model_inputs(self.config, images, img_masks, lang_tokens, lang_mask)
            noise = self.make_noise(images.shape[0])
        return whole(images, img_masks, lang_tokens, lang_mask, noise)


def _pick_tokenizer(config: Pi05Config, folder: pathlib.Path | None, tokenizer):
    if tokenizer is not None:
        return SentencePieceTokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    if folder is not None and (folder / TOKENIZER_FILE).is_file():
        return SentencePieceTokenizer(folder / TOKENIZER_FILE)
    if TinyTokenizer.vocab_size <= config.vocab_size < PALIGEMMA_VOCAB:
        return TinyTokenizer()  # a small test model (the built-in one, or a saved copy of it)
    return None


def load(ckpt_dir: str | os.PathLike | None = None, device="cpu", dtype="float32", engine: str = "reference",
         seed: int = 0, tokenizer=None) -> Pi05Policy:
    """Load a LeRobot-layout pi0.5 checkpoint (folder or model.safetensors); None or "" = built-in tiny model.

    `seed` seeds the policy's noise generator (and the tiny model's weights); `tokenizer` is a
    SentencePiece model path or a Tokenizer (default: tokenizer.model beside the weights, or TinyTokenizer
    for the built-in model).
    """
    torch_dtype = parse_dtype(dtype)
    if ckpt_dir in (None, ""):
        config, state = build_tiny(seed)
        folder = None
    else:
        config, state = load_checkpoint(ckpt_dir)
        folder = pathlib.Path(ckpt_dir)
        folder = folder if folder.is_dir() else folder.parent
    weights = convert(config, state).to(device=device, dtype=torch_dtype)
    impl = make_engine(engine, weights)
    return Pi05Policy(config, weights, impl, device, torch_dtype, seed=seed,
                      tokenizer=_pick_tokenizer(config, folder, tokenizer))
