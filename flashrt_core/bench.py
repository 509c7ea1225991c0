"""`flashrt bench --model pi05 ...`: the fused engine against LeRobot 0.6.1 in one process, same weights and noise.

Full-size pi0.5 with every parameter drawn from normal(0, 0.02) directly on the GPU (no checkpoint). Systems:
  flashrt           one whole decision through the public API (inputs copied into the static buffers,
                    observe + act graph replays, actions copied out)
  flashrt-act-only  one action tick that reuses the cached prefix (noise in, 10 flow steps, actions out)
  lerobot-eager     `PI05Policy(cfg).model.sample_actions(..., noise=noise)` in bf16 mode
  lerobot-compile   the same under `torch.compile` (mode "default": LeRobot's own default, max-autotune, did
                    not finish compiling within 8 minutes on the H200, docs/gpu-machine.md)
Each: p50/p90/p99 ms over CUDA events (3 warm-ups, 20+ timed calls, one decision per timing), and the peak
GPU memory the system allocated on top of the shared random state. Per stage (observe, act) the achieved
TFLOP/s and GB/s next to the measured H200 ceilings. With --parity: actions of the bf16 engine against the
project's fp32 reference and against LeRobot (cosine, relative L2).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

# the engine's own timing, re-exported: the benchmarks time with the same functions
from flashrt_core.engine.timing import cuda_samples, graph_ms  # noqa: F401

# Measured on the H200 (docs/gpu-machine.md): the ceilings the per-stage numbers are compared with.
CEILINGS = {"bf16_gemm_tflops": 694.0, "prefix_gemm_tflops": 625.0, "copy_tbps": 4.22}
PARITY_TARGETS = {"cosine_min": 0.999, "rel_l2_max": 2e-2}
WEIGHT_STD = 0.02
SYSTEMS = ("flashrt", "flashrt-act-only", "lerobot-eager", "lerobot-compile")


# ---- workload ---------------------------------------------------------------------------------------------
def workload_config(views: int, prompt_len: int, steps: int, chunk: int):
    from flashrt_core.models.pi05 import Pi05Config

    return dataclasses.replace(Pi05Config.full(), num_image_slots=views, tokenizer_max_length=prompt_len,
                               num_steps=steps, chunk_size=chunk)


def random_state(config, seed: int, device, std: float = WEIGHT_STD) -> dict[str, torch.Tensor]:
    """Every tensor of the LeRobot layout ~ normal(0, std), fp32, drawn on `device` (seconds on a GPU)."""
    from flashrt_core.models.pi05 import expected_keys

    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, device=device) * std
            for name, shape in sorted(expected_keys(config).items())}


def random_inputs(config, seed: int, device, valid_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Images in [-1, 1] for every slot (all cameras present), a prompt with `valid_tokens` real tokens
    (default: all but a few, like a padded real prompt), and noise."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    size, views, n = config.vision.image_size, config.num_image_slots, config.tokenizer_max_length
    valid = valid_tokens if valid_tokens is not None else max(1, n - n // 8)
    return {
        "images": torch.rand(1, views, 3, size, size, generator=gen, device=device) * 2 - 1,
        "image_masks": torch.ones(1, views, dtype=torch.bool, device=device),
        "lang_tokens": torch.randint(0, config.vocab_size, (1, n), generator=gen, device=device),
        "lang_mask": torch.arange(n, device=device)[None] < valid,
        "noise": torch.randn(1, config.chunk_size, config.action_dim, generator=gen, device=device),
    }


# ---- measuring ------------------------------------------------------------------------------------------------
def phase_samples(phases: dict, warmup: int = 3, iters: int = 20) -> dict:
    """p50 ms of each phase of a call made of several host calls (name -> fn, run in order): a CUDA event is
    recorded before the first and after each, with a sync after the last, so a phase's time is what it adds
    to the whole call, host gaps included (where the GPU waited for the host to launch work)."""
    names = list(phases)
    for _ in range(warmup):
        for fn in phases.values():
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in names}
    for _ in range(iters):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
        events[0].record()
        for event, fn in zip(events[1:], phases.values()):
            fn()
            event.record()
        events[-1].synchronize()
        for i, name in enumerate(names):
            samples[name].append(events[i].elapsed_time(events[i + 1]))
    return {name: statistics.median(ms) for name, ms in samples.items()}


def time_cuda(fn, warmup: int = 3, iters: int = 20) -> dict:
    """p50/p90/p99/mean ms of `cuda_samples`."""
    ms = sorted(cuda_samples(fn, warmup, iters))

    def pct(p):
        return ms[min(len(ms) - 1, max(0, math.ceil(p / 100 * len(ms)) - 1))]

    return {"p50_ms": statistics.median(ms), "p90_ms": pct(90), "p99_ms": pct(99), "mean_ms": statistics.mean(ms),
            "min_ms": ms[0], "iters": iters, "warmup": warmup}


class PeakMemory:
    """Peak GPU memory allocated inside the `with` block beyond what was allocated when it began."""

    def __enter__(self):
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.gib = (torch.cuda.max_memory_allocated() - self.base) / 2 ** 30
        return False


def compare(actions: torch.Tensor, truth: torch.Tensor) -> dict:
    a, b = actions.float().flatten(), truth.float().flatten()
    cos = F.cosine_similarity(a, b, dim=0).item()
    rel = ((a - b).norm() / b.norm()).item()
    return {"cosine": cos, "rel_l2": rel, "max_abs": (a - b).abs().max().item(),
            "pass": cos >= PARITY_TARGETS["cosine_min"] and rel <= PARITY_TARGETS["rel_l2_max"]}


# ---- FLOPs and bytes per stage (for achieved TFLOP/s and GB/s) -------------------------------------------------
def stage_costs(config, weight_bytes: int = 2, vision_bytes: int = 2) -> dict:
    """Matmul FLOPs and compulsory DRAM bytes (weights once, prefix K/V) of `observe` and `act`."""
    v, g, e = config.vision, config.vlm, config.expert
    views, t = config.num_image_slots, v.num_patches
    p = config.prefix_len
    qkv = lambda tw: tw.width * (tw.heads + 2 * tw.kv_heads) * tw.head_dim  # noqa: E731
    o = lambda tw: tw.heads * tw.head_dim * tw.width  # noqa: E731
    mlp = lambda tw: 3 * tw.width * tw.mlp  # noqa: E731
    vis_layer = 4 * v.hidden * v.hidden + 2 * v.hidden * v.mlp
    vis_params = v.layers * vis_layer + 3 * v.patch ** 2 * v.hidden + v.hidden * g.width
    vis_flops = views * (2 * t * vis_params + v.layers * 4 * t * t * v.hidden)
    vlm_params = (g.depth - 1) * (qkv(g) + o(g) + mlp(g)) + qkv(g)
    vlm_flops = 2 * p * vlm_params + (g.depth - 1) * 4 * p * p * g.heads * g.head_dim
    kv_bytes = g.depth * 2 * p * g.kv_heads * g.head_dim * weight_bytes
    observe = {"flops": vis_flops + vlm_flops,
               "bytes": vis_params * vision_bytes + vlm_params * weight_bytes + kv_bytes
               + config.tokenizer_max_length * g.width * weight_bytes}
    c = config.chunk_size
    exp_params = e.depth * (qkv(e) + o(e) + mlp(e)) + 2 * config.action_dim * e.width
    step_flops = 2 * c * exp_params + e.depth * 4 * c * (p + c) * e.heads * e.head_dim
    act = {"flops": config.num_steps * step_flops,
           "bytes": config.num_steps * (exp_params * weight_bytes + kv_bytes)}
    return {"observe": observe, "act": act}


def achieved(cost: dict, ms: float) -> dict:
    tflops = cost["flops"] / (ms * 1e-3) / 1e12
    gbps = cost["bytes"] / (ms * 1e-3) / 1e9
    return {"ms": ms, "tflop": cost["flops"] / 1e12, "gbyte": cost["bytes"] / 1e9, "tflops": tflops, "gbps": gbps,
            "tflops_vs_ceiling": tflops / CEILINGS["prefix_gemm_tflops"],
            "gbps_vs_ceiling": gbps / (CEILINGS["copy_tbps"] * 1e3)}


# ---- LeRobot ------------------------------------------------------------------------------------------------------
def build_lerobot(config, state: dict, dtype: str = "bfloat16"):
    """LeRobot 0.6.1 PI05Policy with `state` copied in by key name (lm_head keys are the only ones left out)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    size = config.vision.image_size
    cams = {f"observation.images.cam{i}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, size, size))
            for i in range(config.num_image_slots)}
    cfg = PI05Config(dtype=dtype, device="cuda", chunk_size=config.chunk_size, n_action_steps=config.chunk_size,
                     num_inference_steps=config.num_steps, tokenizer_max_length=config.tokenizer_max_length,
                     max_action_dim=config.action_dim, max_state_dim=config.state_dim,
                     input_features=cams,
                     output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(config.action_dim,))})
    with torch.device("cuda"):  # HF random init on the CPU would take minutes
        policy = PI05Policy(cfg)
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"LeRobot state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return policy.eval()


