"""Tokenizers a LeRobot checkpoint's prompt goes through, and the padding / truncation of its tokenizer step.

`Tokenizer` is what every model's prompt code calls (`encode` without BOS/EOS, `bos_id`, `pad_id`); the
SentencePiece and `tokenizers` files of the hub cache are opened by `hub_tokenizer`; `TinyTokenizer` and
`WordTokenizer` stand in for tests and random-weight benchmarks.
"""
from __future__ import annotations

import os
import zlib
from typing import Protocol, Sequence

import numpy as np
import torch

from flashrt_core.errors import InputError


class Tokenizer(Protocol):
    bos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""


class SentencePieceTokenizer:
    """The PaliGemma SentencePiece model (`tokenizer.model` of google/paligemma-3b-pt-224)."""

    def __init__(self, path: str | os.PathLike):
        import sentencepiece

        if not os.path.isfile(path):
            raise InputError(f"tokenizer: file not found: {path}")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise InputError(f"tokenizer: {path}: not a SentencePiece model ({e})") from None
        self.bos_id = int(self._sp.bos_id())
        # Gemma's pad is id 0; fall back to it for models that define no pad piece.
        self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else 0
        self.vocab_size = int(self._sp.get_piece_size())
        self.path = str(path)

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))


class TinyTokenizer:
    """Download-free tokenizer for the built-in tiny model: one id per UTF-8 byte (id = byte + 3).

    Ids 0/1/2 are pad/eos/bos as in Gemma, so the largest id is 258: fits any vocab >= 259.
    """

    pad_id, eos_id, bos_id = 0, 1, 2
    offset = 3
    vocab_size = 256 + 3

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - self.offset for i in ids if i >= self.offset).decode("utf-8", errors="replace")


class WordTokenizer:
    """Download-free stand-in for PaliGemma's SentencePiece on a full-size model with random weights (the
    benchmarks' `config/pi05.yaml` without a checkpoint): one id per whitespace-separated piece (its CRC32
    mapped into [3, vocab)), so a prompt takes about as many tokens as SentencePiece gives it (~1 per word or
    number), not one per byte: W2's 48 tokens hold a task and an 8-value state. Deterministic across runs."""

    pad_id, eos_id, bos_id = 0, 1, 2
    offset = 3

    def __init__(self, vocab_size: int):
        if vocab_size <= self.offset:
            raise InputError(f"WordTokenizer: vocab_size must exceed {self.offset}, got {vocab_size}")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        return [self.offset + zlib.crc32(w.encode("utf-8")) % (self.vocab_size - self.offset) for w in text.split()]


def tokenize_prompt(tokenizer: Tokenizer, text: str, max_len: int, truncate: bool = True, bos: bool = True):
    """-> tokens [1, max_len] long and mask [1, max_len] bool: BOS (where the model's tokenizer adds one) + ids,
    truncated (as LeRobot's tokenizer call does) or, with truncate=False, refused (InputError) when longer,
    right-padded (LeRobot's "longest" padding is the same under the mask: pads are never attended to)."""
    if max_len < 1:
        raise InputError(f"max_len: must be positive, got {max_len}")
    ids = ([tokenizer.bos_id] if bos else []) + list(tokenizer.encode(text))
    if len(ids) > max_len and not truncate:
        raise InputError(f"prompt: {len(ids)} tokens with BOS, more than prompt_len = {max_len}; the end of "
                         f"{text[-40:]!r} would be cut off")
    ids = ids[:max_len]
    n = len(ids)
    tokens = torch.full((1, max_len), tokenizer.pad_id, dtype=torch.long)
    tokens[0, :n] = torch.tensor(ids, dtype=torch.long)
    mask = torch.zeros(1, max_len, dtype=torch.bool)
    mask[0, :n] = True
    return tokens, mask


def newline_prompt(task: str) -> str:
    """What LeRobot's new-line processor step (pi0's, SmolVLA's) makes of a task: the task with a newline appended
    unless it ends with one."""
    if not isinstance(task, str):
        raise InputError(f"task: expected a string, got {type(task).__name__}")
    return task if task.endswith("\n") else task + "\n"
