"""Helpers shared by the LeRobot 0.6.1 golden-fixture generators in this folder
(make_pi05_checkpoint_fixture.py, make_pi0_checkpoint_fixture.py).

Nothing here imports torch, transformers or huggingface_hub at module level: the generators must set the
offline hub environment (`offline_hub_cache`) before those are first imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "test" / "fixtures"
TOKENIZER_REPO = "google/paligemma-3b-pt-224"
TOKENIZER_FILES = ["config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]

CAMERAS = ["observation.images.front", "observation.images.wrist"]
ACTION_NAMES = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_flex", "wrist_roll", "gripper"]


# --------------------------------------------------------------------------------------------
# Tokenizer: a small BPE built with `tokenizers`, laid out like PaliGemma's (Gemma) tokenizer files.
# --------------------------------------------------------------------------------------------
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # ids 0..4, as in Gemma
TASK_WORDS = [
    "pick up the red cube", "pick up the blue cube", "put the banana in the bowl", "put the banana in the blue bowl",
    "open the top drawer", "close the bottom drawer", "place the wooden spoon inside it", "stack the green block",
    "push the yellow button", "move the cup to the left", "move the cup to the right", "wipe the table",
    "pour water into the glass", "fold the towel", "turn on the light", "grasp the handle and pull",
    "open the top drawer and place the wooden spoon inside it", "put the apple on the plate",
    "pick the small box and drop it in the basket", "rotate the knob", "insert the peg into the hole",
]


def tokenizer_corpus(seed: int) -> list[str]:
    """Deterministic pi0.5-style prompts: every task phrase and every bin 0..255 appears many times."""
    rng = np.random.default_rng(seed)
    lines = []
    for rep in range(24):
        for task in TASK_WORDS:
            bins = rng.integers(0, 256, size=6)
            lines.append(f"Task: {task}, State: {' '.join(map(str, bins))};\nAction: ")
    for n in range(256):
        lines.append(" ".join(str((n + k) % 256) for k in range(8)))
    return lines


def build_tokenizer(out_dir: Path, seed: int) -> dict:
    """Train the small tokenizer and write TOKENIZER_FILES into out_dir (deterministic for a given seed)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    def gemma_like(tok: Tokenizer) -> Tokenizer:
        # The same normalizer / pre-tokenizer / decoder that transformers' GemmaTokenizer builds.
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok

    # Train on word pieces (each word with its leading U+2581, as SentencePiece does) so no learned piece spans two words; the
    # final tokenizer then runs BPE on the whole string exactly like GemmaTokenizer, with the same result.
    trainer_tok = gemma_like(Tokenizer(BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True)))
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(pattern="\u2581", behavior="merged_with_next")
    trainer = BpeTrainer(vocab_size=700, min_frequency=2, show_progress=False, special_tokens=[])
    trainer_tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]

    # Gemma's id layout: specials first, then the 256 byte-fallback tokens, then the learned pieces.
    vocab: dict[str, int] = {}
    for piece in SPECIALS + [f"<0x{b:02X}>" for b in range(256)]:
        vocab[piece] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    assert len(vocab) <= 1000, len(vocab)

    tok = gemma_like(Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                                   byte_fallback=True, dropout=None)))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    # PaliGemma: BOS prepended, no EOS appended.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1", special_tokens=[("<bos>", 2)])

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))

    def added(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}

    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(vocab[s]): added(s) for s in SPECIALS},
        "bos_token": "<bos>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "mask_token": "<mask>",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<pad>",
        "padding_side": "right",
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    special_tokens_map = {
        name: {k: v for k, v in added(tok_str).items() if k != "special"}
        for name, tok_str in [("bos_token", "<bos>"), ("eos_token", "<eos>"), ("pad_token", "<pad>"),
                              ("unk_token", "<unk>"), ("mask_token", "<mask>")]
    }
    # transformers 5 AutoTokenizer also reads the repo's config.json (for model_type), as a real snapshot has.
    model_config = {
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "model_type": "paligemma",
        "bos_token_id": vocab["<bos>"],
        "eos_token_id": vocab["<eos>"],
        "pad_token_id": vocab["<pad>"],
    }
    (out_dir / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_tokens_map, indent=2) + "\n")
    return {"vocab_size": len(vocab), "merges": len(merges)}


