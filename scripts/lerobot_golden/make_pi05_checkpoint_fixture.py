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
building (and re-loading) the tiny model needs the size patch `common.tiny_model_sizes()`; it touches only
the constructors, never the forward code. The tokenizer, stats, frames and states come from common.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ACTION_NAMES,
    CAMERAS,
    FIXTURES,
    TOKENIZER_REPO,
    build_tokenizer,
    lay_out_hub_cache,
    make_dataset_stats,
    make_frame,
    make_state,
    offline_hub_cache,
    raw_batch_from,
    run_pipeline,
    tiny_model_sizes,
    versions,
)

TINY_DIR = FIXTURES / "lerobot_pi05_tiny"
OUT_DIR = FIXTURES / "lerobot_pi05_ckpt"

SEED = 20250605
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
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    out: Path = args.out

    # Before anything imports huggingface_hub / transformers: offline, and our cache only.
    hub_cache = offline_hub_cache("pi05_hub_cache_")

    for sub in ("checkpoint", "hf_tokenizer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    tok_info = build_tokenizer(out / "hf_tokenizer", SEED)
    commit = lay_out_hub_cache(out / "hf_tokenizer", hub_cache)

    import tokenizers
    import torch
    from safetensors.torch import load_file, save_file

    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05 import PI05Config, PI05Policy, modeling_pi05
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

    with tiny_model_sizes(modeling_pi05, dims):
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

    plain_tok = tokenizers.Tokenizer.from_file(str(out / "hf_tokenizer" / "tokenizer.json"))
    tensors: dict[str, torch.Tensor] = {}
    case_records = []
    raw_batches = {}
    noise_gen = torch.Generator().manual_seed(SEED)
    for name, task, cams, rule in CASES:
        frames = {cam: make_frame(rng, h, w) for cam, (h, w) in cams.items()}
        state = make_state(rng, stats_np, rule)
        noise = torch.randn(1, dims["chunk_size"], dims["max_action_dim"], generator=noise_gen, dtype=torch.float32)
        raw_batch = raw_batch_from(frames, state, task)
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
    with tiny_model_sizes(modeling_pi05, dims):
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
        "versions": versions(),
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
