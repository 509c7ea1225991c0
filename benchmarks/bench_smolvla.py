"""SmolVLA on the GPU: FlashRT's fused engine vs LeRobot 0.6.1 eager and torch.compile, in one process (the
SmolVLA issue's acceptance run: whole decision <= 5 ms, act-only <= 3.5 ms, >= 4x LeRobot's torch.compile).

Workload W2 for SmolVLA: the full-size model (`SmolVLAConfig.full_size()`: SmolVLM2-500M-Video-Instruct's SigLIP
base patch16-512 and the first 16 SmolLM2-360M layers, the 0.75x action expert), 2 camera views of 512x512,
a 48-token prompt buffer (`tokenizer_max_length` 48) of which 42 tokens are real and 6 masked, a normalized
robot state [1, 32] (a prefix token), 10 flow steps, chunk 50, bf16, batch 1.

Weights: one random state dict in LeRobot's layout, drawn on the device: every tensor ~ normal(0, 0.02), except
the LayerNorm / RMSNorm weights, which are 1 + normal(0, 0.02) (`--norm-init normal` draws them ~ normal(0,
0.02) too: with Llama's RMSNorm, which multiplies by w itself, each norm then scales its output by ~0.02 and
the actions become the noise plus a tiny velocity, which no parity number could tell from a wrong model).
Both systems get the same state dict, inputs and noise.

Systems, each p50 / p90 / p99 of 20 calls after 3 warm-ups, CUDA events, a sync after each call:
  flashrt             one whole decision: `engine.sample_actions(images, image_masks, lang_tokens, lang_mask,
                      state, noise)` (inputs copied into the static buffers, the decision graph, actions out)
  flashrt-act-only    one action tick on the cached prefix: `engine.denoise(prefix, noise)` (noise in, the act
                      graph, actions out)
  flashrt-observe     the observe stage graph alone (`engine.observe()`: SigLIP, connector, 16 VLM layers)
  flashrt-act         the act stage graph alone on a filled prefix (`engine.act()`: 10 steps of the expert)
  lerobot-eager       `SmolVLAPolicy.model.sample_actions(images, img_masks, lang_tokens, lang_masks, state,
                      noise=noise)` with the VLM and the expert in bf16 and the five projections (state, action
                      in / out, action-time MLP) in fp32: what LeRobot itself builds for a bf16 SmolVLM2
                      (`load_vlm_weights` loads the VLM in bf16; the expert's config is a copy of its text
                      config, dtype included; the projections are plain fp32 nn.Linear; it has no dtype option)
  lerobot-compile     the same `sample_actions` under `torch.compile` (mode "default", as flashrt_bench does
                      for pi0.5: LeRobot's own max-autotune did not finish compiling pi0.5 in 8 minutes)
Parity (same weights, inputs, noise): FlashRT bf16 vs LeRobot bf16 (the gate: cosine >= 0.999, relative L2
<= 2e-2), FlashRT bf16 vs the project's fp32 reference, and (default on, `--no-fp32-parity` leaves it out)
the fp32 reference and FlashRT vs LeRobot in float32. `*_model_part` compares actions minus the noise (what
the model added to the noise): stricter, reported, not a gate.
Computed beside: bytes and FLOPs per stage (observe: SigLIP per view, connector, the 16 VLM layers, the cross
layers' k/v projections; act: 10 steps of the expert layers and its in / out projections) and the floors
max(bytes / bandwidth, FLOPs / bf16 rate) on Jetson AGX Thor, Jetson AGX Orin, H100 and H200.

LeRobot runs offline: it reads its VLM's config and processor with AutoConfig / AutoProcessor from
`vlm_model_name` even with `load_vlm_weights=False`, so this writes a local folder at run time (a full-size
SmolVLMConfig with the published numbers, and a SmolVLMProcessor over a byte-level stand-in tokenizer with
SmolVLM2's special tokens: the benchmark feeds token ids, only the tokenizer's special ids are read) and points
`vlm_model_name` there. The embedding keeps the full 49280-token vocabulary (the VLM config's).

The JSON (`--out-dir`, `smolvla_w2_<gpu>.json`; `--tiny`: `smolvla_tiny_<gpu>.json`) is rewritten after every
phase (flashrt, lerobot-eager + parity, LeRobot fp32 parity, lerobot-compile), so a run cut short by a timeout
keeps what finished; the table is printed last.

    python benchmarks/bench_smolvla.py [--out-dir benchmarks/results] [--skip-compile] [--no-fp32-parity]
    # on a CPU, tiny sizes, LeRobot's venv (the project on PYTHONPATH): the whole path, parity included
    PYTHONPATH=$PWD ~/.cache/lerobot-py311/bin/python benchmarks/bench_smolvla.py --tiny --device cpu --out-dir /tmp/b
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's flashrt_core first
import torch  # noqa: E402

import roofline  # noqa: E402
from _common import header  # noqa: E402

from flashrt_bench.harness import phase_samples  # noqa: E402
from flashrt_bench.lerobot import COMPILE_NOTE, bench_compiled, lerobot_call  # noqa: E402
from flashrt_bench.measure import PARITY_TARGETS, PeakMemory, compare, time_cuda  # noqa: E402
from flashrt_core.models.smolvla.config import LlamaConfig, SigLIPConfig, SmolVLAConfig, expert_mlp  # noqa: E402
from flashrt_core.models.smolvla.weights import TEXT, UNUSED, convert, expected_keys  # noqa: E402

WEIGHT_STD = 0.02
TARGETS = {"decision_p50_ms_max": 5.0, "act_only_p50_ms_max": 3.5, "speedup_vs_compile_min": 4.0,
           "parity": PARITY_TARGETS}
# what each row of the inputs is, in the engines' argument order
OBSERVATION = ("images", "image_masks", "lang_tokens", "lang_mask", "state")
LM_HEAD = "model.vlm_with_expert.vlm.lm_head.weight"

# ---- the model ----------------------------------------------------------------------------------------------
# Tiny sizes for the CPU check (and the CPU tests): every structural feature of the full size (pixel shuffle,
# GQA, alternating self / cross expert layers, a text model with more layers than are kept, a narrower expert).
TINY = SmolVLAConfig(
    vision=SigLIPConfig(hidden=32, mlp=64, layers=2, heads=2, image_size=64, patch=8),
    vlm=LlamaConfig(width=64, depth=4, mlp=128, heads=4, kv_heads=2, head_dim=16),
    expert=LlamaConfig(width=48, depth=4, mlp=expert_mlp(48), heads=4, kv_heads=2, head_dim=16),
    vocab_size=512, scale_factor=2, image_size=64, num_image_slots=2)
TINY_TEXT_LAYERS = 6  # the tiny VLM config's text layers (LeRobot keeps the first vlm.depth)

# The full-size SmolVLM2-500M-Video-Instruct config (transformers SmolVLMConfig) LeRobot reads from
# `vlm_model_name`. Source of each number: the hub's HuggingFaceTB/SmolVLM2-500M-Video-Instruct config.json as
# quoted in docs/smolvla-facts.md ([hub]) and in public offline copies of that file (not read from the hub
# itself: no network here); the two fields the hub file leaves out take transformers' SmolVLMVisionConfig
# defaults (marked).
FULL_VLM_CONFIG = {
    "architectures": ["SmolVLMForConditionalGeneration"],
    "model_type": "smolvlm",
    "scale_factor": 4,  # hub config.json scale_factor (1024 patches -> 64 tokens = processor image_seq_len 64)
    "image_token_id": 49190,  # hub config.json image_token_id (unused here: LeRobot embeds images itself)
    "tie_word_embeddings": False,  # hub config.json (lm_head is its own matrix; it never reaches the actions)
    "vision_config": {
        "model_type": "smolvlm_vision",
        "hidden_size": 768,  # hub vision_config.hidden_size (SigLIP base)
        "intermediate_size": 3072,  # not in the hub file: SmolVLMVisionConfig default
        "num_hidden_layers": 12,  # not in the hub file: SmolVLMVisionConfig default
        "num_attention_heads": 12,  # hub vision_config.num_attention_heads
        "image_size": 512,  # hub vision_config.image_size (patch16-512)
        "patch_size": 16,  # hub vision_config.patch_size
        "num_channels": 3,
        "hidden_act": "gelu_pytorch_tanh",  # SmolVLMVisionConfig default (SigLIP's gelu-tanh)
        "layer_norm_eps": 1e-6,  # SmolVLMVisionConfig default
    },
    "text_config": {  # SmolLM2-360M, hub text_config
        "model_type": "llama",
        "hidden_size": 960,  # hub text_config.hidden_size
        "intermediate_size": 2560,  # hub text_config.intermediate_size
        "num_hidden_layers": 32,  # hub text_config.num_hidden_layers (LeRobot keeps num_vlm_layers = 16)
        "num_attention_heads": 15,  # hub text_config.num_attention_heads
        "num_key_value_heads": 5,  # hub text_config.num_key_value_heads
        "head_dim": 64,  # hub text_config.head_dim
        "vocab_size": 49280,  # hub text_config.vocab_size
        "rms_norm_eps": 1e-5,  # hub text_config.rms_norm_eps
        "rope_theta": 100000.0,  # hub text_config.rope_theta (LeRobot's apply_rope uses 10000 anyway)
        "max_position_embeddings": 8192,  # hub text_config.max_position_embeddings
        "hidden_act": "silu",  # LlamaConfig default (SmolLM2)
        "pad_token_id": 2,  # hub text_config.pad_token_id
        "tie_word_embeddings": False,
    },
}


def workload_config(tiny: bool = False, views: int = 2, prompt_len: int | None = None, steps: int = 10,
                    chunk: int = 50) -> SmolVLAConfig:
    """The W2 SmolVLA (full size) or the tiny one, with the workload's views, prompt buffer, steps and chunk."""
    base = TINY if tiny else SmolVLAConfig.full_size()
    prompt = prompt_len if prompt_len is not None else (16 if tiny else 48)
    return dataclasses.replace(base, num_image_slots=views, tokenizer_max_length=prompt, num_steps=steps,
                               chunk_size=chunk)


