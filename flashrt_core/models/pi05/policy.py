"""`load()` -> `Pi05Policy`: a pi0.5 checkpoint (or the built-in tiny model) behind one engine.

An engine is any module with `make_engine(weights)` returning an object with
`encode_prefix(images, image_masks, lang_tokens, lang_mask) -> PrefixCache` and
`denoise(prefix, noise) -> actions` (and optionally `sample_actions(...)`, a whole decision in one go);
"reference" is the eager torch model, "fused" the module `flashrt_core.models.pi05.engine` (imported only
when asked for), "auto" the fused engine on CUDA and the reference on a CPU.

`predict_chunk(images, state, task)` is the whole LeRobot pipeline (pre-processor -> model -> post-processor)
of the checkpoint folder: raw frames and robot-unit state in, robot-unit actions out.
"""
from __future__ import annotations

import importlib
import json
import os
import pathlib

import numpy as np
import torch

from flashrt_core.errors import CheckpointError, InputError
from flashrt_core.models.hub_tokenizer import PALIGEMMA_TOKENIZER, find_tokenizer_file, open_tokenizer, resolve_tokenizer
from flashrt_core.models.pi05.checkpoint import load_checkpoint
from flashrt_core.models.pi05.config import Pi05Config
from flashrt_core.models.pi05.inputs import check_model_inputs, check_prefix
from flashrt_core.models.pi05.normalize import Normalizer
from flashrt_core.models.pi05.preprocess import preprocess_images
from flashrt_core.models.pi05.processors import Processors, read_processors
from flashrt_core.models.pi05.prompt import TinyTokenizer, Tokenizer, WordTokenizer, format_prompt, tokenize_prompt
from flashrt_core.models.paligemma.reference import PrefixCache
from flashrt_core.models.pi05.tiny import build_tiny
from flashrt_core.models.pi05.weights import Pi05Weights, convert
from flashrt_core.models.precision import build_engine
from flashrt_core.models.rtc import RTCInputs, RTCOptions, options_from_lerobot, rtc_inputs

ENGINES = {"reference": "flashrt_core.models.pi05.reference", "fused": "flashrt_core.models.pi05.engine"}
ENGINE_CHOICES = ("auto", *ENGINES)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
PALIGEMMA_VOCAB = 257152


def resolve_engine(name: str | None, device, model: str = "pi0.5") -> str:
    """"auto" (or None) -> "fused" on CUDA, "reference" elsewhere (both models); other names are checked and
    kept."""
    if name in (None, "", "auto"):
        return "fused" if torch.device(device).type == "cuda" else "reference"
    if name not in ENGINES:
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


def make_engine(name: str, weights: Pi05Weights, precision=None, gate: dict | None = None):
    """The engine `name` over `weights`; a quantized `precision` (`models.precision`) is checked against the
    unquantized reference at build (`gate`: thresholds other than the format's) and refused if it falls short."""
    name = resolve_engine(name, weights.time_in_w.device)
    if name not in ENGINES:
        raise ValueError(f"engine: unknown {name!r} (one of {', '.join(ENGINES)})")
    try:
        module = importlib.import_module(ENGINES[name])
    except ModuleNotFoundError as e:
        if e.name != ENGINES[name]:
            raise  # the engine exists but one of its own imports is missing
        raise ImportError(f"engine {name!r}: module {ENGINES[name]} is not available in this build") from None
    return build_engine(module, importlib.import_module(ENGINES["reference"]), weights, precision, gate)


