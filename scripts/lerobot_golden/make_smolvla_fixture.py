#!/usr/bin/env python3
"""Make test/fixtures/lerobot_smolvla_three_cams and test/fixtures/lerobot_smolvla_empty_cam: two tiny SmolVLA
checkpoint folders saved by LeRobot 0.6.1 itself (policy + pre/post-processors), each with the tiny SmolVLM2-shaped
VLM folder it was built from (config, processor, tokenizer) and LeRobot's outputs on raw inputs:

    batch = preprocessor(raw_batch)
    actions_model = policy.predict_action_chunk(batch, noise=noise)      # -> model.sample_actions(..., noise=)
    actions = postprocessor(actions_model)

plus, for the same cases, the exact tensors given to `policy.model.sample_actions(images, img_masks, lang_tokens,
lang_masks, state, noise=noise)` and its output, and intermediates of the first case (prefix embeddings, the
per-layer prefix K/V cache, the velocity of every Euler step).

Needs the LeRobot 0.6.1 venv (a Python 3.11 venv with lerobot 0.6.1: lerobot 0.6.1, transformers 5.5.4, tokenizers 0.22.2,
torch, num2words). CPU only, fp32, one thread, no network:

    ~/.cache/lerobot-py311/bin/python scripts/lerobot_golden/make_smolvla_fixture.py       # from the repository root

Offline: SmolVLAConfig.vlm_model_name keeps LeRobot's default "HuggingFaceTB/SmolVLM2-500M-Video-Instruct" (as a
real fine-tuned checkpoint's config.json does); LeRobot reads it with AutoConfig / AutoProcessor / AutoTokenizer, so
this script lays out a temporary Hugging Face hub cache whose snapshot of that name is the fixture's tiny `hf_vlm/`
folder, and runs with HF_HUB_OFFLINE=1 and HF_HUB_CACHE there. Nothing of LeRobot is patched: the tiny sizes come
from the tiny VLM config alone (LeRobot derives every SmolVLA size from it and from SmolVLAConfig).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import FIXTURES, REPO_ROOT, TASK_WORDS, make_frame, make_stats, offline_hub_cache  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "test"))
from lerobot_cases import load_case_tensors, save_packed_cases  # noqa: E402

VLM_REPO = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"  # SmolVLAConfig.vlm_model_name's default in 0.6.1
SEED = 20261208

# Tokens as in SmolVLM2's tokenizer: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2 (the pad id 2 of the real
# generation_config), then byte-level BPE; the image / utterance tokens are added tokens at the end.
BASE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXTRA_SPECIAL = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "end_of_utterance_token": "<end_of_utterance>",
    "global_image_token": "<global-img>",
}

LONG_TASK = ("open the top drawer, take out the wooden spoon and the small box, "
             "place the spoon inside the box and close the drawer again")

SPECS = {
    # (a) three real cameras, empty_cameras 0; the language is padded to the longest prompt (batch 1: no padding),
    # tokenizer_max_length 24 so that one prompt is truncated.
    "three_cams": {
        "folder": "lerobot_smolvla_three_cams",
        "vision": {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "image_size": 96, "patch_size": 16},
        "scale_factor": 2,
        "text": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16},
        "policy": {"num_vlm_layers": 4, "self_attn_every_n_layers": 2, "expert_width_multiplier": 0.75,
                   "tokenizer_max_length": 24, "pad_language_to": "longest", "empty_cameras": 0},
        "cameras": ["observation.images.top", "observation.images.wrist", "observation.images.side"],
        "state_dim": 8,
        "action_dim": 7,
        # (name, task as the robot sends it, {camera: (H, W)} of the cameras present, state rule)
        "cases": [
            ("three_96x96", "pick up the red cube",
             {"observation.images.top": (96, 96), "observation.images.wrist": (96, 96),
              "observation.images.side": (96, 96)}, "inside"),
            ("top_120x160_wrist_48x64_side_100x90", "Put the banana in the blue bowl\n",
             {"observation.images.top": (120, 160), "observation.images.wrist": (48, 64),
              "observation.images.side": (100, 90)}, "above"),
            ("long_prompt_truncated", LONG_TASK,
             {"observation.images.top": (96, 96), "observation.images.wrist": (96, 96),
              "observation.images.side": (96, 96)}, "inside"),
            ("side_missing", "stack the green block",
             {"observation.images.top": (96, 96), "observation.images.wrist": (72, 96)}, "below"),
        ],
    },
    # (b) two real cameras plus LeRobot's empty_cameras=1 slot (observation.images.empty_camera_0, never in the
    # batch: a -1 image with mask false); the language is padded to max_length 48.
    "empty_cam": {
        "folder": "lerobot_smolvla_empty_cam",
        "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "image_size": 128, "patch_size": 16},
        "scale_factor": 4,
        "text": {"hidden_size": 48, "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 3,
                 "num_key_value_heads": 1, "head_dim": 16},
        "policy": {"num_vlm_layers": 3, "self_attn_every_n_layers": 3, "expert_width_multiplier": 0.5,
                   "tokenizer_max_length": 48, "pad_language_to": "max_length", "empty_cameras": 1},
        "cameras": ["observation.images.front", "observation.images.wrist"],
        "state_dim": 6,
        "action_dim": 6,
        "cases": [
            ("two_128x128_padded_prompt", "pick up the blue cube",
             {"observation.images.front": (128, 128), "observation.images.wrist": (128, 128)}, "inside"),
            ("front_200x150_wrist_128x128", "open the top drawer and place the wooden spoon inside it\n",
             {"observation.images.front": (200, 150), "observation.images.wrist": (128, 128)}, "above"),
            ("front_96x128_wrist_missing", "wipe the table",
             {"observation.images.front": (96, 128)}, "below"),
        ],
    },
}


# --------------------------------------------------------------------------------------------
# The tiny VLM folder: tokenizer, processor, SmolVLMConfig.
# --------------------------------------------------------------------------------------------
def tokenizer_corpus() -> list[str]:
    words = TASK_WORDS + [LONG_TASK, "wipe the table", "stack the green block", "pick up the blue cube"]
    return [f"{t}\n" for t in words] * 8 + [t.capitalize() for t in words] * 4


def build_vlm_folder(spec: dict, out: Path) -> dict:
    """Write a SmolVLM2-shaped folder (config.json, processor files, tokenizer) into out; return its facts."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import (
        GPT2Tokenizer,
        SmolVLMConfig,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    bpe = Tokenizer(BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=448, min_frequency=2, show_progress=False, special_tokens=BASE_SPECIALS,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = GPT2Tokenizer(vocab=model["vocab"], merges=merges, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                        eos_token="<end_of_utterance>", pad_token="<|im_end|>", extra_special_tokens=dict(EXTRA_SPECIAL))

    v, img = spec["vision"], spec["vision"]["image_size"]
    grid = img // v["patch_size"]
    image_seq_len = grid * grid // spec["scale_factor"] ** 2
    image_proc = SmolVLMImageProcessor(size={"longest_edge": 4 * img}, max_image_size={"longest_edge": img})
    video_proc = SmolVLMVideoProcessor(size={"longest_edge": img}, max_image_size={"longest_edge": img})
    SmolVLMProcessor(image_processor=image_proc, tokenizer=tok, video_processor=video_proc,
                     image_seq_len=image_seq_len).save_pretrained(str(out))

    text = dict(spec["text"], model_type="llama", vocab_size=len(tok), rms_norm_eps=1e-5, rope_theta=100000.0,
                max_position_embeddings=8192, hidden_act="silu", pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    vision = dict(v, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, num_channels=3)
    cfg = SmolVLMConfig(vision_config=vision, text_config=text, scale_factor=spec["scale_factor"],
                        image_token_id=tok.image_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    cfg.architectures = ["SmolVLMForConditionalGeneration"]
    cfg.save_pretrained(str(out))

    saved = json.loads((out / "tokenizer.json").read_text())
    assert saved.get("padding") is None and saved.get("truncation") is None, "tokenizer.json saved with padding"
    return {"vocab_size": len(tok), "bpe_merges": len(merges), "image_seq_len": image_seq_len,
            "pad_token_id": tok.pad_token_id, "image_token_id": tok.image_token_id,
            "fake_image_token_id": tok.fake_image_token_id, "global_image_token_id": tok.global_image_token_id,
            "end_of_utterance_token_id": tok.convert_tokens_to_ids("<end_of_utterance>")}


def lay_out_hub_cache(vlm_dir: Path, cache_dir: Path) -> str:
    """models--HuggingFaceTB--SmolVLM2-500M-Video-Instruct/{refs/main, snapshots/<commit>/...} = vlm_dir's files."""
    files = sorted(p.name for p in vlm_dir.iterdir())
    digest = hashlib.sha1()
    for name in files:
        digest.update(name.encode() + b"\0" + (vlm_dir / name).read_bytes())
    commit = digest.hexdigest()
    repo_dir = cache_dir / ("models--" + VLM_REPO.replace("/", "--"))
    shutil.rmtree(repo_dir, ignore_errors=True)
    (repo_dir / "snapshots" / commit).mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    for name in files:
        shutil.copyfile(vlm_dir / name, repo_dir / "snapshots" / commit / name)
    return commit


# --------------------------------------------------------------------------------------------
# Weights: every parameter drawn again.
# --------------------------------------------------------------------------------------------
def redraw_parameters(policy, gen) -> dict:
    """Linear / conv weights ~ N(0, 1/fan_in), biases 0.1 N, norm weights 1 + 0.1 N, norm biases 0.1 N, token
    embeddings N(0, 1/width) (SmolVLA multiplies them by sqrt(width)), SigLIP position embeddings 0.5 N."""
    import torch
    from torch import nn

    counts: dict[str, int] = {}
    done = set()
    with torch.no_grad():
        for mod_name, mod in policy.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}"
                n = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                if isinstance(mod, (nn.Linear, nn.Conv2d)) and p_name == "weight":
                    fan_in = p[0].numel()
                    p.copy_(n / fan_in ** 0.5)
                    kind = "linear_weight"
                elif isinstance(mod, nn.Embedding):
                    if "position_embedding" in mod_name:
                        p.copy_(0.5 * n)
                        kind = "position_embedding"
                    else:
                        p.copy_(n / p.shape[1] ** 0.5)
                        kind = "token_embedding"
                elif p_name == "weight" and p.ndim == 1:  # LayerNorm, RMSNorm
                    p.copy_(1.0 + 0.1 * n)
                    kind = "norm_weight"
                elif p_name == "bias":
                    p.copy_(0.1 * n)
                    kind = "bias"
                else:
                    raise AssertionError(f"unhandled parameter {full} of {type(mod).__name__}")
                counts[kind] = counts.get(kind, 0) + 1
                done.add(full)
    names = {n for n, _ in policy.named_parameters()}
    assert names == done, sorted(names ^ done)
    return counts


# --------------------------------------------------------------------------------------------
def make_dataset_stats(rng, spec: dict) -> dict:
    d_s, d_a = spec["state_dim"], spec["action_dim"]
    state_center = rng.uniform(-60, 60, d_s)
    state_center[-1] = 35.0  # gripper, percent
    state_spread = rng.uniform(60, 170, d_s)
    action_center = state_center[:d_a] * rng.uniform(0.9, 1.1, d_a)
    action_spread = state_spread[:d_a] * rng.uniform(0.8, 1.2, d_a)
    stats = {"observation.state": make_stats(rng, state_center, state_spread),
             "action": make_stats(rng, action_center, action_spread)}
    for cam in spec["cameras"]:  # VISUAL is IDENTITY for SmolVLA: saved, never used
        img = make_stats(rng, rng.uniform(0.35, 0.55, 3), rng.uniform(0.5, 0.7, 3))
        stats[cam] = {k: (v.reshape(3, 1, 1) if k != "count" else v) for k, v in img.items()}
        stats[cam]["min"] = np.zeros((3, 1, 1), np.float32)
        stats[cam]["max"] = np.ones((3, 1, 1), np.float32)
    return stats


def make_state(rng, stats: dict, rule: str) -> np.ndarray:
    s = stats["observation.state"]
    state = rng.uniform(s["q10"], s["q90"]).astype(np.float64)
    if rule == "above":
        state[1] = s["max"][1] + 0.3 * (s["max"][1] - s["min"][1])
    elif rule == "below":
        state[0] = s["min"][0] - 0.3 * (s["max"][0] - s["min"][0])
    return state.astype(np.float32)[None]


def raw_batch_from(frames: dict, state: np.ndarray, task: str) -> dict:
    import torch

    batch = {cam: torch.from_numpy(f).permute(2, 0, 1)[None].to(torch.float32) / 255.0 for cam, f in frames.items()}
    batch["observation.state"] = torch.from_numpy(state)
    batch["task"] = task
    return batch


def write_cases(tensors: dict, path: Path) -> None:
    """Pack and save the cases (test/lerobot_cases.py). safetensors writes the metadata in no fixed order, so a file
    already there whose tensors have the same SHA-256 digests (dtype, shape, bytes) is kept: reruns leave it as is."""
    import torch

    tmp = path.with_name(path.name + ".new")
    save_packed_cases({k: v.contiguous() for k, v in tensors.items()}, tmp)
    back = load_case_tensors(tmp)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    if path.exists():
        from safetensors import safe_open

        try:
            load_case_tensors(path)  # the file there is valid ...
            with safe_open(str(path), framework="pt") as f_old, safe_open(str(tmp), framework="pt") as f_new:
                same = f_old.metadata() == f_new.metadata()  # ... and has the same SHA-256 for every tensor
        except ValueError:
            same = False
        if same:
            tmp.unlink()
            print(f"{path}: unchanged (same SHA-256 for every tensor)")
            return
    tmp.replace(path)


def versions() -> dict:
    import huggingface_hub
    import lerobot
    import numpy
    import safetensors
    import tokenizers
    import torch
    import transformers

    return {"lerobot": lerobot.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "torch": torch.__version__,
            "huggingface_hub": huggingface_hub.__version__, "safetensors": safetensors.__version__,
            "numpy": numpy.__version__, "python": sys.version.split()[0]}


# --------------------------------------------------------------------------------------------
def make_fixture(key: str, spec: dict, out: Path, hub_cache: Path, seed: int) -> dict:
    import torch
    from tokenizers import Tokenizer

    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.common.vla_utils import make_att_2d_masks
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla import SmolVLAConfig, SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors
    from lerobot.processor import NewLineTaskProcessorStep, TokenizerProcessorStep

    for sub in ("checkpoint", "hf_vlm"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    vlm_info = build_vlm_folder(spec, out / "hf_vlm")
    commit = lay_out_hub_cache(out / "hf_vlm", hub_cache)

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    img = spec["vision"]["image_size"]
    d_s, d_a = spec["state_dim"], spec["action_dim"]
    pol = spec["policy"]
    config = SmolVLAConfig(
        input_features={
            **{cam: PolicyFeature(type=FeatureType.VISUAL, shape=(3, img, img)) for cam in spec["cameras"]},
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(d_s,)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(d_a,))},
        vlm_model_name=VLM_REPO,
        load_vlm_weights=False,
        chunk_size=50,
        n_action_steps=50,
        num_steps=10,
        max_state_dim=32,
        max_action_dim=32,
        resize_imgs_with_padding=(img, img),
        num_vlm_layers=pol["num_vlm_layers"],
        self_attn_every_n_layers=pol["self_attn_every_n_layers"],
        expert_width_multiplier=pol["expert_width_multiplier"],
        tokenizer_max_length=pol["tokenizer_max_length"],
        pad_language_to=pol["pad_language_to"],
        empty_cameras=pol["empty_cameras"],
        device="cpu",
    )
    policy = SmolVLAPolicy(config)
    weight_kinds = redraw_parameters(policy, gen)
    policy.eval()

    stats_np = make_dataset_stats(rng, spec)
    stats_t = {k: {s: torch.from_numpy(v) for s, v in d.items()} for k, d in stats_np.items()}
    preprocessor, postprocessor = make_smolvla_pre_post_processors(config, dataset_stats=stats_t)

    ckpt = out / "checkpoint"
    policy.save_pretrained(ckpt)
    preprocessor.save_pretrained(ckpt)
    postprocessor.save_pretrained(ckpt)

    tok_step = next(s for s in preprocessor.steps if isinstance(s, TokenizerProcessorStep))
    nl_idx = next(i for i, s in enumerate(preprocessor.steps) if isinstance(s, NewLineTaskProcessorStep))
    seen: dict = {}

    def after(idx, transition):
        if idx == nl_idx:
            seen["prompt"] = transition["complementary_data"]["task"]

    preprocessor.register_after_step_hook(after)

    plain_tok = Tokenizer.from_file(str(out / "hf_vlm" / "tokenizer.json"))
    model = policy.model
    tensors: dict[str, torch.Tensor] = {}
    records, raw_batches = [], {}
    for ci, (name, task, cams, rule) in enumerate(spec["cases"]):
        frames = {cam: make_frame(rng, h, w) for cam, (h, w) in cams.items()}
        state = make_state(rng, stats_np, rule)
        noise = torch.randn(1, config.chunk_size, config.max_action_dim, generator=gen, dtype=torch.float32)
        raw_batch = raw_batch_from(frames, state, task)
        raw_batches[name] = (raw_batch, noise)

        # The whole pipeline, as LeRobot runs inference.
        seen.clear()
        batch = preprocessor(dict(raw_batch))
        actions_model = policy.predict_action_chunk(dict(batch), noise=noise.clone())
        actions = postprocessor(actions_model)

        # The same call at model level, on the tensors predict_action_chunk builds.
        images, img_masks = policy.prepare_images(batch)
        state_padded = policy.prepare_state(batch)
        tokens = batch["observation.language.tokens"]
        mask = batch["observation.language.attention_mask"]
        velocities, expert_out = [], []
        hooks = []
        def record_step(module, inputs, output):  # read-only: returns None, so the output is unchanged
            velocities.append(output.detach().clone())
            expert_out.append(inputs[0].detach().clone())

        if ci == 0:
            hooks.append(model.action_out_proj.register_forward_hook(record_step))
        with torch.no_grad():
            padded = model.sample_actions(images, img_masks, tokens, mask, state_padded, noise=noise.clone())
        for h in hooks:
            h.remove()
        assert torch.equal(padded[:, :, :d_a], actions_model), name

        valid = int(mask.sum())
        prompt = seen["prompt"]
        prompt = prompt[0] if isinstance(prompt, list) else prompt
        plain_ids = plain_tok.encode(prompt).ids
        lerobot_ids = tokens[0, :valid].tolist()
        truncated = len(plain_ids) > pol["tokenizer_max_length"]
        assert plain_ids[: pol["tokenizer_max_length"]] == lerobot_ids, (name, plain_ids, lerobot_ids)
        assert bool(mask[0, :valid].all()) and not bool(mask[0, valid:].any())
        assert bool((tokens[0, valid:] == vlm_info["pad_token_id"]).all())

        p = f"{name}."
        for cam, f in frames.items():
            tensors[p + "frame." + cam.rsplit(".", 1)[-1]] = torch.from_numpy(f)
        tensors[p + "state_raw"] = raw_batch["observation.state"]
        tensors[p + "state_normalized"] = batch["observation.state"]
        tensors[p + "state"] = state_padded
        tensors[p + "noise"] = noise
        for i, (im, m) in enumerate(zip(images, img_masks)):
            tensors[p + f"image.{i}"] = im
            tensors[p + f"image_mask.{i}"] = m
        tensors[p + "lang_tokens"] = tokens
        tensors[p + "lang_mask"] = mask
        tensors[p + "actions"] = padded
        tensors[p + "actions_model"] = actions_model
        tensors[p + "actions_robot"] = actions

        if ci == 0:  # intermediates, through LeRobot's own functions, called as sample_actions calls them
            with torch.no_grad():
                for i, im in enumerate(images):
                    tensors[p + f"debug.image_features.{i}"] = model.vlm_with_expert.embed_image(im)
                embs, pad_masks, att_masks = model.embed_prefix(images, img_masks, tokens, mask, state=state_padded)
                att_2d = make_att_2d_masks(pad_masks, att_masks)
                pos = torch.cumsum(pad_masks, dim=1) - 1
                _, cache = model.vlm_with_expert.forward(attention_mask=att_2d, position_ids=pos,
                                                         past_key_values=None, inputs_embeds=[embs, None],
                                                         use_cache=True)
            tensors[p + "debug.prefix_embs"] = embs
            tensors[p + "debug.prefix_pad_masks"] = pad_masks
            tensors[p + "debug.prefix_att_masks"] = att_masks
            tensors[p + "debug.prefix_position_ids"] = pos
            for li, layer in enumerate(cache.layers):
                tensors[p + f"debug.prefix_k.{li}"] = layer.keys
                tensors[p + f"debug.prefix_v.{li}"] = layer.values
            tensors[p + "debug.velocity"] = torch.stack(velocities)
            tensors[p + "debug.expert_out_step0"] = expert_out[0]
            assert len(velocities) == config.num_steps
            debug_shapes = {"prefix_len": int(embs.shape[1]), "cache_layers": len(cache.layers)}

        records.append({
            "name": name,
            "task": task,
            "prompt": prompt,
            "frames": {cam: list(f.shape) for cam, f in frames.items()},
            "cameras_missing": [c for c in policy.config.image_features if c not in frames],
            "image_slots": len(images),
            "image_mask": [bool(m[0]) for m in img_masks],
            "state_rule": rule,
            "valid_tokens": valid,
            "lang_len": int(tokens.shape[1]),
            "token_ids": lerobot_ids,
            "prompt_truncated": truncated,
            "tokenizers_from_file_matches_lerobot": plain_ids[: pol["tokenizer_max_length"]] == lerobot_ids,
            "prefix_len": len(images) * vlm_info["image_seq_len"] + int(tokens.shape[1]) + 1,
            "shapes": {"actions": list(padded.shape), "actions_model": list(actions_model.shape),
                       "actions_robot": list(actions.shape), "lang_tokens": list(tokens.shape)},
            "max_abs": {"actions": float(padded.abs().max()), "actions_robot": float(actions.abs().max()),
                        "state_normalized": float(batch["observation.state"].abs().max())},
        })
        print(f"[{key}/{name}] slots={len(images)} masks={[bool(m[0]) for m in img_masks]} tokens={valid}/"
              f"{tokens.shape[1]} prompt={prompt!r} |actions|max={float(padded.abs().max()):.3f}")

    preprocessor.unregister_after_step_hook(after)

    # Every path moves the output: drop the images / the state / the prompt of case 0 one at a time.
    name0 = spec["cases"][0][0]
    c0 = {k[len(name0) + 1:]: v for k, v in tensors.items() if k.startswith(name0 + ".")}
    n_slots = records[0]["image_slots"]
    ims = [c0[f"image.{i}"] for i in range(n_slots)]
    ms = [c0[f"image_mask.{i}"] for i in range(n_slots)]
    sensitivity = {}
    with torch.no_grad():
        def run(ims_, ms_, tok_, tm_, st_):
            return model.sample_actions(ims_, ms_, tok_, tm_, st_, noise=c0["noise"].clone())
        for i in range(n_slots):
            ims2 = list(ims)
            ims2[i] = torch.flip(ims[i], dims=[-1])
            sensitivity[f"image.{i}_flipped"] = float((run(ims2, ms, c0["lang_tokens"], c0["lang_mask"], c0["state"])
                                                       - c0["actions"]).abs().max())
        st2 = c0["state"].clone()
        st2[0, 0] += 1.0
        sensitivity["state[0]+1"] = float((run(ims, ms, c0["lang_tokens"], c0["lang_mask"], st2) - c0["actions"]).abs().max())
        tok2 = c0["lang_tokens"].clone()
        tok2[0, 0] = (tok2[0, 0] + 7) % vlm_info["vocab_size"]
        sensitivity["token[0]"] = float((run(ims, ms, tok2, c0["lang_mask"], c0["state"]) - c0["actions"]).abs().max())
        if not bool(c0["lang_mask"].all()):
            tok3 = c0["lang_tokens"].clone()
            tok3[~c0["lang_mask"]] = 5
            sensitivity["padded_tokens_changed"] = float(
                (run(ims, ms, tok3, c0["lang_mask"], c0["state"]) - c0["actions"]).abs().max())
    # Valid inputs move the output; a masked image slot and padded tokens do not move it at all.
    inert = {k for k in sensitivity if k == "padded_tokens_changed"}
    inert |= {f"image.{i}_flipped" for i in range(n_slots) if not bool(ms[i].all())}
    assert all(sensitivity[k] > 1e-3 for k in sensitivity if k not in inert), sensitivity
    assert all(sensitivity[k] == 0.0 for k in inert), sensitivity
    print(f"[{key}] sensitivity {sensitivity}")

    # Reload the saved folder with LeRobot (offline hub cache) and run every case again.
    policy2 = SmolVLAPolicy.from_pretrained(str(ckpt))
    policy2.eval()
    sd1, sd2 = policy.state_dict(), policy2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1), "reloaded weights differ"
    pre2, post2 = make_pre_post_processors(policy2.config, pretrained_path=str(ckpt))
    reload_diff = {}
    for name, (raw_batch, noise) in raw_batches.items():
        b2 = pre2(dict(raw_batch))
        am2 = policy2.predict_action_chunk(dict(b2), noise=noise.clone())
        a2 = post2(am2)
        reload_diff[name] = {"actions_model": float((am2 - tensors[f"{name}.actions_model"]).abs().max()),
                             "actions_robot": float((a2 - tensors[f"{name}.actions_robot"]).abs().max())}
        print(f"[{key}/{name}] reload max abs diff {reload_diff[name]}")

    write_cases(tensors, out / "cases.safetensors")

    vlm_model = policy.model.vlm_with_expert
    summary = {
        "generator": "scripts/lerobot_golden/make_smolvla_fixture.py",
        "versions": versions(),
        "seed": seed,
        "vlm_model_name": VLM_REPO,
        "hf_vlm": {**vlm_info, "hub_commit_in_temporary_cache": commit,
                   "vision_attn_implementation": vlm_model.vlm.model.vision_model.config._attn_implementation},
        "dims": {
            "vision": spec["vision"], "scale_factor": spec["scale_factor"], "text": spec["text"],
            "num_vlm_layers": vlm_model.num_vlm_layers, "num_expert_layers": vlm_model.num_expert_layers,
            "expert_hidden_size": vlm_model.expert_hidden_size,
            "expert_intermediate_size": vlm_model.lm_expert.config.intermediate_size,
            "expert_head_dim": vlm_model.lm_expert.config.head_dim,
            "self_attn_layers": [i for i in range(vlm_model.num_vlm_layers)
                                 if i % pol["self_attn_every_n_layers"] == 0],
            "cross_attn_layers": [i for i in range(vlm_model.num_vlm_layers)
                                  if i % pol["self_attn_every_n_layers"] != 0],
            "state_dim": d_s, "action_dim": d_a, "max_state_dim": 32, "max_action_dim": 32, "chunk_size": 50,
            "num_steps": 10, "image_seq_len": vlm_info["image_seq_len"],
        },
        "policy_options": pol,
        "camera_order": list(policy.config.image_features),
        "weights_redrawn": weight_kinds,
        "cases": records,
        "debug_case": {"name": name0, **debug_shapes},
        "sensitivity_case0_max_abs_change": sensitivity,
        "reload_max_abs_diff": reload_diff,
    }
    (out / "cases.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SPECS), help="make one fixture only")
    parser.add_argument("--out-root", type=Path, default=FIXTURES)
    args = parser.parse_args()

    hub_cache = offline_hub_cache("smolvla_hub_cache_")  # before anything imports transformers
    import torch

    torch.set_num_threads(1)
    try:
        for i, (key, spec) in enumerate(SPECS.items()):
            if args.only and key != args.only:
                continue
            make_fixture(key, spec, args.out_root / spec["folder"], hub_cache, SEED + i)
            print("wrote", args.out_root / spec["folder"])
    finally:
        shutil.rmtree(hub_cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