def copy_tokenizer(src_dir: Path, out_dir: Path) -> dict:
    """Copy TOKENIZER_FILES byte for byte; returns {file: sha256}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name in TOKENIZER_FILES:
        data = (src_dir / name).read_bytes()
        (out_dir / name).write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def offline_hub_cache(prefix: str) -> Path:
    """A fresh temporary hub cache; sets HF_HUB_OFFLINE=1, HF_HUB_CACHE and HF_LEROBOT_HOME to it.
    Call before anything imports huggingface_hub / transformers."""
    hub_cache = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_CACHE"] = str(hub_cache)
    os.environ["HF_LEROBOT_HOME"] = str(hub_cache / "lerobot_home")
    return hub_cache


def lay_out_hub_cache(tokenizer_dir: Path, cache_dir: Path) -> str:
    """models--google--paligemma-3b-pt-224/{refs/main, snapshots/<commit>/<files>} as the hub writes it."""
    files = sorted(p.name for p in tokenizer_dir.iterdir())
    digest = hashlib.sha1()
    for name in files:
        digest.update(name.encode() + b"\0" + (tokenizer_dir / name).read_bytes())
    commit = digest.hexdigest()
    repo_dir = cache_dir / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    for name in files:
        shutil.copyfile(tokenizer_dir / name, snapshot / name)
    return commit


# --------------------------------------------------------------------------------------------
# Tiny model sizes (dims.json of a tiny fixture) patched into LeRobot's constructors.
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def tiny_model_sizes(modeling, dims: dict):
    """LeRobot derives model sizes only from the variant names in config.json ("gemma_2b", "gemma_300m").
    Inside this context, `modeling` (lerobot.policies.pi05.modeling_pi05 or ...pi0.modeling_pi0) builds the
    sizes of `dims` instead. Only the constructors are wrapped, never the forward code."""
    m = modeling
    gemma_dims = {"gemma_2b": dims["vlm"], "gemma_300m": dims["expert"]}
    vis, vocab = dims["vision"], dims["vocab_size"]
    orig_get, orig_vlm, orig_expert = m.get_gemma_config, m.PaliGemmaForConditionalGenerationWithPiGemma, m.PiGemmaForCausalLM

    def get_gemma_config(variant):
        return m.GemmaConfig(**gemma_dims[variant])

    def vlm(config):
        config.text_config.vocab_size = vocab
        config.vision_config.hidden_size = vis["hidden_size"]
        config.vision_config.intermediate_size = vis["intermediate_size"]
        config.vision_config.num_hidden_layers = vis["num_hidden_layers"]
        config.vision_config.num_attention_heads = vis["num_attention_heads"]
        config.vision_config.patch_size = vis["patch_size"]
        config.projection_dim = config.vision_config.projection_dim = dims["vlm"]["width"]
        return orig_vlm(config=config)

    def expert(config):
        config.vocab_size = vocab
        return orig_expert(config=config)

    m.get_gemma_config, m.PaliGemmaForConditionalGenerationWithPiGemma, m.PiGemmaForCausalLM = get_gemma_config, vlm, expert
    try:
        yield
    finally:
        m.get_gemma_config, m.PaliGemmaForConditionalGenerationWithPiGemma, m.PiGemmaForCausalLM = orig_get, orig_vlm, orig_expert


# --------------------------------------------------------------------------------------------
# Made-up dataset stats (robot units), consistent: min < q01 < q10 < q50 < q90 < q99 < max.
# --------------------------------------------------------------------------------------------
def make_stats(rng: np.random.Generator, center: np.ndarray, spread: np.ndarray) -> dict[str, np.ndarray]:
    d = center.shape[0]
    skew = rng.uniform(0.7, 1.3, size=(2, d))
    std = spread / 2.6
    q50 = center + rng.uniform(-0.1, 0.1, size=d) * std
    stats = {
        "min": q50 - std * (2.33 * skew[0] + rng.uniform(0.3, 0.8, size=d)),
        "q01": q50 - 2.33 * std * skew[0],
        "q10": q50 - 1.28 * std * skew[0],
        "q50": q50,
        "q90": q50 + 1.28 * std * skew[1],
        "q99": q50 + 2.33 * std * skew[1],
        "max": q50 + std * (2.33 * skew[1] + rng.uniform(0.3, 0.8, size=d)),
        "mean": q50 + rng.uniform(-0.2, 0.2, size=d) * std,
        "std": std,
    }
    order = ["min", "q01", "q10", "q50", "q90", "q99", "max"]
    for lo, hi in zip(order, order[1:]):
        assert np.all(stats[lo] < stats[hi]), (lo, hi)
    assert np.all((stats["q10"] < stats["mean"]) & (stats["mean"] < stats["q90"]))
    stats = {k: v.astype(np.float32) for k, v in stats.items()}
    stats["count"] = np.array([48213], dtype=np.int64)
    return stats


def make_dataset_stats(rng: np.random.Generator, cameras: list[str] = CAMERAS) -> dict[str, dict[str, np.ndarray]]:
    # Joint positions in degrees, gripper in percent.
    state_center = np.array([5.0, -40.0, 60.0, 20.0, -10.0, 35.0])
    state_spread = np.array([160.0, 90.0, 110.0, 140.0, 170.0, 60.0])
    # Actions are relative to the state for the five joints (small offsets), absolute for the gripper.
    action_center = np.array([0.4, -0.8, 1.1, -0.3, 0.6, 38.0])
    action_spread = np.array([12.0, 9.0, 15.0, 11.0, 20.0, 70.0])
    stats = {
        "observation.state": make_stats(rng, state_center * rng.uniform(0.9, 1.1, 6), state_spread),
        "action": make_stats(rng, action_center * rng.uniform(0.9, 1.1, 6), action_spread),
    }
    for cam in cameras:  # VISUAL is IDENTITY for pi0 and pi0.5: saved, never used
        img = make_stats(rng, rng.uniform(0.35, 0.55, 3), rng.uniform(0.5, 0.7, 3))
        stats[cam] = {k: (v.reshape(3, 1, 1) if k != "count" else v) for k, v in img.items()}
        stats[cam]["min"] = np.zeros((3, 1, 1), np.float32)
        stats[cam]["max"] = np.ones((3, 1, 1), np.float32)
    return stats


def make_frame(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A uint8 HxWx3 RGB frame: a smooth gradient plus noise."""
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    base = np.stack([yy, xx, 0.5 * (yy + 1 - xx)], axis=-1) * 200.0
    return np.clip(base + rng.normal(0, 30, size=(h, w, 3)), 0, 255).astype(np.uint8)


