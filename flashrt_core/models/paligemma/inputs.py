"""Checks of pi0.5's model inputs, done by each engine's entry points before anything is written.

Shapes, dtypes and devices are always checked. Values are checked only where that needs no device sync, i.e.
on CPU tensors: token ids inside the vocabulary, the images of present cameras finite and in [-1, 1]. (A
CUDA caller's token ids are clamped into the vocabulary by the fused engine as it copies them: an id outside
it would otherwise abort the whole CUDA context in the embedding lookup.)
"""
from __future__ import annotations

import torch

from flashrt_core.errors import InputError
from flashrt_core.models.paligemma.config import PaliGemmaConfig

IMAGE_SLACK = 1e-3  # SigLIP inputs are in [-1, 1]; resampling may overshoot by rounding, never by more


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def check_model_inputs(config: PaliGemmaConfig, images, image_masks, lang_tokens, lang_mask) -> None:
    """images [B, S <= num_image_slots, 3, size, size] floats in [-1, 1], image_masks [B, S], lang_tokens
    [B, L <= tokenizer_max_length] integer ids, lang_mask [B, L], all on one device; InputError otherwise."""
    for name, t in (("images", images), ("image_masks", image_masks), ("lang_tokens", lang_tokens),
                    ("lang_mask", lang_mask)):
        _tensor(name, t)
    size = config.vision.image_size
    if images.ndim != 5 or tuple(images.shape[2:]) != (3, size, size):
        raise InputError(f"images: expected [B, slots, 3, {size}, {size}], got {tuple(images.shape)}")
    if not images.is_floating_point():
        raise InputError(f"images: expected floats in [-1, 1], got {images.dtype} (camera frames go through "
                         "preprocess_images first)")
    b, s = images.shape[:2]
    if s > config.num_image_slots:
        raise InputError(f"images: {s} camera slots but the model has {config.num_image_slots}")
    if tuple(image_masks.shape) != (b, s):
        raise InputError(f"image_masks: expected {(b, s)}, got {tuple(image_masks.shape)}")
    if lang_tokens.ndim != 2 or lang_tokens.shape[0] != b or tuple(lang_mask.shape) != tuple(lang_tokens.shape):
        raise InputError(f"lang_tokens/lang_mask: expected [{b}, L] each, got {tuple(lang_tokens.shape)} / "
                         f"{tuple(lang_mask.shape)}")
    if lang_tokens.dtype not in (torch.int64, torch.int32):
        raise InputError(f"lang_tokens: expected integer ids, got {lang_tokens.dtype}")
    if lang_tokens.shape[1] > config.tokenizer_max_length:
        raise InputError(f"lang_tokens: {lang_tokens.shape[1]} tokens exceed tokenizer_max_length "
                         f"{config.tokenizer_max_length}")
    devices = {str(t.device) for t in (images, image_masks, lang_tokens, lang_mask)}
    if len(devices) > 1:
        raise InputError(f"images, image_masks, lang_tokens and lang_mask are on different devices: {sorted(devices)}")
    if lang_tokens.device.type == "cpu" and lang_tokens.numel():
        lo, hi = int(lang_tokens.min()), int(lang_tokens.max())
        if lo < 0 or hi >= config.vocab_size:
            raise InputError(f"lang_tokens: ids must lie in [0, {config.vocab_size}), got {lo}..{hi} (a tokenizer "
                             "of another model?)")
    if images.device.type == "cpu":
        present = images[image_masks.bool()]  # a missing camera's slot is never read (the engines fill it)
        if present.numel():
            if not torch.isfinite(present).all():
                raise InputError("images: NaN or infinite values in a present camera's image")
            lo, hi = float(present.min()), float(present.max())
            if lo < -1 - IMAGE_SLACK or hi > 1 + IMAGE_SLACK:
                raise InputError(f"images: values must lie in [-1, 1] (SigLIP input), got {lo:.4g}..{hi:.4g} "
                                 "(frames in [0, 255] or [0, 1] go through preprocess_images first)")


def check_prefix(config: PaliGemmaConfig, prefix, length: int | None = None) -> int:
    """A PrefixCache of this model (k / v [depth, B, kv_heads, P, head_dim] floats, pad_mask [B, P], n_valid [B]
    integers, with P = `length` when given: the fused engine's buffers hold config.prefix_len tokens, the
    reference's caches as many as the observation had); returns its batch size B. InputError otherwise."""
    fields = ("k", "v", "pad_mask", "n_valid")
    if not all(hasattr(prefix, name) for name in fields):
        raise InputError(f"prefix: expected a PrefixCache, got {type(prefix).__name__}")
    for name in fields:
        _tensor(f"prefix.{name}", getattr(prefix, name))
    g = config.vlm
    if prefix.k.ndim != 5:
        raise InputError(f"prefix.k: expected [depth, B, kv_heads, prefix_len, head_dim], got {tuple(prefix.k.shape)}")
    b, p = prefix.k.shape[1], prefix.k.shape[3] if length is None else length
    kv = (g.depth, b, g.kv_heads, p, g.head_dim)
    for name, t, shape in (("k", prefix.k, kv), ("v", prefix.v, kv), ("pad_mask", prefix.pad_mask, (b, p)),
                           ("n_valid", prefix.n_valid, (b,))):
        if tuple(t.shape) != shape:
            raise InputError(f"prefix.{name}: expected {shape}, got {tuple(t.shape)}")
    for name in ("k", "v"):
        if not getattr(prefix, name).is_floating_point():
            raise InputError(f"prefix.{name}: expected floats, got {getattr(prefix, name).dtype}")
    if prefix.n_valid.is_floating_point() or prefix.n_valid.dtype == torch.bool:
        raise InputError(f"prefix.n_valid: expected integer counts, got {prefix.n_valid.dtype}")
    return b


def check_noise(config: PaliGemmaConfig, noise, batch: int) -> None:
    """noise [batch, chunk_size, action_dim] floats; InputError otherwise."""
    expected = (batch, config.chunk_size, config.action_dim)
    if tuple(_tensor("noise", noise).shape) != expected:
        raise InputError(f"noise: expected {expected}, got {tuple(noise.shape)}")
    if not noise.is_floating_point():
        raise InputError(f"noise: expected floats, got {noise.dtype}")
    if noise.device.type == "cpu" and not torch.isfinite(noise).all():
        raise InputError("noise: NaN or infinite values")
