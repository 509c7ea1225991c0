#!/usr/bin/env python3
"""Make test/fixtures/lerobot_pi0_ckpt: a tiny pi0 checkpoint folder saved by LeRobot 0.6.1 itself,
with its pre/post-processors, the small PaliGemma-like tokenizer of ../lerobot_pi05_ckpt, and the outputs of
LeRobot's whole pipeline (preprocessor -> predict_action_chunk(noise=...) -> postprocessor) on three raw inputs.

Needs Python >= 3.12 with lerobot==0.6.1, transformers==5.5.4, tokenizers==0.22.2 and torch (CPU is enough).
Runs offline: LeRobot's TokenizerProcessorStep loads "google/paligemma-3b-pt-224" through AutoTokenizer, so
this script lays out a temporary Hugging Face hub cache holding our small tokenizer under that name and runs
with HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing there.

    python scripts/lerobot_golden/make_pi0_checkpoint_fixture.py            # from the repository root

The policy has the sizes of test/fixtures/lerobot_pi0_tiny (dims.json there) and that folder's weights.
The tokenizer files are copied byte for byte from test/fixtures/lerobot_pi05_ckpt/hf_tokenizer (made by
make_pi05_checkpoint_fixture.py), so run that one first if they are missing. The tiny model needs the size
patch `common.tiny_model_sizes()` for building and re-loading; it touches only the constructors.
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
    copy_tokenizer,
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

TINY_DIR = FIXTURES / "lerobot_pi0_tiny"
TOKENIZER_SRC = FIXTURES / "lerobot_pi05_ckpt" / "hf_tokenizer"
OUT_DIR = FIXTURES / "lerobot_pi0_ckpt"

SEED = 20250607
TOKENIZER_MAX_LENGTH = 48

# (name, task string as the robot sends it, {camera: (H, W)} for the cameras present, state rule)
CASES = [
    ("two_views_224", "pick up the red cube",
     {"observation.images.front": (224, 224), "observation.images.wrist": (224, 224)}, "inside"),
    ("front_240x320_wrist_120x160", "Put_the banana in the blue bowl\n",
     {"observation.images.front": (240, 320), "observation.images.wrist": (120, 160)}, "above_max"),
    ("front_200x300_wrist_missing", "open the top drawer and place the wooden spoon inside it ",
     {"observation.images.front": (200, 300)}, "below_min"),
]


def max_abs(a, b) -> float:
    return float((a.to(b.dtype) - b).abs().max())


# --------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    out: Path = args.out

    # Before anything imports huggingface_hub / transformers: offline, and our cache only.
    hub_cache = offline_hub_cache("pi0_hub_cache_")

    for sub in ("checkpoint", "hf_tokenizer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    tok_sha256 = copy_tokenizer(TOKENIZER_SRC, out / "hf_tokenizer")
    commit = lay_out_hub_cache(out / "hf_tokenizer", hub_cache)

    import tokenizers
    import torch
    from safetensors.torch import load_file, save_file

    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi0 import PI0Config, PI0Policy, modeling_pi0
    from lerobot.policies.pi0.processor_pi0 import Pi0NewLineProcessor, make_pi0_pre_post_processors
    from lerobot.processor import (
        AbsoluteActionsProcessorStep,
        NormalizerProcessorStep,
        RelativeActionsProcessorStep,
        TokenizerProcessorStep,
    )

    torch.manual_seed(SEED)
    dims = json.loads((TINY_DIR / "dims.json").read_text())
    assert dims["kind"] == "pi0", dims["kind"]
    rng = np.random.default_rng(SEED)
    stats_np = make_dataset_stats(rng)

    config = PI0Config(
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

    with tiny_model_sizes(modeling_pi0, dims):
        policy = PI0Policy(config)
    weights = load_file(str(TINY_DIR / "model.safetensors"))
    policy.load_state_dict(weights, strict=True)
    policy.eval()

    stats_t = {k: {s: torch.from_numpy(v) for s, v in d.items()} for k, d in stats_np.items()}
    preprocessor, postprocessor = make_pi0_pre_post_processors(config, dataset_stats=stats_t)

    ckpt = out / "checkpoint"
    policy.save_pretrained(ckpt)
    preprocessor.save_pretrained(ckpt)
    postprocessor.save_pretrained(ckpt)

    steps = preprocessor.steps
    tok_step = next(s for s in steps if isinstance(s, TokenizerProcessorStep))
    newline_idx = next(i for i, s in enumerate(steps) if isinstance(s, Pi0NewLineProcessor))
    tok_idx = steps.index(tok_step)
    rel_idx = next(i for i, s in enumerate(steps) if isinstance(s, RelativeActionsProcessorStep))
    norm_idx = next(i for i, s in enumerate(steps) if isinstance(s, NormalizerProcessorStep))
    assert newline_idx < tok_idx < rel_idx < norm_idx == len(steps) - 1, (newline_idx, tok_idx, rel_idx, norm_idx)
    rel_step = steps[rel_idx]
    abs_step = next(s for s in postprocessor.steps if isinstance(s, AbsoluteActionsProcessorStep))
    assert abs_step.relative_step is rel_step
    abs_idx = postprocessor.steps.index(abs_step)
    seen: dict = {}

    def pre_before(idx, transition):
        if idx == newline_idx:
            seen["task_before_newline_step"] = transition["complementary_data"]["task"]
        if idx == norm_idx:
            seen["state_before_normalizer"] = transition["observation"]["observation.state"].clone()

    def pre_after(idx, transition):
        if idx == newline_idx:
            seen["prompt"] = list(transition["complementary_data"]["task"])

    def post_before(idx, transition):
        if idx == abs_idx:
            seen["actions_unnormalized"] = transition["action"].clone()

    preprocessor.register_before_step_hook(pre_before)
    preprocessor.register_after_step_hook(pre_after)
    postprocessor.register_before_step_hook(post_before)

    s_stats = stats_t["observation.state"]
    a_stats = stats_t["action"]
    eps = float(next(s for s in steps if isinstance(s, NormalizerProcessorStep)).eps)
    rel_mask = torch.tensor([0.0 if "gripper" in n.lower() else 1.0 for n in ACTION_NAMES])

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
        state_normalized = batch["observation.state"]
        images, img_masks = policy._preprocess_images(batch)
        state_padded = policy.prepare_state(batch)
        tokens = batch["observation.language.tokens"]
        mask = batch["observation.language.attention_mask"]
        padded = policy.model.sample_actions(images, img_masks, tokens, mask, state_padded, noise=noise.clone())
        assert torch.equal(padded[:, :, :6], actions_model)

        # Facts checked against LeRobot's own values.
        cached = rel_step.get_cached_state()
        assert torch.equal(cached, raw_batch["observation.state"]), "relative step caches the raw state"
        assert torch.equal(seen["state_before_normalizer"], raw_batch["observation.state"])
        assert tuple(state_padded.shape) == (1, dims["max_state_dim"])
        assert torch.equal(state_padded[:, :6], state_normalized) and not bool(state_padded[:, 6:].any())
        prompt = seen["prompt"][0]
        assert prompt == (task if task.endswith("\n") else task + "\n"), (task, prompt)
        ref_norm = (raw_batch["observation.state"] - s_stats["mean"]) / (s_stats["std"] + eps)
        ref_unnorm = actions_model * a_stats["std"] + a_stats["mean"]
        ref_actions = ref_unnorm + raw_batch["observation.state"][:, None, :] * rel_mask
        formula_diff = {
            "state_normalized_vs_(x-mean)/(std+eps)": max_abs(ref_norm, state_normalized),
            "actions_unnormalized_vs_a*std+mean": max_abs(ref_unnorm, seen["actions_unnormalized"]),
            "actions_vs_unnorm+state*[1,1,1,1,1,0]": max_abs(ref_actions, actions),
        }

        valid = int(mask.sum())
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
        tensors[f"{name}.state_normalized"] = state_normalized
        tensors[f"{name}.state_padded"] = state_padded
        tensors[f"{name}.lang_tokens"] = tokens
        tensors[f"{name}.lang_mask"] = mask
        tensors[f"{name}.image_mask"] = torch.stack([m_[0] for m_ in img_masks])
        tensors[f"{name}.actions_model"] = actions_model
        tensors[f"{name}.actions_model_padded"] = padded
        tensors[f"{name}.actions_unnormalized"] = seen["actions_unnormalized"]
        tensors[f"{name}.actions"] = actions

        case_records.append({
            "name": name,
            "task": task,
            "task_type_seen_by_newline_step": type(seen["task_before_newline_step"]).__name__,
            "prompt": prompt,
            "frames": {cam: list(f.shape) for cam, f in frames.items()},
            "cameras_missing": [c for c in CAMERAS if c not in frames],
            "image_mask": [bool(m_[0]) for m_ in img_masks],
            "processed_image_mean": [float(im.mean()) for im in images],
            "valid_tokens": valid,
            "token_ids": lerobot_ids,
            "tokenizers_from_file_matches_lerobot": plain_ids == lerobot_ids,
            "formula_max_abs_diff": formula_diff,
            "shapes": {"lang_tokens": list(tokens.shape), "state_normalized": list(state_normalized.shape),
                       "state_padded": list(state_padded.shape), "actions_model": list(actions_model.shape),
                       "actions_model_padded": list(padded.shape), "actions": list(actions.shape)},
            "dtypes": {"lang_tokens": str(tokens.dtype), "lang_mask": str(mask.dtype), "actions": str(actions.dtype)},
        })
        print(f"[{name}] tokens={valid} prompt={prompt!r} actions{tuple(actions.shape)} "
              f"tokenizer.json ids == LeRobot ids: {plain_ids == lerobot_ids} formulas: {formula_diff}")

    preprocessor.unregister_before_step_hook(pre_before)
    preprocessor.unregister_after_step_hook(pre_after)
    postprocessor.unregister_before_step_hook(post_before)

    # Reload the saved folder with LeRobot (offline hub cache) and re-run every case.
    with tiny_model_sizes(modeling_pi0, dims):
        policy2 = PI0Policy.from_pretrained(str(ckpt))
    policy2.eval()
    sd1, sd2 = policy.state_dict(), policy2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1), "reloaded weights differ"
    pre2, post2 = make_pre_post_processors(policy2.config, pretrained_path=str(ckpt))
    reload_diff = {}
    for name, (raw_batch, noise) in raw_batches.items():
        b2, am2, a2 = run_pipeline(pre2, policy2, post2, raw_batch, noise)
        reload_diff[name] = {
            "lang_tokens_equal": bool(torch.equal(b2["observation.language.tokens"], tensors[f"{name}.lang_tokens"])),
            "state_normalized": max_abs(b2["observation.state"], tensors[f"{name}.state_normalized"]),
            "actions_model": max_abs(am2, tensors[f"{name}.actions_model"]),
            "actions": max_abs(a2, tensors[f"{name}.actions"]),
        }
        print(f"[{name}] reload max abs diff: {reload_diff[name]}")

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "cases.safetensors"))
    summary = {
        "generator": "scripts/lerobot_golden/make_pi0_checkpoint_fixture.py",
        "versions": versions(),
        "seed": SEED,
        "weights": "test/fixtures/lerobot_pi0_tiny/model.safetensors (loaded strictly)",
        "tokenizer": {"copied_from": "test/fixtures/lerobot_pi05_ckpt/hf_tokenizer", "sha256": tok_sha256,
                      "hub_repo": TOKENIZER_REPO, "hub_commit": commit,
                      "autotokenizer_class": type(tok_step.input_tokenizer).__name__},
        "camera_order": CAMERAS,
        "action_feature_names": ACTION_NAMES,
        "relative_mask": rel_mask.tolist(),
        "normalizer_eps": eps,
        "preprocessor_steps": [type(s).__name__ for s in steps],
        "postprocessor_steps": [type(s).__name__ for s in postprocessor.steps],
        "cases": case_records,
        "reload_max_abs_diff": reload_diff,
    }
    (out / "cases.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(hub_cache, ignore_errors=True)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
