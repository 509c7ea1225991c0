"""What every LeRobot flow-matching policy shares around its model: dtype and engine choice, the tokenizer
rule, the RTC options of config.json, and `FlowPolicy`, the policy API (`predict_chunk`: raw frames and
robot-unit state in, robot-unit actions out, through the checkpoint's own processors).

A model package subclasses `FlowPolicy` with its prompt (`tokenize`), its stages' signatures (`denoise`,
`sample_actions`) and `decide`; everything here knows no model.
"""
from __future__ import annotations

import importlib
import json
import os
import pathlib

import numpy as np
import torch

from flashrt_core.errors import CheckpointError, InputError
from flashrt_core.lerobot.hub_tokenizer import (PALIGEMMA_TOKENIZER, find_tokenizer_file, open_tokenizer,
                                                resolve_tokenizer)
from flashrt_core.lerobot.normalize import Normalizer
from flashrt_core.lerobot.preprocess import preprocess_images
from flashrt_core.lerobot.processors import Processors
from flashrt_core.lerobot.tokenize import TinyTokenizer, Tokenizer, WordTokenizer
from flashrt_core.models.precision import build_engine
from flashrt_core.models.rtc import RTCInputs, RTCOptions, options_from_lerobot, rtc_inputs

ENGINE_CHOICES = ("auto", "fused", "reference")  # auto: the fused engine on CUDA, the reference elsewhere
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
PALIGEMMA_VOCAB = 257152


def resolve_engine(name: str | None, device, model: str = "this model") -> str:
    """"auto" (or None) -> "fused" on CUDA, "reference" elsewhere; other names are checked and kept."""
    if name in (None, "", "auto"):
        return "fused" if torch.device(device).type == "cuda" else "reference"
    if name not in ENGINE_CHOICES:
        raise ValueError(f"engine: {name!r} is not available for {model} (one of {', '.join(ENGINE_CHOICES)})")
    return name


def parse_dtype(dtype, device="cpu") -> torch.dtype:
    """A dtype name or torch.dtype; "auto" (or None) = bfloat16 on CUDA, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r} (one of {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def make_engine(engines: dict, name: str, weights, precision=None, gate: dict | None = None, device=None):
    """The engine `name` of a model's `engines` ({"reference": module, "fused": module}, imported only when
    asked for) over `weights`; a quantized `precision` (`models.precision`) is checked against the unquantized
    reference at build (`gate`: thresholds other than the format's) and refused if it falls short."""
    name = resolve_engine(name, device if device is not None else weights.action_in_w.device)
    try:
        module = importlib.import_module(engines[name])
    except ModuleNotFoundError as e:
        if e.name != engines[name]:
            raise  # the engine exists but one of its own imports is missing
        raise ImportError(f"engine {name!r}: module {engines[name]} is not available in this build") from None
    return build_engine(module, importlib.import_module(engines["reference"]), weights, precision, gate)


class FlowPolicy:
    """A flow-matching policy behind one engine: the model-neutral half (inputs, noise, RTC guidance, the whole
    LeRobot pipeline); a model's subclass gives `tokenize`, `denoise`, `sample_actions` and `decide`."""

    def __init__(self, config, weights, engine, device, dtype: torch.dtype,
                 seed: int = 0, tokenizer: Tokenizer | None = None, processors: Processors | None = None,
                 rtc: RTCOptions | None = None):
        pieces = getattr(tokenizer, "vocab_size", None)
        if pieces is not None and pieces > config.vocab_size:
            raise InputError(f"tokenizer: {pieces} pieces but the model's vocabulary has {config.vocab_size} "
                             "(a tokenizer of another model?)")
        self.config, self.weights, self.engine = config, weights, engine
        self.device, self.dtype, self.tokenizer = torch.device(device), dtype, tokenizer
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.processors = processors
        self.normalizer = processors.normalizer if processors is not None else Normalizer.identity()
        self.rtc = rtc  # real-time chunking (LeRobot's rtc_config): None = a previous chunk is ignored, as there

    # ---- inputs --------------------------------------------------------------------------------------
    def preprocess_images(self, frames, num_slots: int | None = None):
        """Camera frames (uint8 HWC or float CHW in [0, 1]; None = missing) -> (images, masks) on device."""
        return preprocess_images(frames, num_slots or self.config.num_image_slots,
                                 self.config.vision.image_size, device=self.device)

    def make_noise(self, batch: int) -> torch.Tensor:
        return torch.randn((batch, self.config.chunk_size, self.config.action_dim), generator=self.generator,
                           device=self.device, dtype=torch.float32)

    # ---- stages (each engine checks its inputs before it writes anything: `inputs`) ------------------
    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask):
        return self.engine.encode_prefix(images, image_masks, lang_tokens, lang_mask)

    def guidance(self, batch: int, inference_delay=None, prev_chunk_left_over=None, execution_horizon=None):
        """LeRobot's RTC arguments -> `rtc.RTCInputs` on this policy's device, or None where RTC is off (no
        `rtc` options, as a LeRobot config without rtc_config) or no previous chunk is given."""
        if self.rtc is None or prev_chunk_left_over is None:
            return None
        return rtc_inputs(prev_chunk_left_over.to(self.device), 0 if inference_delay is None else inference_delay,
                          execution_horizon, self.rtc, self.config.chunk_size, self.config.action_dim, batch)

    # ---- the whole pipeline ------------------------------------------------------------------------------
    def predict_chunk(self, images, state, task: str, noise=None) -> np.ndarray:
        """LeRobot's `preprocessor -> predict_action_chunk -> postprocessor` for one robot.

        images: raw RGB uint8 HxWx3 frames of any size, one per camera feature of the checkpoint in its order
        (`processors.camera_names`; None = a missing camera); state: robot units, `state_dim` values; task:
        the text; noise: optional [1, chunk, max_action_dim]. -> actions [chunk, action_dim] float32 in robot
        units. A task that does not fit `tokenizer_max_length` tokens with the state is refused (InputError;
        LeRobot would cut the end of the prompt, where the state is, off)."""
        p = self.processors
        if self.normalizer.missing:
            raise CheckpointError(self.normalizer.missing)
        frames = list(images) if isinstance(images, (list, tuple)) else None
        if frames is None:
            raise InputError(f"images: expected a list of frames, one per camera, got {type(images).__name__}")
        if p is not None and p.camera_names and len(frames) != len(p.camera_names):
            raise InputError(f"images: {len(frames)} frames for {len(p.camera_names)} camera features "
                             f"({', '.join(p.camera_names)}); give None for a missing camera")
        raw = _state_vector(state, p.state_dim if p is not None else None)
        imgs, masks = self.preprocess_images(frames)
        actions = self.decide(imgs, masks, self.normalizer.normalize_state(raw), task, noise)
        width = p.action_dim if p is not None and p.action_dim else self.config.action_dim
        out = self.normalizer.unnormalize_actions(actions[0, :, :width].float().cpu())
        if p is not None and p.relative:
            out = out + action_offset(raw, p.relative_mask)
        return out.numpy()

    def decide(self, images, image_masks, state_normalized: torch.Tensor, task: str, noise=None) -> torch.Tensor:
        """One decision from pre-processed images and the normalized state -> model-space actions
        [1, chunk, max_action_dim] (each model puts the state where it goes: the prompt, a state token)."""
        raise NotImplementedError