def make_state(rng: np.random.Generator, stats: dict, rule: str) -> np.ndarray:
    """[1, 6] float32 state in robot units: inside [q10, q90], or with one joint above max / below min."""
    s = stats["observation.state"]
    state = rng.uniform(s["q10"], s["q90"]).astype(np.float64)
    if rule == "above_max":
        state[2] = s["max"][2] + 0.25 * (s["max"][2] - s["q99"][2]) + 3.0
    elif rule == "below_min":
        state[0] = s["min"][0] - 0.25 * (s["q01"][0] - s["min"][0]) - 3.0
    return state.astype(np.float32)[None]


def raw_batch_from(frames: dict, state: np.ndarray, task: str) -> dict:
    """The raw LeRobot batch: each frame as float32 [1,3,H,W] = uint8/255, the state, the task string."""
    import torch

    batch = {cam: torch.from_numpy(f).permute(2, 0, 1)[None].to(torch.float32) / 255.0 for cam, f in frames.items()}
    batch["observation.state"] = torch.from_numpy(state)
    batch["task"] = task
    return batch


def run_pipeline(pre, policy, post, raw_batch: dict, noise):
    """preprocessor -> predict_action_chunk(noise=) -> postprocessor, as LeRobot runs inference."""
    batch = pre(dict(raw_batch))
    actions_model = policy.predict_action_chunk(batch, noise=noise.clone())
    actions = post(actions_model)
    return batch, actions_model, actions


def versions() -> dict:
    import sys

    import lerobot
    import tokenizers
    import torch
    import transformers

    return {"lerobot": lerobot.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