def lerobot_call(policy, inputs, fn=None):
    fn = fn or policy.model.sample_actions
    views = inputs["images"].shape[1]
    images = [inputs["images"][:, i] for i in range(views)]
    masks = [inputs["image_masks"][:, i] for i in range(views)]

    def call():
        with torch.no_grad():
            return fn(images, masks, inputs["lang_tokens"], inputs["lang_mask"], noise=inputs["noise"])
    return call


# ---- the benchmark ------------------------------------------------------------------------------------------------
def bench_pi05(views=2, prompt_len=48, steps=10, chunk=50, dtype="bf16", baselines=("lerobot-eager",
               "lerobot-compile"), iters=20, warmup=3, seed=0, compile_mode="default", parity=True,
               vision_dtype=None, log=print, shared: dict | None = None, timing: bool = True) -> dict:
    """One workload; timing=False checks parity only (one decision per system, no latency numbers)."""
    from flashrt_core.models.pi05 import convert
    from flashrt_core.models.pi05 import reference as R
    from flashrt_core.models.pi05.engine import Pi05Engine
    from flashrt_core.models.pi05.policy import parse_dtype

    if not torch.cuda.is_available():
        raise RuntimeError("flashrt bench needs a CUDA GPU")
    torch_dtype = parse_dtype(dtype)
    vis_dtype = parse_dtype(vision_dtype) if vision_dtype else torch_dtype
    config = workload_config(views, prompt_len, steps, chunk)
    workload = {"model": "pi05", "views": views, "prompt_len": prompt_len, "valid_prompt_tokens": None,
                "steps": steps, "chunk": chunk, "dtype": str(torch_dtype).replace("torch.", ""),
                "vision_dtype": str(vis_dtype).replace("torch.", ""), "batch": 1, "weights": f"normal(0, {WEIGHT_STD})",
                "seed": seed, "image_size": config.vision.image_size, "prefix_len": config.prefix_len,
                "timing": f"CUDA events, {warmup} warm-ups, {iters} timed calls, sync after each call"}
    results, notes, extra = {}, [], {}
    # `shared` carries the random weights (and a built LeRobot policy) between workloads of one process:
    # neither depends on the number of views or the prompt length.
    shared = {} if shared is None else shared
    t0 = time.time()
    if shared.get("seed") != seed:
        shared.clear()
        shared["seed"] = seed
        shared["state"] = random_state(config, seed, "cuda")
        shared["w32"] = convert(config, shared["state"])
    state = shared["state"]
    w32 = dataclasses.replace(shared["w32"], config=config)
    inputs = random_inputs(config, seed, "cuda")
    workload["valid_prompt_tokens"] = int(inputs["lang_mask"].sum())
    log(f"[bench] random weights + convert: {time.time() - t0:.1f} s")

    # -- flashrt
    t0 = time.time()
    with PeakMemory() as mem:
        # Full options first; should graph capture or the Triton GEMMs fail on this GPU, the numbers of
        # the fallback are still worth having, and the JSON says which options ran and why.
        errors = []
        for opts in ({}, {"pdl": False}, {"gemm": "torch", "pdl": False},
                     {"gemm": "torch", "graphs": False, "pdl": False}):
            try:
                engine = Pi05Engine(w32, device="cuda", dtype=torch_dtype, vision_dtype=vis_dtype, **opts)
                engine.sample_actions(*(inputs[k] for k in ("images", "image_masks", "lang_tokens", "lang_mask",
                                                            "noise")))
                torch.cuda.synchronize()
                break
            except Exception as exc:
                errors.append(f"{opts or 'default'}: {type(exc).__name__}: {exc}")
                log(f"[bench] engine {opts or 'default'} failed: {errors[-1]}")
                engine = None
        if engine is None:
            raise RuntimeError("flashrt engine failed with every option: " + " | ".join(errors))
        extra["engine_options"] = opts or "default (graphs, gemm auto, PDL where supported, attention tuned)"
        if errors:
            extra["engine_errors"] = errors
        extra["flashrt_build_s"] = time.time() - t0
        if not timing:
            iters, warmup = 1, 0
        whole = time_cuda(lambda: engine.sample_actions(inputs["images"], inputs["image_masks"],
                                                        inputs["lang_tokens"], inputs["lang_mask"], inputs["noise"]),
                          warmup, iters)
        prefix = engine.encode_prefix(inputs["images"], inputs["image_masks"], inputs["lang_tokens"],
                                      inputs["lang_mask"])
        act_only = time_cuda(lambda: engine.denoise(prefix, inputs["noise"]), warmup, iters)
        # Where a whole decision's time goes: the eager input copies, then its graph (`decision()`: one graph
        # with act beside observe; the noise is already in its buffer)
        phases = phase_samples({
            "set_observation": lambda: engine.set_observation(inputs["images"], inputs["image_masks"],
                                                              inputs["lang_tokens"], inputs["lang_mask"]),
            "decision": engine.decision}, warmup, iters)
        stage_ms = {"observe": time_cuda(engine.observe, warmup, iters)["p50_ms"],
                    "act": time_cuda(engine.act, warmup, iters)["p50_ms"]}
    results["flashrt"] = {**whole, "peak_mem_gib": mem.gib, "captures": engine.captures,
                          "phases_p50_ms": phases}
    results["flashrt-act-only"] = {**act_only, "peak_mem_gib": mem.gib}
    costs = stage_costs(config, torch_dtype.itemsize, vis_dtype.itemsize)
    extra["stages"] = {s: achieved(costs[s], stage_ms[s]) for s in ("observe", "act")}
    extra["ceilings"] = CEILINGS
    extra["gemm_choices"] = engine.linear.report()
    extra["attention_choices"] = engine.attend.report()
    log(f"[bench] flashrt p50 {whole['p50_ms']:.2f} ms, act-only {act_only['p50_ms']:.2f} ms "
        f"(observe {stage_ms['observe']:.2f} / act {stage_ms['act']:.2f}), build {extra['flashrt_build_s']:.1f} s")
    log("[bench] a decision's phases, p50: " + ", ".join(f"{k} {v:.3f} ms" for k, v in phases.items()))

    if parity:
        ours = engine.sample_actions(inputs["images"], inputs["image_masks"], inputs["lang_tokens"],
                                     inputs["lang_mask"], inputs["noise"])
        with torch.no_grad():
            ref32 = R.sample_actions(w32, inputs["images"], inputs["image_masks"], inputs["lang_tokens"],
                                     inputs["lang_mask"], inputs["noise"])
        extra["parity"] = {"targets": PARITY_TARGETS, "flashrt_vs_reference_fp32": compare(ours, ref32)}
    del engine, prefix
    torch.cuda.empty_cache()

    # -- LeRobot baselines
    wanted = [b for b in baselines if b]
    if wanted or parity:
        try:
            t0 = time.time()
            lr_dtype = "bfloat16" if torch_dtype == torch.bfloat16 else "float32"
            with PeakMemory() as mem:
                built_here = shared.get("lerobot_dtype") != lr_dtype
                if built_here:
                    shared.pop("lerobot", None)
                    shared["lerobot"] = build_lerobot(config, state, lr_dtype)
                    shared["lerobot_dtype"] = lr_dtype
                policy = shared["lerobot"]
                extra["lerobot_build_s"] = time.time() - t0
                call = lerobot_call(policy, inputs)
                if parity:
                    theirs = call()
                    extra["parity"]["flashrt_vs_lerobot"] = compare(ours, theirs)
                    extra["parity"]["reference_fp32_vs_lerobot"] = compare(ref32, theirs)
                if "lerobot-eager" in wanted:
                    results["lerobot-eager"] = time_cuda(call, warmup, iters)
            if "lerobot-eager" in results:
                # The policy's own weights count only when this workload built it (else they predate `mem`).
                results["lerobot-eager"]["peak_mem_gib"] = mem.gib
                results["lerobot-eager"]["peak_mem_includes_weights"] = built_here
                log(f"[bench] lerobot-eager p50 {results['lerobot-eager']['p50_ms']:.1f} ms")
            if "lerobot-compile" in wanted:
                results["lerobot-compile"] = bench_compiled(policy, inputs, compile_mode, warmup, iters, log)
                notes.append("lerobot-compile uses torch.compile mode '%s'; LeRobot's default max-autotune is not "
                             "measured: it did not finish compiling within 8 minutes on the H200 "
                             "(docs/gpu-machine.md)" % compile_mode)
        except Exception as exc:  # a baseline that cannot run is reported, not hidden
            extra["lerobot_error"] = f"{type(exc).__name__}: {exc}"
            for b in wanted:
                results.setdefault(b, {"error": f"{type(exc).__name__}: {exc}"})
            log(f"[bench] LeRobot failed: {type(exc).__name__}: {exc}")
    for b in wanted:
        if b in results and "p50_ms" in results[b]:
            results[b]["flashrt_speedup"] = results[b]["p50_ms"] / results["flashrt"]["p50_ms"]
    extra["notes"] = notes
    return {"workload": workload, "results": results, "extra": extra}


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


