"""Real-time chunking (RTC) on the GPU, full size, every parameter normal(0, 0.02): the fused engine's guided
act stage against LeRobot 0.6.1's RTC (`policy.model.sample_actions(..., inference_delay=, prev_chunk_left_over=,
execution_horizon=)` with `rtc_config` set, bf16) and against the project's fp32 reference with the same weights,
noise and previous chunk; and the act tick with RTC beside the act tick without it, in the same process.
Targets: cosine >= 0.999 against LeRobot; act tick with RTC <= 2.5x the act tick without.

    python benchmarks/bench_rtc.py [--model pi05|pi0] [--json benchmarks/results/rtc_pi05_w2.json]
Exit status 1 if a target is missed.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's flashrt_core first
from _common import write_result  # noqa: E402

import torch  # noqa: E402

from flashrt_bench import harness as B  # noqa: E402
from flashrt_core.models import rtc  # noqa: E402

TARGETS = {"cosine_vs_lerobot": 0.999, "rtc_act_over_plain_act": 2.5}
# LeRobot's RTCConfig defaults (execution horizon 10, guidance clip 10, linear schedule); 5 actions of the
# previous chunk executed while the new one was computed, an inference delay of 4
SETTING = {"schedule": "linear", "max_guidance_weight": 10.0, "execution_horizon": 10, "inference_delay": 4,
           "executed": 5}


def lerobot_rtc(config, state, inputs, left, log) -> dict:
    """LeRobot's plain and guided actions (bf16) and one guided call's host time."""
    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    from flashrt_bench.lerobot import build_lerobot

    policy = build_lerobot(config, state, "bfloat16", "cuda")
    views = inputs["images"].shape[1]
    call = [[inputs["images"][:, i] for i in range(views)], [inputs["image_masks"][:, i] for i in range(views)],
            inputs["lang_tokens"], inputs["lang_mask"], *([inputs["state"]] if "state" in inputs else [])]
    with torch.no_grad():
        plain = policy.model.sample_actions(*call, noise=inputs["noise"]).float()
    policy.config.rtc_config = RTCConfig(
        prefix_attention_schedule=RTCAttentionSchedule[SETTING["schedule"].upper()],
        max_guidance_weight=SETTING["max_guidance_weight"], execution_horizon=SETTING["execution_horizon"])
    policy.init_rtc_processor()

    def guided():
        return policy.model.sample_actions(*call, noise=inputs["noise"], inference_delay=SETTING["inference_delay"],
                                           prev_chunk_left_over=left, execution_horizon=SETTING["execution_horizon"])
    guided()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    actions = guided().detach().float()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    log(f"[rtc] LeRobot guided decision {ms:.1f} ms")
    del policy
    torch.cuda.empty_cache()
    return {"plain": plain, "rtc": actions, "decision_ms": ms}


def measure(kind="pi05", views=2, prompt_len=48, steps=10, chunk=50, iters=50, warmup=5, seed=0, lerobot=True,
            dtype=torch.bfloat16, device="cuda", base_config=None, log=print) -> tuple[dict, dict, bool]:
    """-> (workload, results, every target met). device / base_config / dtype other than the defaults: the CPU
    test's tiny run."""
    import importlib

    config = B.workload_config(views, prompt_len, steps, chunk, kind, base_config)
    t0 = time.time()
    state = B.random_state(config, seed, device)
    w32 = B.model_parts(kind)[0](config, state)
    inputs = B.random_inputs(config, seed, device)
    log(f"[rtc] weights {time.time() - t0:.1f} s")
    eng, built = B.build_engine(kind, w32, inputs, "fused", device, dtype, dtype, log)
    obs = [inputs[k] for k in B.OBSERVATION]
    extra_in = [inputs["state"]] if "state" in inputs else []
    # the previous chunk: the engine's own actions for another noise
    other = torch.randn(inputs["noise"].shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    prev = B.whole_decision(eng)(*obs, *extra_in, other)
    left = prev[:, SETTING["executed"]:].clone()
    opts = rtc.RTCOptions(execution_horizon=SETTING["execution_horizon"],
                          max_guidance_weight=SETTING["max_guidance_weight"], schedule=SETTING["schedule"])
    g = rtc.rtc_inputs(left, SETTING["inference_delay"], None, opts, config.chunk_size, config.action_dim, batch=1)
    prefix = eng.encode_prefix(*obs)
    plain = eng.denoise(prefix, *extra_in, inputs["noise"])
    guided = eng.denoise(prefix, *extra_in, inputs["noise"], g)
    # the act tick, graph only (its inputs already in the engine's buffers), without and with the guidance; then
    # the whole act call (prefix, state, noise and guidance copied in)
    timing = {"act": B.time_cuda(eng.act, warmup, iters, device),
              "act+rtc": B.time_cuda(lambda: eng.act(rtc=True), warmup, iters, device),
              "denoise": B.time_cuda(lambda: eng.denoise(prefix, *extra_in, inputs["noise"]), warmup, iters, device),
              "denoise+rtc": B.time_cuda(lambda: eng.denoise(prefix, *extra_in, inputs["noise"], g), warmup, iters,
                                         device)}
    ratio = timing["act+rtc"]["p50_ms"] / timing["act"]["p50_ms"]
    log(f"[rtc] act {timing['act']['p50_ms']:.3f} ms, act+rtc {timing['act+rtc']['p50_ms']:.3f} ms ({ratio:.2f}x)")
    R = importlib.import_module(f"flashrt_core.models.{kind}.reference")
    with torch.no_grad():
        ref_prefix = R.encode_prefix(w32, *obs)
        ref_rtc = R.denoise(w32, ref_prefix, *extra_in, inputs["noise"], g)
        ref_plain = R.denoise(w32, ref_prefix, *extra_in, inputs["noise"])
    parity = {"flashrt_vs_reference_fp32": B.compare(guided, ref_rtc),
              "flashrt_plain_vs_reference_fp32": B.compare(plain, ref_plain),
              "rtc_effect_reference_fp32": {
                  "rel_l2": ((ref_rtc - ref_plain).norm() / ref_plain.norm()).item(),
                  "note": "relative change of the fp32 reference's actions by the guidance: what parity resolves"}}
    del eng, prefix
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    ok = ratio <= TARGETS["rtc_act_over_plain_act"]
    if lerobot:
        lr = lerobot_rtc(config, state, inputs, left, log)
        parity["flashrt_vs_lerobot_bf16"] = B.compare(guided, lr["rtc"])
        parity["reference_fp32_vs_lerobot_bf16"] = B.compare(ref_rtc, lr["rtc"])
        parity["flashrt_plain_vs_lerobot_plain_bf16"] = B.compare(plain, lr["plain"])
        parity["lerobot_guided_decision_ms"] = lr["decision_ms"]
        ok &= parity["flashrt_vs_lerobot_bf16"]["cosine"] >= TARGETS["cosine_vs_lerobot"]
    else:
        ok &= parity["flashrt_vs_reference_fp32"]["cosine"] >= TARGETS["cosine_vs_lerobot"]
    for name, r in parity.items():
        if isinstance(r, dict) and "cosine" in r:
            log(f"[rtc] {name:<36} cosine {r['cosine']:.6f}  rel L2 {r['rel_l2']:.2e}  max {r['max_abs']:.3g}")
    workload = {"model": kind, "views": views, "prompt_len": prompt_len, "steps": steps, "chunk": chunk,
                "dtype": str(dtype).replace("torch.", ""), "weights": f"normal(0, {B.WEIGHT_STD})", "seed": seed,
                "rtc": SETTING, "targets": TARGETS,
                "timing": f"{warmup} warm-ups, {iters} timed calls, CUDA events on a GPU"}
    results = {"timing": timing, "rtc_act_over_plain_act": ratio, "parity": parity, "engine": built, "pass": ok}
    return workload, results, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="pi05", choices=("pi05", "pi0"))
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-lerobot", action="store_true", help="compare with the fp32 reference only")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    json_path = args.json or f"benchmarks/results/rtc_{args.model}_w{args.views}.json"
    if not torch.cuda.is_available():
        print("bench_rtc needs a CUDA GPU", file=sys.stderr)
        return 2
    workload, results, ok = measure(args.model, args.views, args.prompt_len, iters=args.iters, seed=args.seed,
                                    lerobot=not args.skip_lerobot)
    write_result(json_path, workload, results)
    print(f"{'PASS' if ok else 'FAIL'}; wrote {json_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
