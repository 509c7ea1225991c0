"""`flashrt bench --model pi05|pi0 ...`: the fused engine against LeRobot 0.6.1 in one process, same weights,
noise (and, for pi0, robot state).

Full-size pi0.5 or pi0 with every parameter drawn from normal(0, 0.02) directly on the GPU (no checkpoint). Systems:
  flashrt           one whole decision through the public API (inputs copied into the static buffers,
                    observe + act graph replays, actions copied out): `engine.sample_actions(images,
                    image_masks, lang_tokens, lang_mask[, state], noise)`
  flashrt-act-only  one action tick that reuses the cached prefix (noise in, 10 flow steps, actions out):
                    `engine.denoise(prefix[, state], noise)`; pi0's act reads the robot state, a different
                    one each call
  lerobot-eager     `PI05Policy(cfg).model.sample_actions(..., noise=noise)` (pi0: `PI0Policy`, with the state
                    before the noise) in bf16 mode
  lerobot-compile   the same under `torch.compile` (mode "default": LeRobot's own default, max-autotune, did
                    not finish compiling within 8 minutes on the H200, docs/gpu-machine.md)
Each: p50/p90/p99 ms over CUDA events (3 warm-ups, 20+ timed calls, one decision per timing), and the peak
GPU memory the system allocated on top of the shared random state. Per stage (observe, act) the achieved
TFLOP/s and GB/s next to the measured H200 ceilings. With --parity: actions of the bf16 engine against the
project's fp32 reference and against LeRobot (cosine, relative L2; pi0 also against LeRobot in float32).
The LeRobot side is `flashrt_bench.lerobot`.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# the engine's own timing, re-exported: the benchmarks time with the same functions
from flashrt_core.engine.timing import cuda_samples, graph_ms  # noqa: F401
from flashrt_core.models import random_weights, registry
# the LeRobot side, re-exported (benchmarks/ import these names from here)
from flashrt_bench.lerobot import bench_compiled, build_lerobot, lerobot_call, run_baselines  # noqa: F401
from flashrt_bench.measure import PARITY_TARGETS, PeakMemory, compare, host_samples, time_cuda  # noqa: F401

# Measured on the H200 (docs/gpu-machine.md): the ceilings the per-stage numbers are compared with.
CEILINGS = {"bf16_gemm_tflops": 694.0, "prefix_gemm_tflops": 625.0, "copy_tbps": 4.22}
WEIGHT_STD = 0.02
SYSTEMS = ("flashrt", "flashrt-act-only", "lerobot-eager", "lerobot-compile")
MODELS = {k: registry.entry(k).title for k in registry.kinds("paligemma")}  # --model -> the name tables print
# the inputs of a whole decision and of an act tick after the prefix, in the engines' argument order
OBSERVATION = ("images", "image_masks", "lang_tokens", "lang_mask")


# ---- workload ---------------------------------------------------------------------------------------------
def workload_config(views: int, prompt_len: int, steps: int, chunk: int, kind: str = registry.DEFAULT_KIND,
                    base=None):
    """Full-size `kind` (pi0.5, pi0: the same SigLIP, Gemma 2B and 300M expert, each its action expert);
    `base`: other model sizes (the CPU tests' tiny model)."""
    config = (base or registry.config_class(kind).full()).as_kind(kind)
    return dataclasses.replace(config, num_image_slots=views, tokenizer_max_length=prompt_len, num_steps=steps,
                               chunk_size=chunk)


def random_state(config, seed: int, device, std: float = WEIGHT_STD) -> dict[str, torch.Tensor]:
    """Every tensor of the LeRobot layout ~ normal(0, std), fp32, drawn on `device` (seconds on a GPU)."""
    return random_weights.random_state(config, seed, device, std=std)


def random_inputs(config, seed: int, device, valid_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Images in [-1, 1] for every slot (all cameras present), a prompt with `valid_tokens` real tokens
    (default: all but a few, like a padded real prompt), and noise; for pi0 also a normalized robot state
    [1, max_state_dim] ~ normal(0, 1) (drawn last: pi0.5's inputs of a seed are what they always were)."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    size, views, n = config.vision.image_size, config.num_image_slots, config.tokenizer_max_length
    valid = valid_tokens if valid_tokens is not None else max(1, n - n // 8)
    inputs = {
        "images": torch.rand(1, views, 3, size, size, generator=gen, device=device) * 2 - 1,
        "image_masks": torch.ones(1, views, dtype=torch.bool, device=device),
        "lang_tokens": torch.randint(0, config.vocab_size, (1, n), generator=gen, device=device),
        "lang_mask": torch.arange(n, device=device)[None] < valid,
        "noise": torch.randn(1, config.chunk_size, config.action_dim, generator=gen, device=device),
    }
    if config.ACT_READS_STATE:
        inputs["state"] = torch.randn(1, config.state_dim, generator=gen, device=device)
    return inputs


def fresh_states(config, seed: int, device, n: int = 4) -> list[torch.Tensor]:
    """n robot states [1, max_state_dim] for act ticks that each read another one (pi0's act-only timing)."""
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    return [torch.randn(1, config.state_dim, generator=gen, device=device) for _ in range(n)]


def decision_args(inputs: dict) -> tuple:
    """(images, image_masks, lang_tokens, lang_mask[, state], noise): a whole decision's arguments."""
    return tuple(inputs[k] for k in OBSERVATION) + act_args(inputs)


def act_args(inputs: dict, state: torch.Tensor | None = None) -> tuple:
    """([state,] noise): what an act tick takes after the prefix (`state` replaces the inputs' own)."""
    if "state" not in inputs:
        return (inputs["noise"],)
    return (inputs["state"] if state is None else state, inputs["noise"])


# ---- measuring ------------------------------------------------------------------------------------------------
class HostEvent:
    """A CUDA event's interface over the host clock (timings off CUDA: the CPU tests of the benchmark)."""

    def __init__(self, enable_timing: bool = True):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def phase_samples(phases: dict, warmup: int = 3, iters: int = 20, device="cuda") -> dict:
    """p50 ms of each phase of a call made of several host calls (name -> fn, run in order): a CUDA event is
    recorded before the first and after each, with a sync after the last, so a phase's time is what it adds
    to the whole call, host gaps included (where the GPU waited for the host to launch work)."""
    cuda = torch.device(device).type == "cuda"
    new_event = torch.cuda.Event if cuda else HostEvent
    names = list(phases)
    for _ in range(warmup):
        for fn in phases.values():
            fn()
    if cuda:
        torch.cuda.synchronize()
    samples = {name: [] for name in names}
    for _ in range(iters):
        events = [new_event(enable_timing=True) for _ in range(len(names) + 1)]
        events[0].record()
        for event, fn in zip(events[1:], phases.values()):
            fn()
            event.record()
        events[-1].synchronize()
        for i, name in enumerate(names):
            samples[name].append(events[i].elapsed_time(events[i + 1]))
    return {name: statistics.median(ms) for name, ms in samples.items()}


def stage_parts(config) -> dict:
    """Per model part, what a W2-style decision multiplies: {part: {"weights": GEMM weight elements read per
    pass, "passes": passes per decision, "gemm_flops", "attn_flops", "other_bytes_per_pass" (in elements: K/V
    read or written, token embeddings)}}. Parts: vision (SigLIP + projector), prefix (the Gemma layers),
    expert (the action expert's layers: what a precision quantizes), expert_io (its input / output and time
    projections, kept in the model dtype). `stage_costs` and the roofline tables add them up."""
    v, g, e = config.vision, config.vlm, config.expert
    views, t = config.num_image_slots, v.num_patches
    p = config.prefix_len
    qkv = lambda tw: tw.width * (tw.heads + 2 * tw.kv_heads) * tw.head_dim  # noqa: E731
    o = lambda tw: tw.heads * tw.head_dim * tw.width  # noqa: E731
    mlp = lambda tw: 3 * tw.width * tw.mlp  # noqa: E731
    vis_layer = 4 * v.hidden * v.hidden + 2 * v.hidden * v.mlp
    vis_params = v.layers * vis_layer + 3 * v.patch ** 2 * v.hidden + v.hidden * g.width
    vlm_params = (g.depth - 1) * (qkv(g) + o(g) + mlp(g)) + qkv(g)
    kv = g.depth * 2 * p * g.kv_heads * g.head_dim
    c, steps = config.chunk_size, config.num_steps
    layer_params = e.depth * (qkv(e) + o(e) + mlp(e))
    io_params = 2 * config.action_dim * e.width
    attend = e.depth * 4 * e.heads * e.head_dim  # per query and key
    once_gemm = once_attn = 0  # what an act computes once, not per step
    if config.ACT_READS_STATE:  # (pi0)
        # pi0's action tokens pass the action-time MLP: its input half over the action embedding (the time
        # half is a per-step constant) and its output, w x w each; they attend to the prefix, the state token
        # and each other. The state token depends on the state and the prefix only: once per act.
        io_params += 2 * e.width * e.width
        keys = p + 1 + c
        once_gemm, once_attn = 2 * layer_params + 2 * config.state_dim * e.width, attend * (p + 1)
    else:  # (pi0.5's per-step time MLP and AdaRMS projections are left out)
        keys = p + c
    return {
        "vision": {"weights": vis_params, "passes": 1, "gemm_flops": views * 2 * t * vis_params,
                   "attn_flops": views * v.layers * 4 * t * t * v.hidden, "other_bytes_per_pass": 0},
        "prefix": {"weights": vlm_params, "passes": 1, "gemm_flops": 2 * p * vlm_params,
                   "attn_flops": (g.depth - 1) * 4 * p * p * g.heads * g.head_dim,
                   "other_bytes_per_pass": kv + config.tokenizer_max_length * g.width},
        "expert": {"weights": layer_params, "passes": steps, "gemm_flops": steps * 2 * c * layer_params + once_gemm,
                   "attn_flops": steps * attend * c * keys + once_attn, "other_bytes_per_pass": kv},
        "expert_io": {"weights": io_params, "passes": steps, "gemm_flops": steps * 2 * c * io_params,
                      "attn_flops": 0, "other_bytes_per_pass": 0}}


def stage_costs(config, weight_bytes: int = 2, vision_bytes: int = 2) -> dict:
    """Matmul FLOPs and compulsory DRAM bytes (weights once per pass, prefix K/V) of `observe` and `act`."""
    parts = stage_parts(config)

    def total(names):
        flops = sum(parts[n]["gemm_flops"] + parts[n]["attn_flops"] for n in names)
        nbytes = sum(parts[n]["passes"] * (parts[n]["weights"] * (vision_bytes if n == "vision" else weight_bytes)
                                           + parts[n]["other_bytes_per_pass"] * weight_bytes) for n in names)
        return {"flops": flops, "bytes": nbytes}
    return {"observe": total(("vision", "prefix")), "act": total(("expert", "expert_io"))}


def achieved(cost: dict, ms: float) -> dict:
    tflops = cost["flops"] / (ms * 1e-3) / 1e12
    gbps = cost["bytes"] / (ms * 1e-3) / 1e9
    return {"ms": ms, "tflop": cost["flops"] / 1e12, "gbyte": cost["bytes"] / 1e9, "tflops": tflops, "gbps": gbps,
            "tflops_vs_ceiling": tflops / CEILINGS["prefix_gemm_tflops"],
            "gbps_vs_ceiling": gbps / (CEILINGS["copy_tbps"] * 1e3)}


# ---- the benchmark ------------------------------------------------------------------------------------------------
def model_parts(kind: str):
    """(convert, the fp32 reference's sample_actions, its ReferenceEngine class, the fused engine's import)
    of `kind`; the fused engine is imported by the caller, when it runs (pi0's is new: see `build_engine`)."""
    import importlib

    if kind not in MODELS:
        raise ValueError(f"model: one of {', '.join(MODELS)}, got {kind!r}")
    model = registry.package(kind)
    reference = importlib.import_module(model.policy.ENGINES["reference"])
    fused = model.policy.ENGINES["fused"]
    fused = (fused, next(n for n in dir(importlib.import_module(fused)) if n.endswith("Engine")
                         and n not in ("PaliGemmaEngine", "FlowEngine", "StagedEngine")))
    return model.convert, reference.sample_actions, reference.ReferenceEngine, fused


def whole_decision(engine):
    """The engine's `sample_actions`; for a reference engine (which has none) its two stages in a row."""
    if hasattr(engine, "sample_actions"):
        return engine.sample_actions
    return lambda *args: engine.denoise(engine.encode_prefix(*args[:len(OBSERVATION)]), *args[len(OBSERVATION):])


def build_engine(kind, w32, inputs, engine: str, device, torch_dtype, vis_dtype, log) -> tuple:
    """-> (engine after one whole decision, extra). engine "fused": full options first; should graph capture
    or the Triton GEMMs fail on this GPU, the numbers of the fallback are still worth having, and the JSON
    says which options ran and why. Engine "reference" runs the model's eager reference in `torch_dtype`
    (extra["engine"] says which ran)."""
    import importlib

    _, _, reference_engine, (module, name) = model_parts(kind)
    extra = {}
    engine_class = getattr(importlib.import_module(module), name) if engine == "fused" else None
    if engine == "reference":
        built = reference_engine(w32.to(device=device, dtype=torch_dtype, vision_dtype=vis_dtype))
        whole_decision(built)(*decision_args(inputs))
        extra.update(engine=f"{kind} reference (eager torch, {torch_dtype})", engine_kind="reference")
        return built, extra
    if engine != "fused":
        raise ValueError(f"engine: fused or reference, got {engine!r}")
    errors = []
    for opts in ({}, {"pdl": False}, {"gemm": "torch", "pdl": False},
                 {"gemm": "torch", "graphs": False, "pdl": False}):
        try:
            built = engine_class(w32, device=device, dtype=torch_dtype, vision_dtype=vis_dtype, **opts)
            built.sample_actions(*decision_args(inputs))
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            break
        except Exception as exc:
            errors.append(f"{opts or 'default'}: {type(exc).__name__}: {exc}")
            log(f"[bench] engine {opts or 'default'} failed: {errors[-1]}")
            built = None
    if built is None:
        raise RuntimeError("flashrt engine failed with every option: " + " | ".join(errors))
    extra.update(engine=f"{module}.{name}", engine_kind="fused")
    extra["engine_options"] = opts or "default (graphs, gemm auto, PDL where supported, attention tuned)"
    if errors:
        extra["engine_errors"] = errors
    return built, extra


def bench_model(kind="pi05", views=2, prompt_len=48, steps=10, chunk=50, dtype="bf16",
                baselines=("lerobot-eager", "lerobot-compile"), iters=20, warmup=3, seed=0, compile_mode="default",
                parity=True, vision_dtype=None, log=print, shared: dict | None = None, timing: bool = True,
                engine: str = "fused", lerobot_fp32_parity: bool | None = None, device="cuda",
                base_config=None) -> dict:
    """One workload of pi0.5 or pi0 (`kind`); timing=False checks parity only (one decision per system, no
    latency numbers). engine: "fused" or "reference" (the eager model, e.g. for a baseline of the baseline).
    lerobot_fp32_parity (default: for pi0) also compares with LeRobot in float32. device other than CUDA and
    base_config (model sizes other than full size): the CPU tests' tiny runs."""
    from flashrt_core.lerobot.policy import parse_dtype

    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("flashrt bench needs a CUDA GPU")
    convert, reference_sample, _, _ = model_parts(kind)
    torch_dtype = parse_dtype(dtype)
    vis_dtype = parse_dtype(vision_dtype) if vision_dtype else torch_dtype
    shared = {} if shared is None else shared
    config = workload_config(views, prompt_len, steps, chunk, kind, base_config)
    lerobot_fp32_parity = config.ACT_READS_STATE if lerobot_fp32_parity is None else lerobot_fp32_parity
    workload = {"model": kind, "views": views, "prompt_len": prompt_len, "valid_prompt_tokens": None,
                "steps": steps, "chunk": chunk, "dtype": str(torch_dtype).replace("torch.", ""),
                "vision_dtype": str(vis_dtype).replace("torch.", ""), "batch": 1, "weights": f"normal(0, {WEIGHT_STD})",
                "seed": seed, "image_size": config.vision.image_size, "prefix_len": config.prefix_len,
                "timing": f"{'CUDA events' if cuda else 'host clock'}, {warmup} warm-ups, {iters} timed calls, "
                          "sync after each call"}
    if config.ACT_READS_STATE:
        workload.update(state_dim=config.state_dim, act_only_states="4 states in turn, one per call")
    results, notes, extra = {}, [], {}
    # `shared` carries the random weights (and a built LeRobot policy) between workloads of one process:
    # neither depends on the number of views or the prompt length.
    t0 = time.time()
    if shared.get("seed") != (kind, seed):
        shared.clear()
        shared["seed"] = (kind, seed)
        shared["state"] = random_state(config, seed, device)
        shared["w32"] = convert(config, shared["state"])
    state = shared["state"]
    w32 = dataclasses.replace(shared["w32"], config=config)
    inputs = random_inputs(config, seed, device)
    workload["valid_prompt_tokens"] = int(inputs["lang_mask"].sum())
    log(f"[bench] random weights + convert: {time.time() - t0:.1f} s")

    # -- flashrt
    t0 = time.time()
    with PeakMemory(device) as mem:
        eng, built = build_engine(kind, w32, inputs, engine, device, torch_dtype, vis_dtype, log)
        extra.update(built)
        extra["flashrt_build_s"] = time.time() - t0
        if not timing:
            iters, warmup = 1, 0
        decide = whole_decision(eng)
        whole = time_cuda(lambda: decide(*decision_args(inputs)), warmup, iters, device)
        prefix = eng.encode_prefix(*(inputs[k] for k in OBSERVATION))
        states = itertools.cycle(fresh_states(config, seed, device) if "state" in inputs else [None])
        act_only = time_cuda(lambda: eng.denoise(prefix, *act_args(inputs, next(states))), warmup, iters, device)
        fused = hasattr(eng, "decision")  # (a reference engine has no stages or buffers)
        if fused:
            # Where a whole decision's time goes: the eager input copies, then its graph (`decision()`: one
            # graph with act beside observe; the noise is already in its buffer, pi0's state goes in apart)
            inputs_in = {"set_observation": lambda: eng.set_observation(*(inputs[k] for k in OBSERVATION))}
            if "state" in inputs:
                inputs_in["set_state"] = lambda: eng.set_state(inputs["state"])
            eng.buffers.noise.copy_(inputs["noise"])
            phases = phase_samples({**inputs_in, "decision": eng.decision}, warmup, iters, device)
            stage_ms = {"observe": time_cuda(eng.observe, warmup, iters, device)["p50_ms"],
                        "act": time_cuda(eng.act, warmup, iters, device)["p50_ms"]}
    results["flashrt"] = {**whole, "peak_mem_gib": mem.gib}
    results["flashrt-act-only"] = {**act_only, "peak_mem_gib": mem.gib}
    if fused:
        results["flashrt"].update(captures=eng.captures, phases_p50_ms=phases)
        costs = stage_costs(config, torch_dtype.itemsize, vis_dtype.itemsize)
        extra["stages"] = {s: achieved(costs[s], stage_ms[s]) for s in ("observe", "act")}
        extra["ceilings"] = CEILINGS
        extra["gemm_choices"] = eng.linear.report()
        extra["attention_choices"] = eng.attend.report()
        log(f"[bench] observe {stage_ms['observe']:.2f} / act {stage_ms['act']:.2f} ms; a decision's phases, p50: "
            + ", ".join(f"{k} {v:.3f} ms" for k, v in phases.items()))
    log(f"[bench] flashrt p50 {whole['p50_ms']:.2f} ms, act-only {act_only['p50_ms']:.2f} ms, "
        f"build {extra['flashrt_build_s']:.1f} s")

    truths = {}
    if parity:
        truths["flashrt"] = decide(*decision_args(inputs))
        with torch.no_grad():
            truths["reference_fp32"] = reference_sample(w32, *decision_args(inputs))
        extra["parity"] = {"targets": PARITY_TARGETS,
                           "flashrt_vs_reference_fp32": compare(truths["flashrt"], truths["reference_fp32"])}
        if "state" in inputs:  # how much another state moves the fp32 actions: what parity can resolve of it
            other = fresh_states(config, seed, device)[0]
            with torch.no_grad():
                moved = reference_sample(w32, *decision_args(inputs)[:len(OBSERVATION)], *act_args(inputs, other))
            extra["parity"]["state_effect_reference_fp32"] = {
                "rel_l2": ((moved - truths["reference_fp32"]).norm() / truths["reference_fp32"].norm()).item(),
                "note": "relative change of the fp32 reference's actions for another state; where it is below "
                        "the engine's rel_l2 to the reference, these random weights cannot show a wrong state path"}
    del eng, prefix
    if cuda:
        torch.cuda.empty_cache()

    # -- LeRobot baselines
    wanted = [b for b in baselines if b]
    if wanted or parity:
        lr_results, lr_extra, lr_notes = run_baselines(
            config, state, inputs, torch_dtype, wanted, extra.get("parity"), truths, shared,
            fp32_parity=lerobot_fp32_parity, compile_mode=compile_mode, warmup=warmup, iters=iters, device=device,
            log=log)
        results.update(lr_results)
        extra.update(lr_extra)
        notes += lr_notes
    for b in wanted:
        if b in results and "p50_ms" in results[b]:
            results[b]["flashrt_speedup"] = results[b]["p50_ms"] / results["flashrt"]["p50_ms"]
    extra["notes"] = notes
    return {"workload": workload, "results": results, "extra": extra}


def bench_pi05(**kwargs) -> dict:
    """`bench_model` of pi0.5 (W2 by default)."""
    return bench_model("pi05", **kwargs)


def bench_pi0(**kwargs) -> dict:
    """`bench_model` of pi0 (W2 shapes by default: 2 views, 48-token prompt, 10 steps, chunk 50, bf16)."""
    return bench_model("pi0", **kwargs)


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
    out(f"{MODELS.get(w.get('model'), w.get('model'))} {w['views']} views, prompt {w['prompt_len']}, {w['steps']} "
        f"steps, chunk {w['chunk']}, {w['dtype']} on {doc['gpu']}")
    if doc.get("engine_kind") == "reference":  # (the flashrt rows are not the fused engine's)
        out(f"flashrt rows: {doc['engine']}: {doc.get('engine_fallback', 'asked for')}")
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
            out(f"parity {name:<32} cosine {p['cosine']:.6f}  rel L2 {p['rel_l2']:.2e}  max abs {p['max_abs']:.2e}  "
                f"{'PASS' if p['pass'] else 'FAIL'}")


def gpu_missing() -> str | None:
    """Why `flashrt bench` cannot run here (no CUDA GPU), or None."""
    if torch.cuda.is_available():
        return None
    return "needs a CUDA GPU (this torch sees none; `flashrt doctor` says what it has)"


def run_cli(args) -> int:
    if args.model not in MODELS:
        raise SystemExit(f"--model: one of {', '.join(MODELS)}, got {args.model!r}")
    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    unknown = [b for b in baselines if b not in SYSTEMS[2:]]
    if unknown:
        raise SystemExit(f"--baselines: unknown {unknown[0]!r} (one of {', '.join(SYSTEMS[2:])})")
    missing = gpu_missing()
    if missing:
        print(f"flashrt bench: {missing}", file=sys.stderr)
        return 1
    run = bench_model(args.model, views=args.views, prompt_len=args.prompt_len, steps=args.steps, chunk=args.chunk,
                      dtype=args.dtype, baselines=baselines, iters=args.iters, warmup=args.warmup, seed=args.seed,
                      compile_mode=args.compile_mode, parity=not args.no_parity, vision_dtype=args.vision_dtype,
                      engine=args.engine)
    doc = document(run)
    print_table(doc)
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--model", default="pi05", choices=list(MODELS), help="model to benchmark, default pi05")
    p.add_argument("--engine", default="fused", choices=("fused", "reference"),
                   help="flashrt rows: the fused engine (default) or the eager reference in --dtype")
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
