#!/usr/bin/env python3
"""Make test/fixtures/lerobot_pi05_ckpt: a tiny pi0.5 checkpoint folder saved by LeRobot 0.6.1 itself,
with its pre/post-processors, a small PaliGemma-like tokenizer, and the outputs of LeRobot's whole
pipeline (preprocessor -> predict_action_chunk(noise=...) -> postprocessor) on three raw inputs.

Needs Python >= 3.12 with lerobot==0.6.1, transformers==5.5.4, tokenizers==0.22.2 and torch (CPU is enough).
Runs offline: LeRobot's TokenizerProcessorStep loads "google/paligemma-3b-pt-224" through AutoTokenizer, so
this script lays out a temporary Hugging Face hub cache holding our small tokenizer under that name and runs
with HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing there.

    python scripts/lerobot_golden/make_pi05_checkpoint_fixture.py            # from the repository root

The policy has the sizes of test/fixtures/lerobot_pi05_tiny (dims.json there) and that folder's weights.
LeRobot derives model sizes only from the variant names in config.json ("gemma_2b", "gemma_300m"), so
building (and re-loading) the tiny model needs the size patch in `tiny_model_sizes()`; it touches only
the constructors, never the forward code.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_DIR = REPO_ROOT / "test" / "fixtures" / "lerobot_pi05_tiny"
OUT_DIR = REPO_ROOT / "test" / "fixtures" / "lerobot_pi05_ckpt"
TOKENIZER_REPO = "google/paligemma-3b-pt-224"

SEED = 20250605
CAMERAS = ["observation.images.front", "observation.images.wrist"]
ACTION_NAMES = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_flex", "wrist_roll", "gripper"]
TOKENIZER_MAX_LENGTH = 48

# (name, task string as the robot sends it, {camera: (H, W)} for the cameras present, state rule)
CASES = [
    ("two_views_224", "pick up the red cube",
     {"observation.images.front": (224, 224), "observation.images.wrist": (224, 224)}, "inside"),
    ("front_240x320_wrist_120x160", "Put_the banana in the blue bowl\n",
     {"observation.images.front": (240, 320), "observation.images.wrist": (120, 160)}, "above_max"),
    ("front_200x300_wrist_missing", "open the top drawer and place the wooden spoon inside it",
     {"observation.images.front": (200, 300)}, "below_min"),
]


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


def tokenizer_corpus() -> list[str]:
    """Deterministic pi0.5-style prompts: every task phrase and every bin 0..255 appears many times."""
    rng = np.random.default_rng(SEED)
    lines = []
    for rep in range(24):
        for task in TASK_WORDS:
            bins = rng.integers(0, 256, size=6)
            lines.append(f"Task: {task}, State: {' '.join(map(str, bins))};\nAction: ")
    for n in range(256):
        lines.append(" ".join(str((n + k) % 256) for k in range(8)))
    return lines


def build_tokenizer(out_dir: Path) -> dict:
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
    trainer_tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
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
# Tiny model sizes (test/fixtures/lerobot_pi05_tiny/dims.json) patched into LeRobot's constructors.
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def tiny_model_sizes(dims: dict):
    from lerobot.policies.pi05 import modeling_pi05 as m

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


def make_dataset_stats(rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
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
    for cam in CAMERAS:  # VISUAL is IDENTITY for pi0.5: saved, never used
        img = make_stats(rng, rng.uniform(0.35, 0.55, 3), rng.uniform(0.5, 0.7, 3))
        stats[cam] = {k: (v.reshape(3, 1, 1) if k != "count" else v) for k, v in img.items()}
        stats[cam]["min"] = np.zeros((3, 1, 1), np.float32)
        stats[cam]["max"] = np.ones((3, 1, 1), np.float32)
    return stats


def make_frame(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    base = np.stack([yy, xx, 0.5 * (yy + 1 - xx)], axis=-1) * 200.0
    return np.clip(base + rng.normal(0, 30, size=(h, w, 3)), 0, 255).astype(np.uint8)


def make_state(rng: np.random.Generator, stats: dict, rule: str) -> np.ndarray:
    s = stats["observation.state"]
    state = rng.uniform(s["q10"], s["q90"]).astype(np.float64)
    if rule == "above_max":
        state[2] = s["max"][2] + 0.25 * (s["max"][2] - s["q99"][2]) + 3.0
    elif rule == "below_min":
        state[0] = s["min"][0] - 0.25 * (s["q01"][0] - s["min"][0]) - 3.0
    return state.astype(np.float32)[None]


# --------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    out: Path = args.out

    hub_cache = Path(tempfile.mkdtemp(prefix="pi05_hub_cache_"))
    # Before anything imports huggingface_hub / transformers: offline, and our cache only.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_CACHE"] = str(hub_cache)
    os.environ["HF_LEROBOT_HOME"] = str(hub_cache / "lerobot_home")

    for sub in ("checkpoint", "hf_tokenizer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    tok_info = build_tokenizer(out / "hf_tokenizer")
    commit = lay_out_hub_cache(out / "hf_tokenizer", hub_cache)

    import lerobot
    import tokenizers
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05 import PI05Config, PI05Policy
    from lerobot.policies.pi05.processor_pi05 import (
        Pi05PrepareStateTokenizerProcessorStep,
        make_pi05_pre_post_processors,
    )
    from lerobot.processor import RelativeActionsProcessorStep, TokenizerProcessorStep

    torch.manual_seed(SEED)
    dims = json.loads((TINY_DIR / "dims.json").read_text())
    rng = np.random.default_rng(SEED)
    stats_np = make_dataset_stats(rng)

    config = PI05Config(
        input_features={
            **{cam: PolicyFeature(type=FeatureType.VISUAL, shape=(3, 224, 224)) for cam in CAMERAS},
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(6,)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(6,))},
        action_feature_names=list(ACTION_NAMES),
        use_relative_actions=True,
        relative_exclude_joints=["gripper"],
        tokenizer_max_length=TOKENIZER_MAX_LENGTH,
        chunk_size=dims["chunk_size"],
        n_action_steps=dims["chunk_size"],
        num_inference_steps=dims["num_steps"],
        max_action_dim=dims["max_action_dim"],
        max_state_dim=dims["max_state_dim"],
        dtype="float32",
        device="cpu",
    )

    with tiny_model_sizes(dims):
        policy = PI05Policy(config)
    weights = load_file(str(TINY_DIR / "model.safetensors"))
    policy.load_state_dict(weights, strict=True)
    policy.eval()

    stats_t = {k: {s: torch.from_numpy(v) for s, v in d.items()} for k, d in stats_np.items()}
    preprocessor, postprocessor = make_pi05_pre_post_processors(config, dataset_stats=stats_t)

    ckpt = out / "checkpoint"
    policy.save_pretrained(ckpt)
    preprocessor.save_pretrained(ckpt)
    postprocessor.save_pretrained(ckpt)

    tok_step = next(s for s in preprocessor.steps if isinstance(s, TokenizerProcessorStep))
    prep_idx = next(i for i, s in enumerate(preprocessor.steps) if isinstance(s, Pi05PrepareStateTokenizerProcessorStep))
    rel_step = next(s for s in preprocessor.steps if isinstance(s, RelativeActionsProcessorStep))
    seen: dict = {}

    def before(idx, transition):
        if idx == prep_idx:
            seen["state_normalized"] = transition["observation"]["observation.state"].clone()

    def after(idx, transition):
        if idx == prep_idx:
            seen["prompt"] = list(transition["complementary_data"]["task"])

    preprocessor.register_before_step_hook(before)
    preprocessor.register_after_step_hook(after)

    def run_pipeline(pre, pol, post, raw_batch, noise):
        batch = pre(dict(raw_batch))
        actions_model = pol.predict_action_chunk(batch, noise=noise.clone())
        out_actions = post(actions_model)
        return batch, actions_model, out_actions

    plain_tok = tokenizers.Tokenizer.from_file(str(out / "hf_tokenizer" / "tokenizer.json"))
    tensors: dict[str, torch.Tensor] = {}
    case_records = []
    raw_batches = {}
    noise_gen = torch.Generator().manual_seed(SEED)
    for name, task, cams, rule in CASES:
        frames = {cam: make_frame(rng, h, w) for cam, (h, w) in cams.items()}
        state = make_state(rng, stats_np, rule)
        noise = torch.randn(1, dims["chunk_size"], dims["max_action_dim"], generator=noise_gen, dtype=torch.float32)
        raw_batch = {cam: torch.from_numpy(f).permute(2, 0, 1)[None].to(torch.float32) / 255.0 for cam, f in frames.items()}
        raw_batch["observation.state"] = torch.from_numpy(state)
        raw_batch["task"] = task
        raw_batches[name] = (raw_batch, noise)

        seen.clear()
        batch, actions_model, actions = run_pipeline(preprocessor, policy, postprocessor, raw_batch, noise)
        images, img_masks = policy._preprocess_images(batch)
        padded = policy.model.sample_actions(
            images, img_masks, batch["observation.language.tokens"], batch["observation.language.attention_mask"],
            noise=noise.clone())
        assert torch.equal(padded[:, :, :6], actions_model)
        cached = rel_step.get_cached_state()
        assert torch.equal(cached, raw_batch["observation.state"]), "relative step caches the raw state"

        tokens = batch["observation.language.tokens"]
        mask = batch["observation.language.attention_mask"]
        valid = int(mask.sum())
        prompt = seen["prompt"][0]
        lerobot_ids = tokens[0, :valid].tolist()
        plain_ids = plain_tok.encode(prompt).ids
        assert valid < TOKENIZER_MAX_LENGTH, (name, valid)
        assert plain_ids == lerobot_ids, (name, plain_ids, lerobot_ids)
        assert bool(mask[0, :valid].all()) and not bool(mask[0, valid:].any())
        assert bool((tokens[0, valid:] == 0).all())

        for cam, f in frames.items():
            tensors[f"{name}.frame.{cam.rsplit('.', 1)[-1]}"] = torch.from_numpy(f)
        tensors[f"{name}.state"] = raw_batch["observation.state"]
        tensors[f"{name}.noise"] = noise
        tensors[f"{name}.state_normalized"] = seen["state_normalized"]
        tensors[f"{name}.lang_tokens"] = tokens
        tensors[f"{name}.lang_mask"] = mask
        tensors[f"{name}.image_mask"] = torch.stack([m_[0] for m_ in img_masks])
        tensors[f"{name}.actions_model"] = actions_model
        tensors[f"{name}.actions_model_padded"] = padded
        tensors[f"{name}.actions"] = actions

        bins = np.digitize(seen["state_normalized"].numpy(), np.linspace(-1, 1, 257)[:-1]) - 1
        case_records.append({
            "name": name,
            "task": task,
            "prompt": prompt,
            "state_bins": bins[0].tolist(),
            "frames": {cam: list(f.shape) for cam, f in frames.items()},
            "cameras_missing": [c for c in CAMERAS if c not in frames],
            "image_mask": [bool(m_[0]) for m_ in img_masks],
            "processed_image_mean": [float(im.mean()) for im in images],
            "valid_tokens": valid,
            "token_ids": lerobot_ids,
            "tokenizers_from_file_matches_lerobot": plain_ids == lerobot_ids,
            "shapes": {"lang_tokens": list(tokens.shape), "actions_model": list(actions_model.shape),
                       "actions_model_padded": list(padded.shape), "actions": list(actions.shape)},
            "dtypes": {"lang_tokens": str(tokens.dtype), "lang_mask": str(mask.dtype), "actions": str(actions.dtype)},
        })
        print(f"[{name}] tokens={valid} prompt={prompt!r} actions{tuple(actions.shape)} "
              f"tokenizer.json ids == LeRobot ids: {plain_ids == lerobot_ids}")

    preprocessor.unregister_before_step_hook(before)
    preprocessor.unregister_after_step_hook(after)

    # Reload the saved folder with LeRobot (offline hub cache) and re-run every case.
    with tiny_model_sizes(dims):
        policy2 = PI05Policy.from_pretrained(str(ckpt))
    policy2.eval()
    sd1, sd2 = policy.state_dict(), policy2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1), "reloaded weights differ"
    pre2, post2 = make_pre_post_processors(policy2.config, pretrained_path=str(ckpt))
    reload_diff = {}
    for name, (raw_batch, noise) in raw_batches.items():
        _, am2, a2 = run_pipeline(pre2, policy2, post2, raw_batch, noise)
        reload_diff[name] = {
            "actions_model": float((am2 - tensors[f"{name}.actions_model"]).abs().max()),
            "actions": float((a2 - tensors[f"{name}.actions"]).abs().max()),
        }
        print(f"[{name}] reload max abs diff: {reload_diff[name]}")

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "cases.safetensors"))
    summary = {
        "generator": "scripts/lerobot_golden/make_pi05_checkpoint_fixture.py",
        "versions": {"lerobot": lerobot.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "seed": SEED,
        "weights": "test/fixtures/lerobot_pi05_tiny/model.safetensors (loaded strictly)",
        "tokenizer": {**tok_info, "hub_repo": TOKENIZER_REPO, "hub_commit": commit,
                      "autotokenizer_class": type(tok_step.input_tokenizer).__name__},
        "camera_order": CAMERAS,
        "action_feature_names": ACTION_NAMES,
        "cases": case_records,
        "reload_max_abs_diff": reload_diff,
    }
    (out / "cases.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(hub_cache, ignore_errors=True)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