def vlm_config_dict(config: SmolVLAConfig, tiny: bool = False) -> dict:
    """The SmolVLMConfig (as config.json) LeRobot builds its VLM from: the published full-size numbers, or the
    tiny config's sizes."""
    if not tiny:
        return json.loads(json.dumps(FULL_VLM_CONFIG))
    v, g = config.vision, config.vlm
    out = json.loads(json.dumps(FULL_VLM_CONFIG))
    out["scale_factor"] = config.scale_factor
    out["image_token_id"] = config.vocab_size - 1
    out["vision_config"].update(hidden_size=v.hidden, intermediate_size=v.mlp, num_hidden_layers=v.layers,
                                num_attention_heads=v.heads, image_size=v.image_size, patch_size=v.patch)
    out["text_config"].update(hidden_size=g.width, intermediate_size=g.mlp, num_hidden_layers=TINY_TEXT_LAYERS,
                              num_attention_heads=g.heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
                              vocab_size=config.vocab_size, max_position_embeddings=1024)
    return out


def lerobot_options(config: SmolVLAConfig) -> dict:
    """The LeRobot SmolVLAConfig options of the workload (beside features, device and vlm_model_name)."""
    return {"chunk_size": config.chunk_size, "n_action_steps": config.chunk_size, "num_steps": config.num_steps,
            "max_state_dim": config.max_state_dim, "max_action_dim": config.max_action_dim,
            "resize_imgs_with_padding": (config.image_size, config.image_size),
            "tokenizer_max_length": config.tokenizer_max_length, "num_vlm_layers": config.vlm.depth,
            "num_expert_layers": -1, "self_attn_every_n_layers": config.self_attn_every_n_layers,
            "expert_width_multiplier": config.expert.width / config.vlm.width, "attention_mode": "cross_attn",
            "min_period": config.min_period, "max_period": config.max_period, "load_vlm_weights": False,
            "add_image_special_tokens": False, "empty_cameras": 0}


def check_sizes(config: SmolVLAConfig, tiny: bool = False) -> None:
    """The sizes LeRobot derives from the VLM config and its options (`SmolVLAConfig.from_lerobot` reads them
    as LeRobot does) must be the workload's: else the two systems would not run the same model."""
    lr = {"type": "smolvla", **lerobot_options(config),
          "input_features": {f"observation.images.cam{i}": {"type": "VISUAL"} for i in range(config.num_image_slots)}}
    derived = SmolVLAConfig.from_lerobot(lr, vlm_config_dict(config, tiny), num_image_slots=config.num_image_slots)
    if derived != config:
        diff = {f.name: (getattr(derived, f.name), getattr(config, f.name)) for f in dataclasses.fields(config)
                if getattr(derived, f.name) != getattr(config, f.name)}
        raise RuntimeError(f"the VLM config LeRobot reads gives other sizes than the workload's: {diff}")


def is_norm_weight(name: str) -> bool:
    """LayerNorm / RMSNorm multipliers: `...norm.weight`, `...layernorm.weight`, `...layer_norm1.weight`."""
    parts = name.split(".")
    return parts[-1] == "weight" and "norm" in parts[-2]


