"""The LeRobot 0.6.1 side of `flashrt bench`: the policy built from the same random state dict, its
`model.sample_actions` as the eager and `torch.compile` baselines, and its actions for the parity checks.

pi0.5 is `PI05Policy.model.sample_actions(images, img_masks, tokens, masks, noise=)`; pi0 is
`PI0Policy.model.sample_actions(images, img_masks, lang_tokens, lang_masks, state, noise=)` (the state
[B, max_state_dim], already padded, before the noise). Both are built under `with torch.device("cuda")`:
HF's random init on the CPU would take minutes, and the random init is overwritten by the state dict anyway.
"""
from __future__ import annotations

import time

import torch

from flashrt_bench.measure import PeakMemory, compare, time_cuda
from flashrt_core.models import registry

# Where each model's policy lives in LeRobot 0.6.1: (configuration module, config class, modeling module, policy)
POLICIES = {kind: entry.lerobot for kind, entry in registry.MODELS.items()}
COMPILE_NOTE = ("lerobot-compile uses torch.compile mode '%s'; LeRobot's default max-autotune is not measured: "
                "it did not finish compiling within 8 minutes on the H200 (docs/gpu-machine.md)")


def lerobot_dtype(torch_dtype: torch.dtype) -> str:
    """LeRobot's `dtype` option for an engine dtype (it knows only bfloat16 and float32)."""
    return "bfloat16" if torch_dtype == torch.bfloat16 else "float32"


def policy_config(config, dtype: str = "bfloat16", device: str = "cuda"):
    """The LeRobot config of the workload `config` (its `kind` picks PI05Config or PI0Config): every camera
    slot a 224x224 visual feature; pi0's state feature is added by LeRobot itself (max_state_dim wide)."""
    import importlib

    from lerobot.configs.types import FeatureType, PolicyFeature

    conf_module, conf_class = POLICIES[config.kind][:2]
    size = config.vision.image_size
    cams = {f"observation.images.cam{i}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, size, size))
            for i in range(config.num_image_slots)}
    return getattr(importlib.import_module(conf_module), conf_class)(
        dtype=dtype, device=device, chunk_size=config.chunk_size, n_action_steps=config.chunk_size,
        num_inference_steps=config.num_steps, tokenizer_max_length=config.tokenizer_max_length,
        max_action_dim=config.action_dim, max_state_dim=config.state_dim, input_features=cams,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(config.action_dim,))})


def build_lerobot(config, state: dict, dtype: str = "bfloat16", device: str = "cuda"):
    """LeRobot 0.6.1 PI05Policy / PI0Policy (by `config.kind`) with `state` copied in by key name (the lm_head
    keys are the only ones left out: the bench's state has none)."""
    import importlib

    model_module, policy_class = POLICIES[config.kind][2:]
    policy_cls = getattr(importlib.import_module(model_module), policy_class)
    cfg = policy_config(config, dtype, device)
    with torch.device(device):  # HF random init on the CPU would take minutes
        policy = policy_cls(cfg)
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"LeRobot state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return policy.eval()


def lerobot_call(policy, inputs, fn=None):
    """A no-argument call of `policy.model.sample_actions` (or `fn`, its compiled form) on the bench inputs:
    per-view image and mask lists as LeRobot takes them, pi0's state (present in `inputs` for pi0 only)."""
    fn = fn or policy.model.sample_actions
    views = inputs["images"].shape[1]
    images = [inputs["images"][:, i] for i in range(views)]
    masks = [inputs["image_masks"][:, i] for i in range(views)]
    state = (inputs["state"],) if "state" in inputs else ()

    def call():
        with torch.no_grad():
            return fn(images, masks, inputs["lang_tokens"], inputs["lang_mask"], *state, noise=inputs["noise"])
    return call


def bench_compiled(policy, inputs, mode, warmup, iters, log) -> dict:

    # LeRobot sets this itself when compile_model=True; restore it so nothing after sees TF32 matmuls.
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with PeakMemory() as mem:
            compiled = torch.compile(policy.model.sample_actions, mode=mode)
            call = lerobot_call(policy, inputs, compiled)
            t0 = time.time()
            call()
            torch.cuda.synchronize()
            first = time.time() - t0
            log(f"[bench] lerobot-compile first call (compilation) {first:.0f} s")
            out = time_cuda(call, warmup, iters)
        # The policy's weights were allocated before `mem` began: this is what compilation and calls add.
        out.update({"peak_mem_gib": mem.gib, "peak_mem_includes_weights": False, "compile_s": first,
                    "compile_mode": mode})
        log(f"[bench] lerobot-compile p50 {out['p50_ms']:.1f} ms")
        return out
    finally:
        torch.set_float32_matmul_precision(old)


def run_baselines(config, state, inputs, torch_dtype, wanted, parity: dict | None, truths: dict, shared: dict, *,
                  fp32_parity: bool, compile_mode: str, warmup: int, iters: int, device: str, log) -> tuple:
    """The LeRobot systems of one workload -> (results, extra, notes). `parity` (None: no parity checks) gets
    flashrt_vs_lerobot and reference_fp32_vs_lerobot, comparing `truths` ("flashrt": the engine's actions,
    "reference_fp32": the project's fp32 reference) with the policy that is timed (the engine's dtype); with
    `fp32_parity` also *_vs_lerobot_fp32 against a float32 policy built for that one call and dropped. The
    timed policy stays in `shared` for the next workload of the process."""

    results, extra, notes = {}, {}, []
    try:
        if parity is not None and fp32_parity:
            t0 = time.time()
            policy32 = build_lerobot(config, state, "float32", device)
            theirs = lerobot_call(policy32, inputs)()
            for name, actions in truths.items():
                parity[f"{name}_vs_lerobot_fp32"] = compare(actions, theirs)
            del policy32, theirs
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            extra["lerobot_fp32_parity_s"] = time.time() - t0
        if not wanted and parity is None:
            return results, extra, notes
        t0 = time.time()
        dtype = lerobot_dtype(torch_dtype)
        with PeakMemory(device) as mem:
            built_here = shared.get("lerobot_dtype") != dtype
            if built_here:
                shared.pop("lerobot", None)
                shared["lerobot"] = build_lerobot(config, state, dtype, device)
                shared["lerobot_dtype"] = dtype
            policy = shared["lerobot"]
            extra["lerobot_build_s"] = time.time() - t0
            call = lerobot_call(policy, inputs)
            if parity is not None:
                theirs = call()
                for name, actions in truths.items():
                    parity[f"{name}_vs_lerobot"] = compare(actions, theirs)
            if "lerobot-eager" in wanted:
                results["lerobot-eager"] = time_cuda(call, warmup, iters, device=device)
        if "lerobot-eager" in results:
            # The policy's own weights count only when this workload built it (else they predate `mem`).
            results["lerobot-eager"].update(peak_mem_gib=mem.gib, peak_mem_includes_weights=built_here)
            log(f"[bench] lerobot-eager p50 {results['lerobot-eager']['p50_ms']:.1f} ms")
        if "lerobot-compile" in wanted:
            results["lerobot-compile"] = bench_compiled(policy, inputs, compile_mode, warmup, iters, log)
            notes.append(COMPILE_NOTE % compile_mode)
    except Exception as exc:  # a baseline that cannot run is reported, not hidden
        extra["lerobot_error"] = f"{type(exc).__name__}: {exc}"
        for b in wanted:
            results.setdefault(b, {"error": extra["lerobot_error"]})
        log(f"[bench] LeRobot failed: {extra['lerobot_error']}")
    return results, extra, notes