class Pi05Policy:
    """pi0.5 with LeRobot's `sample_actions` signature, plus the two stages it is made of."""

    def __init__(self, config: Pi05Config, weights: Pi05Weights, engine, device, dtype: torch.dtype,
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

    def make_noise(self, batch: int) -> torch.Tensor:
        return torch.randn((batch, self.config.chunk_size, self.config.action_dim), generator=self.generator,
                           device=self.device, dtype=torch.float32)

    # ---- stages (each engine checks its inputs before it writes anything: `inputs`) ------------------
    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask) -> PrefixCache:
        return self.engine.encode_prefix(images, image_masks, lang_tokens, lang_mask)

    def guidance(self, batch: int, inference_delay=None, prev_chunk_left_over=None, execution_horizon=None):
        """LeRobot's RTC arguments -> `rtc.RTCInputs` on this policy's device, or None where RTC is off (no
        `rtc` options, as a LeRobot config without rtc_config) or no previous chunk is given."""
        if self.rtc is None or prev_chunk_left_over is None:
            return None
        return rtc_inputs(prev_chunk_left_over.to(self.device), 0 if inference_delay is None else inference_delay,
                          execution_horizon, self.rtc, self.config.chunk_size, self.config.action_dim, batch)

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


    # ---- the whole pipeline ------------------------------------------------------------------------------
    def predict_chunk(self, images, state, task: str, noise=None) -> np.ndarray:
        """LeRobot's `preprocessor -> predict_action_chunk -> postprocessor` for one robot.

        images: raw RGB uint8 HxWx3 frames of any size, one per camera feature of the checkpoint in its order
        (`processors.camera_names`; None = a missing camera); state: robot units, `state_dim` values; task:
        the text; noise: optional [1, chunk, max_action_dim]. -> actions [chunk, action_dim] float32 in robot
        units. A task that does not fit `tokenizer_max_length` tokens with the state is refused (InputError;
        LeRobot would cut the end of the prompt, where the state is, off)."""
        p = self.processors
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
        """One decision from pre-processed images and the normalized state: pi0.5 prints the state into the
        prompt (refused, never cut, when it does not fit) -> model-space actions [1, chunk, max_action_dim]."""
        tokens, mask = self.tokenize(task, state_normalized, truncate=False)
        return self.sample_actions(images, image_masks, tokens, mask, noise=noise)


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


def choose_tokenizer(config: Pi05Config, folder: pathlib.Path | None, tokenizer=None,
                     processors: Processors | None = None):
    """The one tokenizer rule of the project (policy API and contract runtime alike):
    an explicit tokenizer (object, file or folder) first; then a tokenizer file in the checkpoint folder; a
    LeRobot folder (with its pre-processor file) or a full-size checkpoint: the tokenizer its pre-processor
    names (its tokenizer step), from the hub cache (CheckpointError listing where it looked); small test models: TinyTokenizer;
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


def load(ckpt_dir: str | os.PathLike | None = None, device="cpu", dtype="auto", engine: str = "auto",
         seed: int = 0, tokenizer=None, rtc="checkpoint", precision="bf16") -> Pi05Policy:
    """Load a LeRobot pi0.5 checkpoint folder (as `save_pretrained` writes it, processors included; or a bare
    model.safetensors); None or "" = the built-in tiny model.

    dtype "auto" = bfloat16 on CUDA, float32 elsewhere; engine "auto" = fused on CUDA, reference elsewhere;
    `seed` seeds the policy's noise generator (and the tiny model's weights); `tokenizer`: a path or a
    Tokenizer (default: see `choose_tokenizer`); `rtc`: real-time chunking options ("checkpoint": the
    config.json's rtc_config, as LeRobot reads it; an `rtc.RTCOptions`; None: off); `precision`: "bf16" (every
    weight in `dtype`), "fp8" (the prefix's GEMMs in fp8), "w4a16" (the action expert's weights in 4 bits),
    "fp8+w4a16", "fp8+mxfp4", or a mapping per part (`models.precision`), checked
    at load against the unquantized model (PrecisionError with the numbers).
    """
    torch_dtype = parse_dtype(dtype, device)
    processors = None
    if ckpt_dir in (None, ""):
        config, state = build_tiny(seed)
        folder = None
    else:
        config, state = load_checkpoint(ckpt_dir)
        folder = pathlib.Path(ckpt_dir)
        folder = folder if folder.is_dir() else folder.parent
        processors = read_processors(folder)
    weights = convert(config, state).to(device=device, dtype=torch_dtype)
    impl = make_engine(resolve_engine(engine, device), weights, precision)
    return Pi05Policy(config, weights, impl, device, torch_dtype, seed=seed,
                      tokenizer=choose_tokenizer(config, folder, tokenizer, processors), processors=processors,
                      rtc=rtc_options(rtc, folder))


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