def state_shapes(config: SmolVLAConfig) -> dict[str, tuple[int, ...]]:
    """{key: shape} of LeRobot's SmolVLA state dict: what the engine reads (`expected_keys`) and the two tensors
    it never reads (the text model's final norm, lm_head: `weights.UNUSED`)."""
    shapes = dict(expected_keys(config))
    shapes[TEXT + "norm.weight"] = (config.vlm.width,)
    shapes[LM_HEAD] = (config.vocab_size, config.vlm.width)
    assert set(shapes) - set(expected_keys(config)) == set(UNUSED)
    return shapes


def random_state(config: SmolVLAConfig, seed: int, device, std: float = WEIGHT_STD,
                 norm_init: str = "around1") -> dict[str, torch.Tensor]:
    """Every tensor of LeRobot's SmolVLA state dict (the engine's keys plus the two it never reads: the text
    model's final norm and lm_head), fp32, drawn on `device` in sorted key order from one seeded generator:
    normal(0, std); norm weights 1 + normal(0, std) unless norm_init is "normal"."""
    if norm_init not in ("around1", "normal"):
        raise ValueError(f"norm_init: around1 or normal, got {norm_init!r}")
    shapes = state_shapes(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        t = torch.randn(shape, generator=gen, device=device).mul_(std)
        if norm_init == "around1" and is_norm_weight(name):
            t.add_(1.0)
        out[name] = t
    return out


def random_inputs(config: SmolVLAConfig, seed: int, device, valid_tokens: int | None = None) -> dict:
    """Images in [-1, 1] for every slot (all cameras present), a prompt with `valid_tokens` real tokens (default:
    all but an eighth, like a padded real prompt; the rest masked), a normalized state ~ normal(0, 1), noise."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    s, views, n = config.image_size, config.num_image_slots, config.tokenizer_max_length
    valid = valid_tokens if valid_tokens is not None else max(1, n - n // 8)
    if not 1 <= valid <= n:
        raise ValueError(f"valid tokens: 1..{n}, got {valid}")
    return {
        "images": torch.rand(1, views, 3, s, s, generator=gen, device=device) * 2 - 1,
        "image_masks": torch.ones(1, views, dtype=torch.bool, device=device),
        "lang_tokens": torch.randint(0, config.vocab_size, (1, n), generator=gen, device=device),
        "lang_mask": torch.arange(n, device=device)[None] < valid,
        "state": torch.randn(1, config.max_state_dim, generator=gen, device=device),
        "noise": torch.randn(1, config.chunk_size, config.max_action_dim, generator=gen, device=device),
    }


def observation(inputs: dict) -> tuple:
    return tuple(inputs[k] for k in OBSERVATION)


# ---- bytes and FLOPs per stage, floors ------------------------------------------------------------------------
# Published figures (the floors are computed, never run). Thor and H200: benchmarks/roofline.py's. Orin: NVIDIA
# Jetson AGX Orin 64GB module data sheet: 204.8 GB/s LPDDR5; the GPU's 170 INT8 TOPS (sparse) give a dense bf16
# rate of 42.5 TFLOP/s (/2 for 2:4 sparsity, /2 for 16-bit operands on Ampere's tensor cores: derived, not
# published). H100: NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 dense bf16 TFLOP/s.
DEVICES = {
    "thor": roofline.DEVICES["thor"],
    "orin": {"name": "Jetson AGX Orin 64GB", "gbps": 204.8, "tflops": {"bf16": 42.5},
             "source": "NVIDIA Jetson AGX Orin 64GB data sheet: 204.8 GB/s; bf16 dense derived from the GPU's "
                       "170 sparse INT8 TOPS (/2 sparsity, /2 for 16-bit)"},
    "h100": {"name": "H100 SXM", "gbps": 3350.0, "tflops": {"bf16": 989.0},
             "source": "NVIDIA H100 datasheet (SXM): 3.35 TB/s, dense 989 bf16 TFLOP/s"},
    "h200": roofline.DEVICES["h200"],
}


def stage_parts(config: SmolVLAConfig, weight_bytes: float = 2.0) -> list[dict]:
    """Per part of a decision: {stage, part, weights (elements), bytes, flops[, flops_per_view]}. Bytes are the
    compulsory DRAM traffic: every GEMM weight once per pass (the views share one SigLIP pass), the input pixels,
    the prompt's embedding rows, the prefix K/V written once by observe and read by every act step. FLOPs: the
    GEMMs (2 per multiply-add) and the attention (QK^T and PV: 4 * queries * keys * width). Activations between
    kernels are not counted."""
    v, g, e = config.vision, config.vlm, config.expert
    views, t, tok, s = config.num_image_slots, config.patches, config.image_tokens, config.scale_factor
    p, c, steps = config.prefix_len, config.chunk_size, config.num_steps
    kv = g.kv_heads * g.head_dim
    qkv = lambda tw: tw.width * (tw.heads + 2 * tw.kv_heads) * tw.head_dim  # noqa: E731
    o = lambda tw: tw.heads * tw.head_dim * tw.width  # noqa: E731
    mlp = lambda tw: 3 * tw.width * tw.mlp  # noqa: E731
    cross = [config.is_cross(j * config.expert_stride) for j in range(e.depth)]
    n_cross = sum(cross)
    n_self = e.depth - n_cross
    # SigLIP: patch embedding + layers (q, k, v, out, fc1, fc2), once for all views; pixels and the position table
    w_vis = 3 * v.patch ** 2 * v.hidden + v.layers * (4 * v.hidden ** 2 + 2 * v.hidden * v.mlp)
    per_view = 2 * t * w_vis + v.layers * 4 * t * t * v.hidden
    w_conn = v.hidden * s * s * g.width
    # VLM: every layer's q|k|v; the last layer's attention output and MLP feed nothing (skipped); the state token
    w_vlm = g.depth * qkv(g) + (g.depth - 1) * (o(g) + mlp(g)) + config.max_state_dim * g.width
    kv_elems = e.depth * 2 * p * kv  # the prefix K/V every expert layer reads
    w_cross_kv = n_cross * 2 * kv * kv  # the cross layers' k / v projections of the VLM's K/V, once per observation
    w_exp = n_self * qkv(e) + n_cross * e.width * e.heads * e.head_dim + e.depth * (o(e) + mlp(e))
    attn_exp = (n_self * 4 * c * (p + c) + n_cross * 4 * c * p) * e.heads * e.head_dim
    a = config.max_action_dim
    w_io = a * e.width + 2 * e.width * e.width + e.width * a  # action in, action-time MLP (action half, out), out
    b = weight_bytes
    return [
        {"stage": "observe", "part": f"siglip ({views} views, one pass)", "weights": w_vis,
         "bytes": b * (w_vis + t * v.hidden + views * 3 * config.image_size ** 2), "flops": views * per_view,
         "flops_per_view": per_view},
        {"stage": "observe", "part": "connector (pixel shuffle + projection)", "weights": w_conn, "bytes": b * w_conn,
         "flops": views * 2 * tok * w_conn},
        {"stage": "observe", "part": f"vlm ({g.depth} layers over {p} tokens)", "weights": w_vlm,
         "bytes": b * (w_vlm + config.tokenizer_max_length * g.width + kv_elems),
         "flops": 2 * p * w_vlm + (g.depth - 1) * 4 * p * p * g.heads * g.head_dim},
        {"stage": "observe", "part": f"cross k/v projections ({n_cross} layers)", "weights": w_cross_kv,
         "bytes": b * w_cross_kv, "flops": 2 * p * w_cross_kv},
        {"stage": "act", "part": f"expert ({e.depth} layers) x {steps} steps", "weights": w_exp,
         "bytes": steps * b * (w_exp + kv_elems), "flops": steps * (2 * c * w_exp + attn_exp)},
        {"stage": "act", "part": f"action in/out + time MLP x {steps} steps", "weights": w_io,
         "bytes": steps * b * w_io, "flops": steps * 2 * c * w_io},
    ]


def stage_floors(config: SmolVLAConfig, weight_bytes: float = 2.0) -> dict:
    """{"parts": stage_parts, "stages": {observe, act: {bytes, flops}}, "floors": {device: {stage: {memory_ms,
    compute_ms, floor_ms, bound}}, "decision": {floor_ms, max_hz}}}, "devices": DEVICES}."""
    parts = stage_parts(config, weight_bytes)
    stages = {s: {"bytes": sum(p["bytes"] for p in parts if p["stage"] == s),
                  "flops": sum(p["flops"] for p in parts if p["stage"] == s)} for s in ("observe", "act")}
    floors = {}
    for key, dev in DEVICES.items():
        out = {}
        for s, cost in stages.items():
            mem = cost["bytes"] / (dev["gbps"] * 1e9) * 1e3
            comp = cost["flops"] / (dev["tflops"]["bf16"] * 1e12) * 1e3
            out[s] = {"memory_ms": mem, "compute_ms": comp, "floor_ms": max(mem, comp),
                      "bound": "memory" if mem >= comp else "compute"}
        whole = out["observe"]["floor_ms"] + out["act"]["floor_ms"]
        out["decision"] = {"floor_ms": whole, "max_hz": 1e3 / whole}
        out["act"]["max_hz"] = 1e3 / out["act"]["floor_ms"]
        floors[key] = out
    return {"weight_bytes": weight_bytes, "parts": parts, "stages": stages, "floors": floors, "devices": DEVICES}


def card_key(gpu: str) -> str | None:
    """The DEVICES key of the card that ran (h100 / h200), for the measured-vs-floor ratios."""
    name = gpu.lower()
    return "h200" if "h200" in name else "h100" if "h100" in name else None


def gpu_short(gpu: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200', 'cpu' -> 'cpu' (the result file's suffix)."""
    name = gpu.lower()
    m = re.search(r"\b(gh200|gb200|h200|h100|b200|b100|a100|l40s|l40|l4|a10g|a10)\b", name)
    if m:
        return m.group(1)
    return re.sub(r"[^a-z0-9]+", "_", name.replace("nvidia", "")).strip("_") or "unknown"


