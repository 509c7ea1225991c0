"""pi0.5 (LeRobot 0.6.1 layout): config, checkpoint I/O, engine weights, eager reference, pre-processing.

    from flashrt_core.models import pi05
    policy = pi05.load("ckpt_dir", device="cpu", dtype="float32", engine="reference")  # None = tiny model
    images, masks = policy.preprocess_images([frame0, frame1], num_slots=3)
    tokens, mask = policy.tokenize("pick up the cube", state_normalized)
    actions = policy.sample_actions(images, masks, tokens, mask, noise=noise)  # [B, chunk, 32]
"""
from flashrt_core.models.paligemma.checkpoint import checkpoint_config, expected_keys, load_checkpoint, save_checkpoint
from flashrt_core.models.pi05.config import GemmaConfig, Pi05Config, VisionConfig
from flashrt_core.lerobot.normalize import FeatureNorm, Normalizer
from flashrt_core.models.pi05.policy import Pi05Policy, load
from flashrt_core.lerobot.preprocess import preprocess_images, resize_with_pad
from flashrt_core.lerobot.tokenize import (SentencePieceTokenizer, TinyTokenizer, Tokenizer, WordTokenizer,
                                          tokenize_prompt)
from flashrt_core.models.pi05.prompt import discretize_state, format_prompt
from flashrt_core.models.paligemma.reference import PrefixCache
from flashrt_core.models.paligemma.tiny import build_tiny, tiny_checkpoint
from flashrt_core.models.pi05.weights import Pi05Weights, convert

__all__ = [
    "load", "Pi05Policy", "Pi05Config", "VisionConfig", "GemmaConfig", "Pi05Weights", "PrefixCache", "convert",
    "load_checkpoint", "save_checkpoint", "checkpoint_config", "expected_keys", "build_tiny", "tiny_checkpoint",
    "preprocess_images", "resize_with_pad", "format_prompt", "discretize_state", "tokenize_prompt", "Tokenizer",
    "SentencePieceTokenizer", "TinyTokenizer", "WordTokenizer", "Normalizer", "FeatureNorm",
]
