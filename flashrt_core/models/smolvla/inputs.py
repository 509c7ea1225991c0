"""Checks of what the SmolVLA stages take, before anything is written (a refused call changes nothing).

(Model-neutral input checks are moving to `flashrt_core.lerobot`; these are SmolVLA's own until then: the
state is a model input here, not part of the prompt as in pi0.5.)
"""
from __future__ import annotations

import torch

from flashrt_core.errors import InputError


def _shape(name: str, t, ndim: int) -> tuple:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    return tuple(t.shape)


def check_model_inputs(c, images, image_masks, lang_tokens, lang_mask, state) -> int:
    """The batch size of a valid observation; InputError naming the first bad field otherwise."""
    b, s, ch, h, w = _shape("images", images, 5)
    if not images.is_floating_point():
        raise InputError(f"images: expected floats in [-1, 1], got {images.dtype}")
    if ch != 3 or (h, w) != (c.image_size, c.image_size):
        raise InputError(f"images: expected [B, S, 3, {c.image_size}, {c.image_size}], got {tuple(images.shape)}")
    if not 1 <= s <= c.num_image_slots:
        raise InputError(f"images: {s} cameras, the model has {c.num_image_slots} slots")
    if _shape("image_masks", image_masks, 2) != (b, s):
        raise InputError(f"image_masks: expected {(b, s)}, got {tuple(image_masks.shape)}")
    bl, n = _shape("lang_tokens", lang_tokens, 2)
    if bl != b or not 1 <= n <= c.tokenizer_max_length:
        raise InputError(f"lang_tokens: expected [{b}, <= {c.tokenizer_max_length}], got {tuple(lang_tokens.shape)}")
    if lang_tokens.is_floating_point():
        raise InputError(f"lang_tokens: expected integer ids, got {lang_tokens.dtype}")
    if _shape("lang_mask", lang_mask, 2) != (b, n):
        raise InputError(f"lang_mask: expected {(b, n)}, got {tuple(lang_mask.shape)}")
    if lang_tokens.device.type == "cpu" and n and (lang_tokens.min() < 0 or lang_tokens.max() >= c.vocab_size):
        raise InputError(f"lang_tokens: ids must lie in [0, {c.vocab_size})")
    bs, d = _shape("state", state, 2)
    if bs != b or not 1 <= d <= c.max_state_dim:
        raise InputError(f"state: expected [{b}, <= {c.max_state_dim}], got {tuple(state.shape)}")
    return b


def check_noise(c, noise, batch: int) -> None:
    want = (batch, c.chunk_size, c.max_action_dim)
    if _shape("noise", noise, 3) != want:
        raise InputError(f"noise: expected {want}, got {tuple(noise.shape)}")


def check_prefix(c, prefix) -> int:
    """The batch size of a prefix cache of this model's shapes."""
    e = c.expert
    k = _shape("prefix.k", prefix.k, 5)
    b = k[1]
    want = (e.depth, b, e.kv_heads, c.prefix_len, e.head_dim)
    if k != want or tuple(prefix.v.shape) != want:
        raise InputError(f"prefix.k / prefix.v: expected {want}, got {k} / {tuple(prefix.v.shape)}")
    if tuple(prefix.pad_mask.shape) != (b, c.prefix_len) or tuple(prefix.n_valid.shape) != (b,):
        raise InputError(f"prefix.pad_mask / n_valid: expected {(b, c.prefix_len)} / {(b,)}")
    return b