# ---- LeRobot ----------------------------------------------------------------------------------------------------
_VLM_DIRS: dict = {}
BASE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolVLM2's tokenizer
EXTRA_SPECIALS = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                  "end_of_utterance_token": "<end_of_utterance>", "global_image_token": "<global-img>"}


def write_vlm_folder(config: SmolVLAConfig, tiny: bool, folder: pathlib.Path) -> dict:
    """config.json (SmolVLMConfig), and a SmolVLMProcessor whose tokenizer is a byte-level BPE stand-in (the 256
    byte symbols, no merges) with SmolVLM2's special tokens (pad `<|im_end|>` = 2, the image tokens LeRobot
    asks the tokenizer for). Returns what was written. The processor's image / video processors need PIL and
    torchvision; where they cannot be built, only the tokenizer is saved (see `processor_shim`)."""
    from tokenizers import pre_tokenizers
    from transformers import GPT2Tokenizer, SmolVLMConfig

    folder.mkdir(parents=True, exist_ok=True)
    cfg = vlm_config_dict(config, tiny)
    vision, text = cfg.pop("vision_config"), cfg.pop("text_config")
    SmolVLMConfig(vision_config=vision, text_config=text, **{k: v for k, v in cfg.items() if k != "model_type"}
                  ).save_pretrained(str(folder))
    vocab = {t: i for i, t in enumerate(BASE_SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = GPT2Tokenizer(vocab=vocab, merges=[], unk_token="<|endoftext|>", bos_token="<|im_start|>",
                        eos_token="<end_of_utterance>", pad_token="<|im_end|>",
                        extra_special_tokens=dict(EXTRA_SPECIALS))
    info = {"tokenizer_vocab": len(tok), "pad_token_id": tok.pad_token_id,
            "fake_image_token_id": tok.fake_image_token_id, "global_image_token_id": tok.global_image_token_id}
    try:
        from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

        px = config.image_size
        SmolVLMProcessor(image_processor=SmolVLMImageProcessor(size={"longest_edge": 4 * px},
                                                               max_image_size={"longest_edge": px}),
                         video_processor=SmolVLMVideoProcessor(size={"longest_edge": px},
                                                               max_image_size={"longest_edge": px}),
                         tokenizer=tok, image_seq_len=config.image_tokens).save_pretrained(str(folder))
        info["processor"] = "SmolVLMProcessor"
    except Exception as exc:  # (no PIL / torchvision: the tokenizer alone)
        tok.save_pretrained(str(folder))
        info["processor"] = f"tokenizer only ({type(exc).__name__}: {exc})"
    info["files"] = sorted(p.name for p in folder.iterdir())
    return info


def vlm_folder(config: SmolVLAConfig, tiny: bool) -> tuple[pathlib.Path, dict]:
    """One folder per process and model size (tempfile), written on first use."""
    key = (tiny, config.vocab_size)
    if key not in _VLM_DIRS:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="smolvlm2_offline_"))
        _VLM_DIRS[key] = (folder, write_vlm_folder(config, tiny, folder))
    return _VLM_DIRS[key]


