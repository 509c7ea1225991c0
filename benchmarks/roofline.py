"""Computed, not run: the lower bound of each stage per precision preset on a device from its published memory
bandwidth and tensor throughput, so a user sees which precision can meet which rate there (a Jetson AGX Thor
by default). For each stage (observe: SigLIP + the Gemma prefix; act: 10 flow steps of the action expert) and
preset: the bytes a decision must read (every GEMM weight once per pass in its stored format, the prefix K/V,
token embeddings: `flashrt_bench.harness.stage_parts`), the matmul FLOPs at the tensor rate each GEMM runs at
(bf16 for weights widened in registers: 4-bit W4A16; fp8 for W8A8 and MXFP4's W4A8; fp4 for
NVFP4), and the floor max(bytes / bandwidth, FLOPs / rate). No kernel reaches a floor: measured stages on an
H200 run at 22-45% of theirs (benchmarks/README.md).

    python benchmarks/roofline.py [--device thor|h200] [--model pi05|pi0] [--json PATH]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_bench import harness as B  # noqa: E402

# Published figures. Thor: NVIDIA's Jetson AGX Thor developer kit / T5000 module specifications: 128 GB LPDDR5X,
# 256-bit, 273 GB/s; "2070 TFLOPS (FP4, sparse)". Dense rates derived from it with Blackwell's tensor-core
# ratios (2:4 sparsity doubles the dense rate; each halving of the operand width doubles it): fp4 1035, fp8 517.5,
# bf16 258.75 TFLOP/s. H200: NVIDIA's H200 SXM datasheet: 4.8 TB/s, dense bf16 989, fp8 1979 TFLOP/s (no fp4).
DEVICES = {
    "thor": {"name": "Jetson AGX Thor (T5000)", "gbps": 273.0,
             "tflops": {"bf16": 258.75, "fp8": 517.5, "fp4": 1035.0},
             "source": "NVIDIA Jetson AGX Thor specifications: 273 GB/s, 2070 FP4 TFLOPS sparse (dense rates "
                       "derived: /2 for sparsity, /2 per doubling of operand width)"},
    "h200": {"name": "H200 SXM", "gbps": 4800.0, "tflops": {"bf16": 989.0, "fp8": 1979.0},
             "source": "NVIDIA H200 datasheet: 4.8 TB/s, dense 989 bf16 / 1979 fp8 TFLOP/s"},
}
# bytes per weight (scales included) and the tensor rate its GEMM runs at, per format and part
FORMATS = {
    "bf16": {"bytes": 2.0, "rate": "bf16"},
    "fp8-w8a8": {"bytes": 1.0, "rate": "fp8"},  # fp8 rows on fp8 tensor cores
    "w4a16": {"bytes": 0.5 + 2 / 128, "rate": "bf16"},  # groups of 128, one bf16 scale each
    "mxfp4": {"bytes": 0.5 + 1 / 32, "rate": "fp8"},  # e2m1, one e8m0 scale per 32; MX e4m3 activations (W4A8)
    "nvfp4": {"bytes": 0.5 + 1 / 16, "rate": "fp4"},  # e2m1, one e4m3 scale per 16 (not built: see the issue)
}
PRESETS = {  # part -> format; "built": whether the engine has it today
    "bf16": ({"vision": "bf16", "prefix": "bf16", "expert": "bf16"}, True),
    "fp8": ({"vision": "bf16", "prefix": "fp8-w8a8", "expert": "bf16"}, True),
    "w4a16": ({"vision": "bf16", "prefix": "bf16", "expert": "w4a16"}, True),
    "fp8+w4a16": ({"vision": "bf16", "prefix": "fp8-w8a8", "expert": "w4a16"}, True),
    "fp8+mxfp4": ({"vision": "bf16", "prefix": "fp8-w8a8", "expert": "mxfp4"}, True),
    "fp8, expert too": ({"vision": "bf16", "prefix": "fp8-w8a8", "expert": "fp8-w8a8"}, False),
    "nvfp4": ({"vision": "nvfp4", "prefix": "nvfp4", "expert": "nvfp4"}, False),
}
STAGES = {"observe": ("vision", "prefix"), "act": ("expert", "expert_io")}


def floors(config, device: dict, preset: dict, act_bytes: float = 2.0) -> dict:
    """{stage: {bytes, flops, memory_ms, compute_ms, floor_ms, max_hz}} of one preset on `device`."""
    parts = B.stage_parts(config)
    out = {}
    for stage, names in STAGES.items():
        nbytes = flops = compute_s = 0.0
        for n in names:
            part = parts[n]
            fmt = FORMATS[preset.get(n, "bf16")]
            nbytes += part["passes"] * (part["weights"] * fmt["bytes"] + part["other_bytes_per_pass"] * act_bytes)
            flops += part["gemm_flops"] + part["attn_flops"]
            compute_s += part["gemm_flops"] / (device["tflops"][fmt["rate"]] * 1e12) \
                + part["attn_flops"] / (device["tflops"]["bf16"] * 1e12)
        memory_ms = nbytes / (device["gbps"] * 1e9) * 1e3
        floor = max(memory_ms, compute_s * 1e3)
        out[stage] = {"bytes": nbytes, "flops": flops, "memory_ms": memory_ms, "compute_ms": compute_s * 1e3,
                      "floor_ms": floor, "max_hz": 1e3 / floor}
    whole = out["observe"]["floor_ms"] + out["act"]["floor_ms"]
    out["decision"] = {"floor_ms": whole, "max_hz": 1e3 / whole}
    return out


def table(config, device: dict) -> dict:
    """Every preset whose tensor rates the device has (no fp4 on an H200)."""
    return {name: {"formats": parts, "built": built, **floors(config, device, parts)}
            for name, (parts, built) in PRESETS.items()
            if all(FORMATS[f]["rate"] in device["tflops"] for f in parts.values())}


def print_table(rows: dict, device: dict, out=print) -> None:
    out(f"{device['name']}: {device['gbps']:.0f} GB/s, dense TFLOP/s "
        + ", ".join(f"{k} {v:g}" for k, v in device["tflops"].items()) + f" ({device['source']})")
    out("| preset | observe: GB, TFLOP, floor | act (10 steps): GB, TFLOP, floor | act at most | decision floor |")
    out("|---|---|---|---|---|")
    for name, r in rows.items():
        o, a = r["observe"], r["act"]
        label = name if r["built"] else f"{name} (not built)"
        out(f"| {label} | {o['bytes'] / 1e9:.2f}, {o['flops'] / 1e12:.2f}, {o['floor_ms']:.1f} ms "
            f"({'memory' if o['memory_ms'] >= o['compute_ms'] else 'compute'}) | {a['bytes'] / 1e9:.2f}, "
            f"{a['flops'] / 1e12:.2f}, {a['floor_ms']:.1f} ms | {a['max_hz']:.0f} Hz | "
            f"{r['decision']['floor_ms']:.1f} ms ({r['decision']['max_hz']:.0f} Hz) |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="thor", choices=sorted(DEVICES))
    p.add_argument("--model", default="pi05", choices=("pi05", "pi0"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = DEVICES[args.device]
    config = B.workload_config(2, 48, 10, 50, args.model)
    rows = table(config, device)
    print_table(rows, device)
    path = args.json or f"benchmarks/results/roofline_{args.device}_{args.model}_w2.json"
    workload = {"model": args.model, "views": 2, "prompt_len": 48, "steps": 10, "chunk": 50, "computed": True,
                "device": device}
    write_result(path, workload, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