def action_offset(raw_state: torch.Tensor, mask) -> torch.Tensor:
    """What the absolute-actions step adds: the raw state on the relative columns, 0 on the others."""
    m = torch.tensor(mask, dtype=torch.float32)
    return raw_state[: m.shape[0]].float() * m


def _state_vector(state, dim: int | None) -> torch.Tensor:
    if state is None:
        raise InputError("state: missing (None)")
    try:
        arr = np.asarray(state.detach().cpu() if isinstance(state, torch.Tensor) else state, dtype=np.float32)
    except (TypeError, ValueError):
        raise InputError(f"state: expected numbers, got {type(state).__name__}") from None
    if arr.ndim != 1:
        raise InputError(f"state: expected a 1-D vector, got shape {arr.shape}")
    if dim is not None and arr.shape[0] != dim:
        raise InputError(f"state: {arr.shape[0]} values, the checkpoint's observation.state has {dim}")
    if not np.all(np.isfinite(arr)):
        raise InputError("state: contains NaN or infinity")
    return torch.from_numpy(arr.copy())


def choose_tokenizer(config, folder: pathlib.Path | None, tokenizer=None,
                     processors: Processors | None = None):
    """The one tokenizer rule of the project (policy API and contract runtime alike):
    an explicit tokenizer (object, file or folder) first; then a tokenizer file in the checkpoint folder; a
    LeRobot folder (with its pre-processor file) or a full-size checkpoint: the tokenizer its pre-processor
    names (its tokenizer step), from the hub cache (CheckpointError listing where it looked); small test models:
    TinyTokenizer;
    full size without a checkpoint (benchmarks): WordTokenizer."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    named = processors.tokenizer_name if processors is not None else None
    name = named or PALIGEMMA_TOKENIZER
    if tokenizer:
        return resolve_tokenizer(name, explicit=tokenizer)
    if folder is not None:
        file, _ = find_tokenizer_file(name, folder=folder)
        if file is not None and file.parent == folder:
            return open_tokenizer(file)
        if named or config.vocab_size >= PALIGEMMA_VOCAB:
            return resolve_tokenizer(name, folder=folder)
    if TinyTokenizer.vocab_size <= config.vocab_size < PALIGEMMA_VOCAB:
        return TinyTokenizer()  # a small test model (the built-in one, or a saved copy of it)
    if folder is None:
        return WordTokenizer(config.vocab_size)  # full size, random weights: SentencePiece-like token counts
    raise CheckpointError(f"{folder}: no tokenizer for a vocabulary of {config.vocab_size}")


def checkpoint_folder(ckpt_dir) -> pathlib.Path:
    """The folder of a checkpoint given as its folder or as a file in it."""
    folder = pathlib.Path(ckpt_dir)
    return folder if folder.is_dir() else folder.parent


def with_processor_settings(config, processors: Processors | None):
    """`config` with what the checkpoint's processors decide over config.json: the prompt's padded length (the
    tokenizer step's max_length; every path, `predict_chunk` and the runtime alike, reads it from here)."""
    n = processors.tokenizer_max_length if processors is not None else None
    if n and n != config.tokenizer_max_length:
        import dataclasses

        return dataclasses.replace(config, tokenizer_max_length=n)
    return config


def rtc_options(rtc, folder) -> RTCOptions | None:
    """`load`'s rtc argument: "checkpoint" reads config.json's rtc_config (None without a folder or one)."""
    if rtc != "checkpoint":
        if rtc is not None and not isinstance(rtc, RTCOptions):
            raise ValueError(f"rtc: 'checkpoint', an RTCOptions or None, got {rtc!r}")
        return rtc
    cfg = None if folder is None else folder / "config.json"
    if cfg is None or not cfg.is_file():
        return None
    try:
        return options_from_lerobot(json.loads(cfg.read_text()))
    except ValueError as exc:
        raise CheckpointError(f"{cfg}: {exc}") from None