class processor_shim:
    """Where `AutoProcessor.from_pretrained(folder)` fails on this machine (no PIL / torchvision / num2words),
    LeRobot's module gets, for the policy's construction only, an AutoProcessor whose processor is the folder's
    tokenizer: all LeRobot reads of it is `processor.tokenizer.{fake,global}_image_token_id`. Reported in the
    JSON (`lerobot.processor`)."""

    def __init__(self, folder):
        self.folder, self.used, self.error = str(folder), False, None

    def __enter__(self):
        from lerobot.policies.smolvla import smolvlm_with_expert as m
        from transformers import AutoProcessor, AutoTokenizer

        self.module, self.original = m, m.AutoProcessor
        try:
            AutoProcessor.from_pretrained(self.folder)
            return self
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

        class TokenizerOnly:
            @staticmethod
            def from_pretrained(name, *args, **kwargs):
                import types
                return types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(name))
        m.AutoProcessor = TokenizerOnly
        self.used = True
        return self

    def __exit__(self, *exc):
        self.module.AutoProcessor = self.original
        return False


def make_lerobot_policy(config: SmolVLAConfig, device, tiny: bool = False, build_device=None):
    """LeRobot 0.6.1's SmolVLAPolicy of the workload, offline (its VLM folder written here), constructed under
    `torch.device(build_device or device)` -> (policy with LeRobot's own random init, info). Checks that LeRobot
    derived the workload's sizes."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LeRobotSmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    folder, folder_info = vlm_folder(config, tiny)
    size = config.image_size
    features = {f"observation.images.cam{i}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, size, size))
                for i in range(config.num_image_slots)}
    features["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(config.max_state_dim,))
    cfg = LeRobotSmolVLAConfig(
        input_features=features,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(config.max_action_dim,))},
        vlm_model_name=str(folder), device=str(device), **lerobot_options(config))
    with processor_shim(folder) as shim, torch.device(build_device or device):  # (HF's init on a CPU: minutes)
        policy = SmolVLAPolicy(cfg)
    vwe = policy.model.vlm_with_expert
    built = {"expert_width": vwe.expert_hidden_size, "expert_mlp": vwe.lm_expert.config.intermediate_size,
             "vlm_layers": vwe.num_vlm_layers, "expert_layers": vwe.num_expert_layers,
             "vocab": vwe.get_vlm_model().text_model.embed_tokens.weight.shape[0]}
    want = {"expert_width": config.expert.width, "expert_mlp": config.expert.mlp, "vlm_layers": config.vlm.depth,
            "expert_layers": config.expert.depth, "vocab": config.vocab_size}
    if built != want:
        raise RuntimeError(f"LeRobot built other sizes than the workload's: {built} vs {want}")
    info = {"vlm_folder": folder_info, "sizes": built,
            "processor": "AutoProcessor (SmolVLMProcessor)" if not shim.used
            else f"tokenizer-only shim: AutoProcessor failed here ({shim.error})"}
    return policy, info


def build_lerobot_smolvla(config: SmolVLAConfig, state: dict, dtype: str = "bfloat16", device="cuda",
                          tiny: bool = False):
    """`make_lerobot_policy` with `state` copied in by key name -> (policy, info). dtype "bfloat16": the VLM and
    the expert in bf16, the projections in fp32 (as LeRobot builds it over a bf16 SmolVLM2); "float32":
    everything fp32. Raises on a missing or unexpected key that matters (the text model's final norm and lm_head
    never reach the actions: missing, they are reported only)."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype: bfloat16 or float32, got {dtype!r}")
    t0 = time.time()
    policy, info = make_lerobot_policy(config, device, tiny)
    missing, unexpected = policy.load_state_dict(state, strict=False)
    bad_missing = [k for k in missing if k not in UNUSED]
    info.update(dtype=dtype, missing_keys=list(missing), unexpected_keys=list(unexpected))
    if bad_missing or unexpected:
        raise RuntimeError(f"LeRobot SmolVLA state dict mismatch: {len(bad_missing)} missing {bad_missing[:8]}, "
                           f"{len(unexpected)} unexpected {list(unexpected)[:8]}")
    if dtype == "bfloat16":
        policy.model.vlm_with_expert.to(torch.bfloat16)
    info["param_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in policy.parameters()})
    info["build_s"] = time.time() - t0
    return policy.eval(), info


def check_lerobot_keys(config: SmolVLAConfig, tiny: bool = False) -> dict:
    """LeRobot's policy of the workload constructed on the meta device (no memory, no init: seconds even at full
    size on a CPU): its state dict's names and shapes against the benchmark's (`state_shapes`)."""
    policy, info = make_lerobot_policy(config, "cpu", tiny, build_device="meta")
    theirs = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    ours = state_shapes(config)
    out = {"lerobot_keys": len(theirs), "bench_keys": len(ours), "sizes": info["sizes"],
           "processor": info["processor"],
           "missing": sorted(set(theirs) - set(ours)), "unexpected": sorted(set(ours) - set(theirs)),
           "wrong_shape": sorted(f"{k}: {ours[k]} (LeRobot {theirs[k]})" for k in set(ours) & set(theirs)
                                 if ours[k] != theirs[k])}
    out["ok"] = not (out["missing"] or out["unexpected"] or out["wrong_shape"])
    return out


# ---- the benchmark ---------------------------------------------------------------------------------------------
def engine_options(device) -> list[dict]:
    """Full options first; the fallbacks keep numbers worth having should capture or the Triton GEMMs fail on
    this GPU (the JSON says which ran and why). Off CUDA: torch kernels, no graphs."""
    if torch.device(device).type != "cuda":
        return [{"backend": "torch", "graphs": False, "gemm": "torch"}]
    return [{}, {"pdl": False}, {"gemm": "torch", "pdl": False}, {"gemm": "torch", "graphs": False, "pdl": False}]


def build_engine(w32, inputs, device, torch_dtype, log):
    from flashrt_core.models.smolvla.engine import SmolVLAEngine

    errors = []
    for opts in engine_options(device):
        try:
            eng = SmolVLAEngine(w32, device=device, dtype=torch_dtype, vision_dtype=torch_dtype, **opts)
            eng.sample_actions(*observation(inputs), inputs["noise"])
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            return eng, opts, errors
        except Exception as exc:
            errors.append(f"{opts or 'default'}: {type(exc).__name__}: {exc}")
            log(f"[smolvla] engine {opts or 'default'} failed: {errors[-1]}")
    raise RuntimeError("flashrt engine failed with every option: " + " | ".join(errors))


def parse_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def run_flashrt(doc, config, w32, inputs, truths, args, log) -> None:
    """Build the engine, time it (whole decision, act-only, the stage graphs, a decision's phases), keep its
    actions for the parity."""
    device, torch_dtype = args.device, parse_dtype(args.dtype)
    warmup, iters = args.warmup, args.iters
    t0 = time.time()
    with PeakMemory(device) as mem:
        eng, opts, errors = build_engine(w32, inputs, device, torch_dtype, log)
        build_s = time.time() - t0
        obs, noise = observation(inputs), inputs["noise"]
        whole = time_cuda(lambda: eng.sample_actions(*obs, noise), warmup, iters, device)
        prefix = eng.encode_prefix(*obs)
        act_only = time_cuda(lambda: eng.denoise(prefix, noise), warmup, iters, device)
        eng.buffers.noise.copy_(noise)
        observe_stage = time_cuda(eng.observe, warmup, iters, device)  # (refills the same prefix)
        act_stage = time_cuda(eng.act, warmup, iters, device)
        phases = phase_samples({"set_observation": lambda: eng.set_observation(*obs), "decision": eng.decision},
                               warmup, iters, device)
        truths["flashrt"] = eng.sample_actions(*obs, noise)
    if "reference_fp32" in truths:
        doc["parity"]["flashrt_vs_reference_fp32"] = compare(truths["flashrt"], truths["reference_fp32"])
    r = doc["results"]
    r["flashrt"] = {**whole, "peak_mem_gib": mem.gib, "phases_p50_ms": phases,
                    "call": "engine.sample_actions(images, image_masks, lang_tokens, lang_mask, state, noise)"}
    r["flashrt-act-only"] = {**act_only, "peak_mem_gib": mem.gib, "call": "engine.denoise(prefix, noise)"}
    r["flashrt-observe"] = {**observe_stage, "call": "engine.observe() (stage graph)"}
    r["flashrt-act"] = {**act_stage, "call": "engine.act() on a filled prefix (stage graph)"}
    doc["engine"] = {"class": f"{type(eng).__module__}.{type(eng).__name__}", "build_s": build_s,
                     "options": opts or "default (graphs, gemm auto, PDL where supported, attention tuned)",
                     "errors": errors, "captures": getattr(eng, "captures", 0),
                     "gemm_choices": eng.linear.report(), "attention_choices": eng.attend.report()}
    log(f"[smolvla] flashrt p50 {whole['p50_ms']:.3f} ms, act-only {act_only['p50_ms']:.3f} ms, observe "
        f"{observe_stage['p50_ms']:.3f} ms, act {act_stage['p50_ms']:.3f} ms (build {build_s:.1f} s)")
    del eng, prefix
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_reference(doc, w32, inputs, truths) -> None:
    """The project's fp32 eager reference on the same weights and inputs (the parity's fp32 truth), and how much
    of the actions is the model's: |actions - noise| / |actions| (what the action-level parity can resolve)."""
    from flashrt_core.models.smolvla import reference as R

    t0 = time.time()
    with torch.no_grad():
        truths["reference_fp32"] = R.sample_actions(w32, *observation(inputs), inputs["noise"])
    ref, noise = truths["reference_fp32"], inputs["noise"]
    doc["parity"]["model_share_reference_fp32"] = {
        "value": ((ref - noise).norm() / ref.norm()).item(),
        "note": "|actions - noise| / |actions| of the fp32 reference: the part of the actions the model adds to "
                "the noise (both systems get the same noise); *_model_part compares that part alone"}
    if "flashrt" in truths:
        doc["parity"]["flashrt_vs_reference_fp32"] = compare(truths["flashrt"], ref)
    doc["timings_s"]["reference_fp32"] = time.time() - t0


def add_parity(doc, truths: dict, theirs: torch.Tensor, suffix: str, noise: torch.Tensor) -> None:
    """{name}_vs_{suffix} for each of `truths` against LeRobot's actions; the gate's model part beside it."""
    for name, actions in truths.items():
        doc["parity"][f"{name}_vs_{suffix}"] = compare(actions, theirs)
        part = compare(actions - noise, theirs - noise)
        part["gate"] = False
        doc["parity"][f"{name}_vs_{suffix}_model_part"] = part


def run_lerobot(doc, config, state, inputs, truths, args, log, shared: dict) -> None:
    """LeRobot in the engine's dtype: its actions against FlashRT's and the reference's, eager timing."""
    lr_dtype = "bfloat16" if args.dtype == "bf16" else "float32"
    t0 = time.time()
    with PeakMemory(args.device) as mem:
        policy, info = build_lerobot_smolvla(config, state, lr_dtype, args.device, args.tiny)
        shared["lerobot"] = policy
        doc["lerobot"] = info
        call = lerobot_call(policy, inputs)
        theirs = call()
        add_parity(doc, truths, theirs, "lerobot", inputs["noise"])
        eager = time_cuda(call, args.warmup, args.iters, args.device)
    doc["results"]["lerobot-eager"] = {**eager, "peak_mem_gib": mem.gib, "peak_mem_includes_weights": True,
                                       "call": "policy.model.sample_actions(images, img_masks, lang_tokens, "
                                               "lang_masks, state, noise=noise)"}
    doc["timings_s"]["lerobot"] = time.time() - t0
    gate = doc["parity"].get("flashrt_vs_lerobot")
    log(f"[smolvla] lerobot-eager p50 {eager['p50_ms']:.2f} ms" + (
        f"; FlashRT vs LeRobot: cosine {gate['cosine']:.6f}, rel L2 {gate['rel_l2']:.2e}" if gate else ""))


def run_lerobot_fp32(doc, config, state, inputs, truths, args, log) -> None:
    """LeRobot in float32, built for this one call and dropped: against the fp32 reference and FlashRT."""
    t0 = time.time()
    policy, info = build_lerobot_smolvla(config, state, "float32", args.device, args.tiny)
    theirs = lerobot_call(policy, inputs)()
    add_parity(doc, truths, theirs, "lerobot_fp32", inputs["noise"])
    doc["lerobot_fp32"] = {k: info[k] for k in ("missing_keys", "unexpected_keys", "param_dtypes", "build_s")}
    del policy, theirs
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    doc["timings_s"]["lerobot_fp32_parity"] = time.time() - t0
    p = doc["parity"].get("reference_fp32_vs_lerobot_fp32")
    if p:
        log(f"[smolvla] reference fp32 vs LeRobot fp32: cosine {p['cosine']:.7f}, rel L2 {p['rel_l2']:.2e}")


def run_compile(doc, inputs, args, log, shared: dict) -> None:
    doc["results"]["lerobot-compile"] = {"error": f"not finished: compiling began {time.time() - T0:.0f} s into "
                                                  "the run (a timeout ended it?)"}
    write(doc, args)  # so that a run killed while compiling says so
    r = bench_compiled(shared["lerobot"], inputs, args.compile_mode, args.warmup, args.iters, log)
    doc["results"]["lerobot-compile"] = {**r, "call": "torch.compile(policy.model.sample_actions, mode=%r)"
                                         % args.compile_mode}
    doc["notes"].append(COMPILE_NOTE % args.compile_mode)


def speedups_and_targets(doc) -> None:
    r = doc["results"]
    base = r.get("flashrt", {}).get("p50_ms")
    for name in ("lerobot-eager", "lerobot-compile"):
        if base and "p50_ms" in r.get(name, {}):
            r[name]["flashrt_speedup"] = r[name]["p50_ms"] / base
    act = r.get("flashrt-act-only", {}).get("p50_ms")
    speed = r.get("lerobot-compile", {}).get("flashrt_speedup")
    gate = doc["parity"].get("flashrt_vs_lerobot", {})
    doc["targets"] = {
        **TARGETS,
        "decision_p50_ms": base, "act_only_p50_ms": act, "speedup_vs_compile": speed,
        "met": {"decision": None if base is None else base <= TARGETS["decision_p50_ms_max"],
                "act_only": None if act is None else act <= TARGETS["act_only_p50_ms_max"],
                "speedup_vs_compile": None if speed is None else speed >= TARGETS["speedup_vs_compile_min"],
                "parity_vs_lerobot": gate.get("pass")},
        "note": "p50 of each; act-only is engine.denoise(prefix, noise) (the act graph plus the noise copy in and "
                "the actions out; flashrt-act is the graph alone); the speed-up is lerobot-compile p50 / flashrt "
                "(whole decision) p50, same process; parity is FlashRT bf16 vs LeRobot bf16 on the same weights, "
                "inputs and noise"}


def add_measured_vs_floors(doc) -> None:
    """Per stage on the card that ran: achieved GB/s and TFLOP/s, and the floor's share of the measured time."""
    key = card_key(doc["gpu"])
    r, roof = doc["results"], doc["roofline"]
    stages = {"observe": r.get("flashrt-observe", {}).get("p50_ms"), "act": r.get("flashrt-act", {}).get("p50_ms")}
    out = {}
    for stage, ms in stages.items():
        if not ms:
            continue
        cost = roof["stages"][stage]
        out[stage] = {"ms": ms, "gbps": cost["bytes"] / (ms * 1e-3) / 1e9, "tflops": cost["flops"] / (ms * 1e-3) / 1e12}
        if key:
            out[stage]["floor_ms"] = roof["floors"][key][stage]["floor_ms"]
            out[stage]["floor_share"] = out[stage]["floor_ms"] / ms
    roof["measured"] = {"card": key, "stages": out}


SYSTEMS = ("flashrt", "flashrt-act-only", "flashrt-observe", "flashrt-act", "lerobot-eager", "lerobot-compile")


def write(doc, args) -> pathlib.Path:
    doc["results"] = {k: doc["results"][k] for k in sorted(doc["results"], key=lambda k: (
        SYSTEMS.index(k) if k in SYSTEMS else len(SYSTEMS), k))}
    speedups_and_targets(doc)
    path = pathlib.Path(args.out_dir) / result_name(doc["gpu"], args.tiny)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def result_name(gpu: str, tiny: bool = False) -> str:
    return f"smolvla_{'tiny' if tiny else 'w2'}_{gpu_short(gpu)}.json"


# ---- output --------------------------------------------------------------------------------------------------
def print_roofline(doc, out=print) -> None:
    roof = doc["roofline"]
    out(f"SmolVLA bytes and FLOPs per decision (computed; weights {roof['weight_bytes']:g} bytes each; activations "
        "not counted)")
    out(f"{'stage':<8} {'part':<42} {'Mparams':>8} {'MB':>9} {'GFLOP':>9} {'GFLOP/view':>10}")
    for p in roof["parts"]:
        per_view = f"{p['flops_per_view'] / 1e9:>10.1f}" if "flops_per_view" in p else f"{'':>10}"
        out(f"{p['stage']:<8} {p['part']:<42} {p['weights'] / 1e6:>8.2f} {p['bytes'] / 1e6:>9.1f} "
            f"{p['flops'] / 1e9:>9.1f} {per_view}")
    for s, c in roof["stages"].items():
        out(f"{s:<8} {'total':<42} {'':>8} {c['bytes'] / 1e6:>9.1f} {c['flops'] / 1e9:>9.1f}")
    out(f"{'floor = max(bytes / GB/s, FLOPs / bf16 rate)':<52} {'observe ms':>16} {'act ms':>16} "
        f"{'decision ms':>18} {'act at most':>11}")
    for key, f in roof["floors"].items():
        dev = roof["devices"][key]
        o, a = f["observe"], f["act"]
        label = f"{dev['name']}, {dev['gbps']:g} GB/s, {dev['tflops']['bf16']:g} TFLOP/s"
        out(f"{label:<52} {o['floor_ms']:>8.2f} {o['bound']:<7} {a['floor_ms']:>8.2f} {a['bound']:<7} "
            f"{f['decision']['floor_ms']:>8.2f} ({f['decision']['max_hz']:>4.0f} Hz) {a['max_hz']:>8.0f} Hz")
    m = roof.get("measured", {})
    for stage, s in m.get("stages", {}).items():
        share = f", floor {s['floor_ms']:.3f} ms = {100 * s['floor_share']:.0f}% of it" if "floor_ms" in s else ""
        out(f"measured {stage:<8} {s['ms']:.3f} ms: {s['gbps']:.0f} GB/s, {s['tflops']:.1f} TFLOP/s{share} "
            f"({m.get('card') or 'no floor for this card'})")


def print_table(doc, out=print) -> None:
    w = doc["workload"]
    out(f"SmolVLA {'tiny' if w.get('tiny') else 'W2'}: {w['views']} views {w['image_size']}x{w['image_size']}, "
        f"prompt {w['prompt_len']} ({w['valid_prompt_tokens']} valid), {w['steps']} steps, chunk {w['chunk']}, "
        f"{w['dtype']}, batch 1 on {doc['gpu']} (commit {str(doc['commit'])[:12]})")
    out(f"{'system':<18} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'peak GiB':>9} {'speed-up':>9}")
    for name, r in doc["results"].items():
        if "p50_ms" not in r:
            out(f"{name:<18} {r.get('error', r.get('skipped', '?'))}")
            continue
        speed = f"{r['flashrt_speedup']:>8.1f}x" if "flashrt_speedup" in r else f"{'':>9}"
        peak = f"{r['peak_mem_gib']:>9.2f}" if "peak_mem_gib" in r else f"{'':>9}"
        out(f"{name:<18} {r['p50_ms']:>9.3f} {r['p90_ms']:>9.3f} {r['p99_ms']:>9.3f} {peak} {speed}")
    share = doc["parity"].get("model_share_reference_fp32")
    if share:
        out(f"the model's share of the actions (|actions - noise| / |actions|, fp32 reference): {share['value']:.3f}")
    for name, p in doc["parity"].items():
        if isinstance(p, dict) and "cosine" in p:
            verdict = ("PASS" if p["pass"] else "FAIL") if p.get("gate", True) else ("(info)" if p["pass"] else
                                                                                      "(info, off target)")
            out(f"parity {name:<40} cosine {p['cosine']:.6f}  rel L2 {p['rel_l2']:.2e}  max abs "
                f"{p['max_abs']:.2e}  {verdict}")
    t = doc.get("targets", {})
    met = t.get("met", {})

    def verdict(key):
        return {True: "MET", False: "MISSED", None: "not measured"}[met.get(key)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    out(f"target whole decision p50 <= {TARGETS['decision_p50_ms_max']} ms: {fmt(t.get('decision_p50_ms'), '.3f')} "
        f"ms {verdict('decision')}; act-only p50 <= {TARGETS['act_only_p50_ms_max']} ms: "
        f"{fmt(t.get('act_only_p50_ms'), '.3f')} ms {verdict('act_only')}; >= {TARGETS['speedup_vs_compile_min']:g}x "
        f"torch.compile: {fmt(t.get('speedup_vs_compile'), '.1f')}x {verdict('speedup_vs_compile')}; parity vs "
        f"LeRobot: {verdict('parity_vs_lerobot')}")


# ---- main ----------------------------------------------------------------------------------------------------------
T0 = time.time()


def exit_code(doc: dict) -> int:
    """0: every phase ran (whatever the numbers; the JSON and the table say whether targets were met); 1: a phase
    failed, FlashRT did not run, or (--keys-only) the state dicts differ."""
    if "keys" in doc:
        return 0 if doc["keys"]["ok"] else 1
    return 1 if doc.get("errors") or "flashrt" not in doc.get("phases_done", []) else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny model sizes (the CPU check), smolvla_tiny_<gpu>.json")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="engine and LeRobot dtype (default bf16)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--valid-tokens", type=int, default=None, help="real prompt tokens (default: all but an eighth)")
    p.add_argument("--norm-init", default="around1", choices=("around1", "normal"),
                   help="norm weights 1 + normal(0, 0.02) (default) or normal(0, 0.02) like every other tensor")
    p.add_argument("--skip-compile", action="store_true", help="leave out lerobot-compile (minutes of compiling)")
    p.add_argument("--compile-mode", default="default")
    p.add_argument("--fp32-parity", action=argparse.BooleanOptionalAction, default=True,
                   help="also the fp32 reference and FlashRT against LeRobot in float32 (default on)")
    p.add_argument("--skip-lerobot", action="store_true", help="FlashRT only (no LeRobot installed)")
    p.add_argument("--keys-only", action="store_true",
                   help="only build LeRobot's policy on the meta device and compare its state dict's names and "
                        "shapes with the benchmark's (seconds on a CPU, full size included); exit 1 on a mismatch")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv=None, log=print) -> dict:
    global T0
    T0 = time.time()
    # nothing may reach the network (the GPU machine has none); set before LeRobot imports transformers
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA GPU (use --device cpu --tiny)")
    config = workload_config(args.tiny)
    check_sizes(config, args.tiny)
    if args.keys_only:
        keys = check_lerobot_keys(config, args.tiny)
        log(json.dumps(keys, indent=1))
        return {"keys": keys}
    torch_dtype = parse_dtype(args.dtype)
    workload = {"model": "smolvla", "tiny": args.tiny, "views": config.num_image_slots,
                "image_size": config.image_size, "prompt_len": config.tokenizer_max_length, "valid_prompt_tokens": None,
                "steps": config.num_steps, "chunk": config.chunk_size, "dtype": args.dtype, "batch": 1,
                "prefix_len": config.prefix_len, "image_tokens_per_view": config.image_tokens,
                "sizes": dataclasses.asdict(config),
                "weights": f"normal(0, {WEIGHT_STD}) every tensor" + (f", norm weights 1 + normal(0, {WEIGHT_STD})"
                                                                      if args.norm_init == "around1" else ""),
                "seed": args.seed, "device": args.device,
                "timing": f"{'CUDA events' if cuda else 'host clock'}, {args.warmup} warm-ups, {args.iters} timed "
                          "calls, sync after each call; p50 / p90 / p99"}
    doc = {**header(workload), "results": {}, "parity": {"targets": PARITY_TARGETS}, "notes": [], "timings_s": {},
           "roofline": stage_floors(config, torch_dtype.itemsize)}
    doc["gpu_short"] = gpu_short(doc["gpu"])
    add_measured_vs_floors(doc)

    t0 = time.time()
    state = random_state(config, args.seed, args.device, norm_init=args.norm_init)
    w32 = convert(config, state)
    inputs = random_inputs(config, args.seed, args.device, args.valid_tokens)
    workload["valid_prompt_tokens"] = int(inputs["lang_mask"].sum())
    doc["timings_s"]["weights"] = time.time() - t0
    log(f"[smolvla] {'tiny' if args.tiny else 'full-size'} weights drawn + converted in {time.time() - t0:.1f} s; "
        f"prefix {config.prefix_len} tokens")

    truths, shared = {}, {}
    phases = [("flashrt", lambda: run_flashrt(doc, config, w32, inputs, truths, args, log)),
              ("reference_fp32", lambda: run_reference(doc, w32, inputs, truths))]
    if not args.skip_lerobot:
        phases.append(("lerobot", lambda: run_lerobot(doc, config, state, inputs, truths, args, log, shared)))
        if args.fp32_parity:
            phases.append(("lerobot_fp32", lambda: run_lerobot_fp32(doc, config, state, inputs, truths, args, log)))
        if args.skip_compile:
            doc["results"]["lerobot-compile"] = {"skipped": "--skip-compile"}
        elif not cuda:
            doc["results"]["lerobot-compile"] = {"skipped": "not on a CPU (inductor's C++ build: minutes)"}
        else:
            phases.append(("lerobot-compile", lambda: run_compile(doc, inputs, args, log, shared)))
    doc["phases_done"] = []
    for name, fn in phases:
        t0 = time.time()
        try:
            fn()
            doc["phases_done"].append(name)
        except Exception as exc:  # reported, never hidden: the phases after it still run where they can
            doc.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            log(f"[smolvla] {name} failed: {doc['errors'][name]}")
            if name == "lerobot":
                for k in ("lerobot-eager", "lerobot-compile"):
                    doc["results"].setdefault(k, {"error": doc["errors"][name]})
            if name == "lerobot-compile":
                doc["results"]["lerobot-compile"] = {"error": doc["errors"][name]}
        add_measured_vs_floors(doc)
        path = write(doc, args)
        log(f"[smolvla] {name} done in {time.time() - t0:.0f} s ({time.time() - T0:.0f} s so far); wrote {path}")
        if name == "lerobot" and name not in doc["phases_done"]:
            break
    print_roofline(doc, log)
    print_table(doc, log)  # last
    return doc


if __name__ == "__main__":
    sys.exit(exit_code(main()))
