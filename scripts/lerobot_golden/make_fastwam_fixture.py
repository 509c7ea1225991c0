#!/usr/bin/env python3
"""Make test/fixtures/lerobot_fastwam_tiny: a tiny FastWAM checkpoint folder saved by LeRobot 0.6.1 itself
(policy + pre/post-processors), the tiny Wan2.2 VAE, UMT5 encoder and UMT5 tokenizer folders it was built with,
and LeRobot's outputs:

    batch = preprocessor(raw_batch); batch["seed"] = seed             # the seed of the action noise
    actions_model = policy.predict_action_chunk(batch)                 # -> model.infer_action(**kwargs)
    actions_robot = postprocessor(actions_model)

plus the model-level call `policy.model.infer_action(prompt=, input_image=, action_horizon=, proprio=,
num_inference_steps=, seed=)` on the tensors predict_action_chunk builds, its per-stage intermediates (token ids,
UMT5 embeddings, first-frame latents, the video K/V cache of every layer, every Euler step's velocity) and, for
the first case, `infer_joint`'s imagined future latents and decoded frames.

Needs the LeRobot 0.6.1 venv (~/.cache/lerobot-py311: lerobot 0.6.1, transformers 5.5.4, diffusers). CPU only,
fp32, one thread, no network:

    ~/.cache/lerobot-py311/bin/python scripts/lerobot_golden/make_fastwam_fixture.py      # from the repository root

Offline: LeRobot loads the VAE from `Wan-AI/Wan2.2-TI2V-5B-Diffusers` subfolder `vae` (a constant, not a config
field), the UMT5 encoder from `config.text_encoder_model_id` (same repo) subfolder `text_encoder` and the tokenizer
from `config.tokenizer_model_id` (`google/umt5-xxl`). This script builds tiny versions of the three, saves them into
the fixture (`hf_wan_vae/`, `hf_umt5_encoder/`, `hf_umt5_tokenizer/`) and lays out a temporary hub cache whose
snapshots of those two repo names hold them, with HF_HUB_OFFLINE=1. Nothing of LeRobot is patched; the only
instrumentation is read-only wrappers set as attributes on the policy's model *instance* (they record arguments /
results and call the original bound method unchanged).
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

WAN_DIFFUSERS = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
UMT5_TOKENIZER = "google/umt5-xxl"
SEED = 20261208
FOLDER = "lerobot_fastwam_tiny"

TEMPLATE = "A video recorded from a robot's point of view executing the following instruction: {task}"
LONG_TASK = ("open the top drawer, take out the wooden spoon and the small box, "
             "place the spoon inside the box and close the drawer again")

# Tiny sizes. Constraints LeRobot imposes: the VAE adapter hard-codes z_dim 48, 16x spatial / 4x temporal
# compression; video in_dim = out_dim = 48; both DiTs share num_heads, attn_head_dim, num_layers; the video DiT's
# head dim must equal hidden / heads (the action DiT's need not: hidden 24 != 2 x 16 exercises its projected path).
VAE = {"base_dim": 4, "decoder_base_dim": 4, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
       "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
       "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_temporal": 4,
       "scale_factor_spatial": 16}
UMT5 = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0,
        "layer_norm_epsilon": 1e-6, "is_encoder_decoder": True, "tie_word_embeddings": False}
VIDEO_DIT = {"patch_size": [1, 2, 2], "in_dim": 48, "hidden_dim": 32, "ffn_dim": 64, "freq_dim": 32, "text_dim": 32,
             "out_dim": 48, "num_heads": 2, "attn_head_dim": 16, "num_layers": 2, "eps": 1.0e-6,
             "seperated_timestep": True, "use_gradient_checkpointing": False,
             "video_attention_mask_mode": "first_frame_causal", "action_conditioned": False, "action_dim": 7,
             "action_group_causal_mask_mode": "group_diagonal", "fp32_attention": True}
ACTION_DIT = {"action_dim": 7, "hidden_dim": 24, "ffn_dim": 48, "num_heads": 2, "attn_head_dim": 16, "num_layers": 2,
              "text_dim": 32, "freq_dim": 32, "eps": 1.0e-6, "use_gradient_checkpointing": False,
              "fp32_attention": True}
POLICY = {"action_dim": 7, "proprio_dim": 8, "action_horizon": 16, "n_action_steps": 16, "num_video_frames": 9,
          "action_video_freq_ratio": 2, "image_size": (64, 128), "context_len": 32, "tokenizer_max_len": 32,
          "num_inference_steps": 10, "torch_dtype": "float32"}
# Config order wrist, front on purpose: LeRobot concatenates the cameras in *sorted key* order (front | wrist).
CAMERAS = ["observation.images.wrist", "observation.images.front"]

CASES = [
    # (name, task, {camera: (H, W)}, action-noise seed)
    ("native_64x64_padded_prompt", "pick up the red cube",
     {"observation.images.wrist": (64, 64), "observation.images.front": (64, 64)}, 42),
    ("resized_96x128_and_48x80_truncated_prompt", LONG_TASK,
     {"observation.images.wrist": (96, 128), "observation.images.front": (48, 80)}, 7),
    ("native_64x64_short_prompt", "wipe the table",
     {"observation.images.wrist": (64, 64), "observation.images.front": (64, 64)}, 1234),
]


# --------------------------------------------------------------------------------------------
# The tiny hub folders.
# --------------------------------------------------------------------------------------------
def build_tokenizer(out: Path) -> dict:
    """A tiny UMT5-style tokenizer: a SentencePiece-Unigram model (Metaspace pre-tokenizer) with <pad> 0, </s> 1,
    <unk> 2, then every single character (score -8) and every whitespace-separated word of the prompts as one
    "\u2581word" piece (score about -2, so Viterbi prefers whole words), plus 4 <extra_id_*> sentinels; transformers'
    T5Tokenizer appends </s> (as google/umt5-xxl does)."""
    from transformers import T5Tokenizer

    tasks = TASK_WORDS + [LONG_TASK, "wipe the table"]
    text = " ".join([TEMPLATE.format(task="")] + tasks)
    words = sorted({"\u2581" + w for w in text.split()})
    chars = sorted(set(text.replace(" ", "")) | {"\u2581"})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(c, -8.0) for c in chars] + [(w, -2.0 - 0.001 * i) for i, w in enumerate(words) if len(w) > 2]
    tok = T5Tokenizer(vocab=vocab, extra_ids=4)
    tok.save_pretrained(str(out))
    return {"vocab_size": len(tok), "unigram_pieces": len(vocab), "pad_token_id": tok.pad_token_id,
            "eos_token_id": tok.eos_token_id, "unk_token_id": tok.unk_token_id, "extra_ids": 4}


def redraw(module, gen, kinds: dict, prefix: str) -> None:
    """Linear / conv weights ~ N(0, 1/fan_in), biases 0.1 N, norm weights (1-D, RMS `gamma`) 1 + 0.1 N,
    embeddings N(0, 1) (UMT5 token table) or 0.5 N (relative position buckets), DiT modulation tables N(0, 1/D)."""
    import torch
    from torch import nn

    names = set()
    with torch.no_grad():
        for mod_name, mod in module.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                if id(p) in names:  # a tied parameter (UMT5 `shared` = `encoder.embed_tokens`): drawn once
                    continue
                n = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                if isinstance(mod, (nn.Linear, nn.Conv2d, nn.Conv3d)) and p_name == "weight":
                    p.copy_(n / p[0].numel() ** 0.5)
                    kind = "linear_conv_weight"
                elif isinstance(mod, nn.Embedding):
                    p.copy_(0.5 * n if "relative_attention_bias" in mod_name else n)
                    kind = "embedding"
                elif p_name == "bias":
                    p.copy_(0.1 * n)
                    kind = "bias"
                elif p_name == "gamma" or (p_name == "weight" and p.ndim == 1):
                    p.copy_(1.0 + 0.1 * n)
                    kind = "norm_weight"
                elif p_name == "modulation":
                    p.copy_(n / p.shape[-1] ** 0.5)
                    kind = "modulation"
                else:
                    raise AssertionError(f"unhandled parameter {mod_name}.{p_name} of {type(mod).__name__}")
                kinds[f"{prefix}:{kind}"] = kinds.get(f"{prefix}:{kind}", 0) + 1
                names.add(id(p))
    missing = [n for n, p in module.named_parameters() if id(p) not in names]
    assert not missing, missing


def build_vae(out: Path, gen, rng, kinds) -> dict:
    import torch
    from diffusers import AutoencoderKLWan

    cfg = dict(VAE, latents_mean=[round(float(x), 4) for x in rng.normal(0, 0.1, 48)],
               latents_std=[round(float(x), 4) for x in rng.uniform(0.5, 1.5, 48)])
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**cfg).eval()
    redraw(vae, gen, kinds, "vae")
    vae.save_pretrained(str(out))
    return {"parameters": sum(p.numel() for p in vae.parameters())}


def build_umt5(out: Path, vocab_size: int, gen, kinds) -> dict:
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **UMT5)
    torch.manual_seed(0)
    enc = UMT5EncoderModel(cfg).eval()
    redraw(enc, gen, kinds, "umt5")
    enc.save_pretrained(str(out))
    return {"parameters": sum(p.numel() for p in enc.parameters())}


def snapshot(cache_dir: Path, repo: str, files: dict[str, Path]) -> str:
    """models--<org>--<name>/{refs/main, snapshots/<commit>/<relative path>} = files."""
    digest = hashlib.sha1()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + files[rel].read_bytes())
    commit = digest.hexdigest()
    repo_dir = cache_dir / ("models--" + repo.replace("/", "--"))
    shutil.rmtree(repo_dir, ignore_errors=True)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    for rel, src in files.items():
        dst = repo_dir / "snapshots" / commit / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return commit


def folder_files(folder: Path, sub: str = "") -> dict[str, Path]:
    return {(f"{sub}/" if sub else "") + p.name: p for p in sorted(folder.iterdir()) if p.is_file()}


# --------------------------------------------------------------------------------------------
def make_dataset_stats(rng) -> dict:
    d_s, d_a = POLICY["proprio_dim"], POLICY["action_dim"]
    state_center = rng.uniform(-60, 60, d_s)
    state_spread = rng.uniform(60, 170, d_s)
    action_center = state_center[:d_a] * rng.uniform(0.9, 1.1, d_a)
    action_spread = state_spread[:d_a] * rng.uniform(0.8, 1.2, d_a)
    stats = {"observation.state": make_stats(rng, state_center, state_spread),
             "action": make_stats(rng, action_center, action_spread)}
    for cam in CAMERAS:  # VISUAL is IDENTITY for FastWAM: saved, never used
        img = make_stats(rng, rng.uniform(0.35, 0.55, 3), rng.uniform(0.5, 0.7, 3))
        stats[cam] = {k: (v.reshape(3, 1, 1) if k != "count" else v) for k, v in img.items()}
        stats[cam]["min"] = np.zeros((3, 1, 1), np.float32)
        stats[cam]["max"] = np.ones((3, 1, 1), np.float32)
    return stats


def versions() -> dict:
    import diffusers
    import huggingface_hub
    import lerobot
    import safetensors
    import tokenizers
    import torch
    import transformers

    return {"lerobot": lerobot.__version__, "transformers": transformers.__version__,
            "diffusers": diffusers.__version__, "tokenizers": tokenizers.__version__, "torch": torch.__version__,
            "huggingface_hub": huggingface_hub.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__, "python": sys.version.split()[0]}


def write_cases(tensors: dict, path: Path) -> None:
    """Pack and save; keep a file already there whose tensors have the same digests (reruns leave it as is)."""
    import torch
    from safetensors import safe_open

    tmp = path.with_name(path.name + ".new")
    save_packed_cases({k: v.contiguous() for k, v in tensors.items()}, tmp)
    back = load_case_tensors(tmp)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    if path.exists():
        with safe_open(str(path), framework="pt") as f_old, safe_open(str(tmp), framework="pt") as f_new:
            if f_old.metadata() == f_new.metadata():
                tmp.unlink()
                return
    tmp.replace(path)


class Recorder:
    """Read-only wrappers on the FastWAM instance: each records its arguments / result and calls the original."""

    def __init__(self, model):
        self.model, self.log, self.saved = model, {}, []
        for name in ["encode_prompt", "_encode_input_image_latents_tensor", "_make_action_latents",
                     "_make_video_latents", "_predict_action_noise_with_cache", "_decode_latents"]:
            self._wrap(model, name)
        self._wrap(model.mot, "prefill_video_cache")

    def _wrap(self, obj, name):
        orig = getattr(obj, name)

        def wrapped(*args, **kwargs):
            out = orig(*args, **kwargs)
            self.log.setdefault(name, []).append((args, kwargs, out))
            return out

        object.__setattr__(obj, name, wrapped)
        self.saved.append((obj, name))

    def clear(self):
        self.log = {}

    def remove(self):
        for obj, name in self.saved:
            del obj.__dict__[name]


# --------------------------------------------------------------------------------------------
def make_fixture(out: Path, hub_cache: Path, seed: int) -> dict:
    import torch

    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.fastwam import FastWAMConfig, FastWAMPolicy
    from lerobot.policies.fastwam.modeling_fastwam import _batch_to_infer_kwargs
    from lerobot.policies.fastwam.processor_fastwam import make_fastwam_pre_post_processors

    for sub in ("checkpoint", "hf_wan_vae", "hf_umt5_encoder", "hf_umt5_tokenizer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    kinds: dict[str, int] = {}

    tok_info = build_tokenizer(out / "hf_umt5_tokenizer")
    vae_info = build_vae(out / "hf_wan_vae", gen, rng, kinds)
    enc_info = build_umt5(out / "hf_umt5_encoder", tok_info["vocab_size"], gen, kinds)
    # google/umt5-xxl is a model repo: AutoTokenizer reads its config.json (model_type umt5) too.
    shutil.copyfile(out / "hf_umt5_encoder" / "config.json", out / "hf_umt5_tokenizer" / "config.json")
    commits = {
        WAN_DIFFUSERS: snapshot(hub_cache, WAN_DIFFUSERS, {**folder_files(out / "hf_wan_vae", "vae"),
                                                          **folder_files(out / "hf_umt5_encoder", "text_encoder")}),
        UMT5_TOKENIZER: snapshot(hub_cache, UMT5_TOKENIZER, folder_files(out / "hf_umt5_tokenizer")),
    }

    h, w = POLICY["image_size"]
    per_cam_w = w // len(CAMERAS)
    config = FastWAMConfig(
        input_features={
            **{cam: PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, per_cam_w)) for cam in CAMERAS},
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(POLICY["proprio_dim"],)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(POLICY["action_dim"],))},
        video_dit_config=dict(VIDEO_DIT),
        action_dit_config=dict(ACTION_DIT),
        device="cpu",
        **POLICY,
    )
    torch.manual_seed(seed)
    policy = FastWAMPolicy(config)
    redraw(policy, gen, kinds, "policy")
    policy.eval()
    model = policy.model

    stats_np = make_dataset_stats(rng)
    stats_t = {k: {s: torch.from_numpy(v) for s, v in d.items()} for k, d in stats_np.items()}
    preprocessor, postprocessor = make_fastwam_pre_post_processors(config, dataset_stats=stats_t)
    ckpt = out / "checkpoint"
    policy.save_pretrained(ckpt)
    preprocessor.save_pretrained(ckpt)
    postprocessor.save_pretrained(ckpt)

    rec = Recorder(model)
    tensors: dict[str, torch.Tensor] = {}
    records, raw_batches = [], {}
    for ci, (name, task, cams, noise_seed) in enumerate(CASES):
        frames = {cam: make_frame(rng, fh, fw) for cam, (fh, fw) in cams.items()}
        s = stats_np["observation.state"]
        state = rng.uniform(s["q10"], s["q90"]).astype(np.float32)[None]
        raw = {cam: torch.from_numpy(f).permute(2, 0, 1)[None].to(torch.float32) / 255.0 for cam, f in frames.items()}
        raw["observation.state"] = torch.from_numpy(state)
        raw["task"] = task
        raw_batches[name] = (raw, noise_seed)

        # The whole pipeline, as LeRobot runs inference (the seed of the action noise given in the batch).
        rec.clear()
        batch = preprocessor(dict(raw))
        batch["seed"] = noise_seed
        actions_model = policy.predict_action_chunk(dict(batch))
        actions_robot = postprocessor(actions_model)
        log = rec.log

        # The same call at model level, on the arguments predict_action_chunk builds.
        kw = _batch_to_infer_kwargs(batch=batch, config=config)
        rec.clear()
        with torch.no_grad():
            actions = model.infer_action(prompt=kw["prompt"], input_image=kw["input_image"],
                                         action_horizon=kw["action_horizon"], proprio=kw["proprio"],
                                         num_inference_steps=kw["num_inference_steps"], seed=noise_seed)["action"]
        assert torch.equal(actions[None], actions_model), name
        ids, ids_mask = model.tokenizer(kw["prompt"], return_mask=True, add_special_tokens=True)
        text_emb = log["encode_prompt"][0][2][0]
        noise = log["_make_action_latents"][0][2]
        ff_lat = log["_encode_input_image_latents_tensor"][0][2]
        cache = log["prefill_video_cache"][0][2]
        steps = log["_predict_action_noise_with_cache"]
        velocity = torch.stack([o for (_, _, o) in steps])
        timesteps = torch.stack([k["timestep_action"] for (_, k, _) in steps])
        ctx = steps[0][1]["context"]
        attn_mask = steps[0][1]["attention_mask"]
        assert torch.equal(noise, torch.randn((1, POLICY["action_horizon"], POLICY["action_dim"]),
                                              generator=torch.Generator().manual_seed(noise_seed)))

        # Model level again with the encoded prompt given as context (infer_action's other input form).
        with torch.no_grad():
            actions_ctx = model.infer_action(prompt=None, context=text_emb, context_mask=torch.ones_like(ids_mask, dtype=torch.bool),
                                             input_image=kw["input_image"], action_horizon=kw["action_horizon"],
                                             proprio=kw["proprio"], num_inference_steps=kw["num_inference_steps"],
                                             seed=noise_seed)["action"]

        p = f"{name}."
        for cam, f in frames.items():
            tensors[p + "frame." + cam.rsplit(".", 1)[-1]] = torch.from_numpy(f)
        tensors[p + "state_raw"] = raw["observation.state"]
        tensors[p + "state_normalized"] = batch["observation.state"]
        tensors[p + "input_image"] = kw["input_image"]
        tensors[p + "token_ids"] = ids
        tensors[p + "token_mask"] = ids_mask.to(torch.bool)
        tensors[p + "text_emb"] = text_emb
        tensors[p + "context"] = ctx
        tensors[p + "first_frame_latents"] = ff_lat
        tensors[p + "noise"] = noise
        tensors[p + "timesteps"] = timesteps.reshape(-1)
        tensors[p + "attention_mask"] = attn_mask
        for li, kv in enumerate(cache):
            tensors[p + f"video_k.{li}"] = kv["k"]
            tensors[p + f"video_v.{li}"] = kv["v"]
        tensors[p + "velocity"] = velocity
        tensors[p + "actions"] = actions
        tensors[p + "actions_model"] = actions_model
        tensors[p + "actions_robot"] = actions_robot
        valid = int(ids_mask.sum())
        prompt_str = kw["prompt"][0] if isinstance(kw["prompt"], list) else kw["prompt"]  # to_batch makes it a list
        records.append({
            "name": name, "task": task, "prompt": prompt_str, "noise_seed": noise_seed,
            "frames": {cam: list(f.shape) for cam, f in frames.items()},
            "concat_order": sorted(cams),
            "valid_tokens": valid, "token_len": int(ids.shape[1]),
            "prompt_truncated": len(model.tokenizer.tokenizer(prompt_str).input_ids) > POLICY["tokenizer_max_len"],
            "video_seq_len": int(cache[0]["k"].shape[1]),
            "shapes": {k[len(p):]: list(v.shape) for k, v in tensors.items() if k.startswith(p)},
            "max_abs": {"actions": float(actions.abs().max()), "actions_robot": float(actions_robot.abs().max()),
                        "first_frame_latents": float(ff_lat.abs().max()), "text_emb": float(text_emb.abs().max())},
            "context_input_max_abs_diff": float((actions_ctx - actions).abs().max()),
        })
        print(f"[{name}] tokens {valid}/{ids.shape[1]} |actions|max={float(actions.abs().max()):.3f} "
              f"ctx-path diff {records[-1]['context_input_max_abs_diff']:.2e}")

        if ci == 0:  # infer_joint: the imagined future (video latents denoised together with the actions)
            rec.clear()
            with torch.no_grad():
                joint = model.infer_joint(prompt=kw["prompt"], input_image=kw["input_image"],
                                          num_video_frames=config.model_video_frames,
                                          action_horizon=kw["action_horizon"], proprio=kw["proprio"],
                                          num_inference_steps=kw["num_inference_steps"], seed=noise_seed)
            lat = rec.log["_decode_latents"][0][0][0]
            tensors[p + "joint.video_noise"] = rec.log["_make_video_latents"][0][2]
            tensors[p + "joint.video_latents"] = lat
            tensors[p + "joint.frames"] = torch.stack([torch.from_numpy(np.asarray(im)) for im in joint["video"]])
            tensors[p + "joint.actions"] = joint["action"]
            records[-1]["joint"] = {"num_video_frames": config.model_video_frames,
                                    "video_latents": list(lat.shape),
                                    "frames": list(tensors[p + "joint.frames"].shape),
                                    "actions_max_abs_diff_to_infer_action": float((joint["action"] - actions).abs().max())}
            print(f"[{name}] joint {records[-1]['joint']}")
    rec.remove()

    # Every input moves the output (case 0): the image, the state, the prompt.
    c0 = CASES[0][0]
    kw0 = dict(prompt=[records[0]["prompt"]], input_image=tensors[c0 + ".input_image"], action_horizon=POLICY["action_horizon"],
               proprio=tensors[c0 + ".state_normalized"], num_inference_steps=POLICY["num_inference_steps"], seed=CASES[0][3])
    sens = {}
    with torch.no_grad():
        base = tensors[c0 + ".actions"]
        sens["image_flipped"] = float((model.infer_action(**{**kw0, "input_image": torch.flip(kw0["input_image"], [-1])})["action"] - base).abs().max())
        st = kw0["proprio"].clone()
        st[0, 0] += 1.0
        sens["state[0]+1"] = float((model.infer_action(**{**kw0, "proprio": st})["action"] - base).abs().max())
        sens["other_prompt"] = float((model.infer_action(**{**kw0, "prompt": TEMPLATE.format(task="wipe the table")})["action"] - base).abs().max())
    assert all(v > 1e-3 for v in sens.values()), sens
    print("sensitivity", sens)

    # Reload the saved folder with LeRobot (offline hub cache) and run every case again.
    policy2 = FastWAMPolicy.from_pretrained(str(ckpt))
    policy2.eval()
    sd1, sd2 = policy.state_dict(), policy2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1), "reloaded weights differ"
    pre2, post2 = make_pre_post_processors(policy2.config, pretrained_path=str(ckpt))
    reload_diff = {}
    for name, (raw, noise_seed) in raw_batches.items():
        b2 = pre2(dict(raw))
        b2["seed"] = noise_seed
        am2 = policy2.predict_action_chunk(dict(b2))
        a2 = post2(am2)
        reload_diff[name] = {"actions_model": float((am2 - tensors[f"{name}.actions_model"]).abs().max()),
                             "actions_robot": float((a2 - tensors[f"{name}.actions_robot"]).abs().max())}
        print(f"[{name}] reload max abs diff {reload_diff[name]}")

    write_cases(tensors, out / "cases.safetensors")
    summary = {
        "generator": "scripts/lerobot_golden/make_fastwam_fixture.py",
        "versions": versions(),
        "seed": seed,
        "hub_repos": {"vae": f"{WAN_DIFFUSERS} (subfolder vae)", "text_encoder": f"{WAN_DIFFUSERS} (subfolder text_encoder)",
                      "tokenizer": UMT5_TOKENIZER, "temporary_cache_commits": commits},
        "dims": {"vae": VAE, "umt5": UMT5, "video_dit": VIDEO_DIT, "action_dit": ACTION_DIT,
                 "policy": {**POLICY, "image_size": list(POLICY["image_size"])},
                 "model_video_frames": config.model_video_frames, "cameras_config_order": CAMERAS},
        "tokenizer": tok_info,
        "parameters": {"vae": vae_info["parameters"], "umt5": enc_info["parameters"],
                       "policy": sum(p.numel() for p in policy.parameters())},
        "weights_redrawn": kinds,
        "cases": records,
        "sensitivity_case0_max_abs_change": sens,
        "reload_max_abs_diff": reload_diff,
    }
    (out / "cases.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-root", type=Path, default=FIXTURES)
    args = parser.parse_args()
    hub_cache = offline_hub_cache("fastwam_hub_cache_")  # before anything imports transformers
    import torch

    torch.set_num_threads(1)
    try:
        make_fixture(args.out_root / FOLDER, hub_cache, SEED)
        print("wrote", args.out_root / FOLDER)
    finally:
        shutil.rmtree(hub_cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