# ---- output ---------------------------------------------------------------------------------------------------------
def _commit() -> str:
    if os.environ.get("FLASHRT_COMMIT"):
        return os.environ["FLASHRT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=pathlib.Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def document(run: dict) -> dict:
    """{gpu, commit, date, workload, results, ...} as every benchmark JSON in this project."""
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "workload": run["workload"], "results": run["results"], **run.get("extra", {})}


def print_table(doc: dict, out=print) -> None:
    w = doc["workload"]
    out(f"pi0.5 {w['views']} views, prompt {w['prompt_len']}, {w['steps']} steps, chunk {w['chunk']}, {w['dtype']} "
        f"on {doc['gpu']}")
    out(f"{'system':<18} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'peak GiB':>9} {'speed-up':>9}")
    for name, r in doc["results"].items():
        if "p50_ms" not in r:
            out(f"{name:<18} {r.get('error', '?')}")
            continue
        out(f"{name:<18} {r['p50_ms']:>9.2f} {r['p90_ms']:>9.2f} {r['p99_ms']:>9.2f} {r.get('peak_mem_gib', 0):>9.2f} "
            f"{r.get('flashrt_speedup', 1.0):>8.1f}x")
    for stage, s in doc.get("stages", {}).items():
        out(f"stage {stage:<8} {s['ms']:.3f} ms  {s['tflops']:.0f} TFLOP/s ({100 * s['tflops_vs_ceiling']:.0f}% of "
            f"{CEILINGS['prefix_gemm_tflops']:.0f})  {s['gbps']:.0f} GB/s ({100 * s['gbps_vs_ceiling']:.0f}% of "
            f"{CEILINGS['copy_tbps'] * 1e3:.0f})")
    for name, p in doc.get("parity", {}).items():
        if isinstance(p, dict) and "cosine" in p:
            out(f"parity {name:<28} cosine {p['cosine']:.6f}  rel L2 {p['rel_l2']:.2e}  {'PASS' if p['pass'] else 'FAIL'}")


def run_cli(args) -> int:
    if args.model != "pi05":
        raise SystemExit(f"--model: only pi05 is supported, got {args.model!r}")
    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    unknown = [b for b in baselines if b not in SYSTEMS[2:]]
    if unknown:
        raise SystemExit(f"--baselines: unknown {unknown[0]!r} (one of {', '.join(SYSTEMS[2:])})")
    run = bench_pi05(views=args.views, prompt_len=args.prompt_len, steps=args.steps, chunk=args.chunk,
                     dtype=args.dtype, baselines=baselines, iters=args.iters, warmup=args.warmup, seed=args.seed,
                     compile_mode=args.compile_mode, parity=not args.no_parity, vision_dtype=args.vision_dtype)
    doc = document(run)
    print_table(doc)
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--model", default="pi05", help="model to benchmark (pi05)")
    p.add_argument("--views", type=int, default=2, help="camera views (image slots), default 2")
    p.add_argument("--prompt-len", type=int, default=48, help="prompt buffer length in tokens, default 48")
    p.add_argument("--steps", type=int, default=10, help="flow-matching steps, default 10")
    p.add_argument("--chunk", type=int, default=50, help="actions per chunk, default 50")
    p.add_argument("--dtype", default="bf16", help="engine dtype (bf16 | fp16 | fp32), default bf16")
    p.add_argument("--vision-dtype", default=None, help="SigLIP dtype (default: --dtype)")
    p.add_argument("--baselines", default="lerobot-eager,lerobot-compile",
                   help="comma list of lerobot-eager, lerobot-compile ('' for none)")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode of lerobot-compile")
    p.add_argument("--iters", type=int, default=20, help="timed calls per system, default 20")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per system, default 3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-parity", action="store_true", help="skip the parity checks")
    p.add_argument("--json", default=None, help="write the result JSON here")


def add_subparsers(subparsers) -> None:
    """Register `bench` on an argparse subparsers object; the handler is in `func`."""
    p = subparsers.add_parser("bench", help="latency of the fused engine vs LeRobot (GPU)")
    add_arguments(p)
    p.set_defaults(func=run_cli)
