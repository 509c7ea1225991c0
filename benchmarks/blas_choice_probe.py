"""Does the observe stage leave GEMM time on the table in how it calls cuBLAS? (issue 3, GPU round)

The observe stage's GEMMs go through torch (cuBLAS / cuBLASLt, whose heuristic picks one kernel per shape).
At SigLIP's 512 rows they run at ~360 TFLOP/s against ~625 for the prefix's big ones
(results/profile_pi05_w2*.json). This probe times each observe GEMM of W2 (bf16, graph-timed: 20 calls per
CUDA graph, median of 5 replays) through: torch's default library, cuBLAS forced, cuBLASLt forced
(`torch.backends.cuda.preferred_blas_library`), each with and without bf16 reduced-precision split-K
reductions allowed; the patch embedding also with its K = 588 padded to 592 (16-byte rows). Prints a table
(us and TFLOP/s per call), writes JSON.

    python benchmarks/blas_choice_probe.py [--json benchmarks/results/blas_choice_probe_h200.json]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_core.bench import graph_ms  # noqa: E402

# (name, rows, in, out, bias) of W2's observe GEMMs (2 views: 512 SigLIP rows; prefix 560 rows)
SHAPES = [("siglip patch (K 588)", 512, 588, 1152, True), ("siglip patch (K padded to 592)", 512, 592, 1152, True),
          ("siglip qkv", 512, 1152, 3456, True), ("siglip o", 512, 1152, 1152, True),
          ("siglip fc1", 512, 1152, 4304, True), ("siglip fc2", 512, 4304, 1152, True),
          ("projector", 512, 1152, 2048, True), ("prefix qkv", 560, 2048, 2560, False),
          ("prefix o", 560, 2048, 2048, False), ("prefix gate|up", 560, 2048, 32768, False),
          ("prefix down", 560, 16384, 2048, False)]
MODES = [("default", None, True), ("cublas", "cublas", True), ("cublaslt", "cublaslt", True),
         ("default, fp32 split-K sums", None, False)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/blas_choice_probe.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("blas_choice_probe: needs a CUDA GPU")
    torch.manual_seed(0)
    lib0 = torch.backends.cuda.preferred_blas_library()
    red0 = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    rows = []
    try:
        for name, m, k, n, has_bias in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.02 if has_bias else None
            row = {"gemm": name, "m": m, "k": k, "n": n}
            for mode, lib, reduced in MODES:
                torch.backends.cuda.preferred_blas_library(lib or lib0)
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
                ms = graph_ms(lambda _: F.linear(x, w, b), [None] * 20, rounds=5)
                row[mode] = {"us": ms * 1e3, "tflops": 2 * m * k * n / (ms * 1e-3) / 1e12}
            rows.append(row)
    finally:
        torch.backends.cuda.preferred_blas_library(lib0)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = red0
    print(f"{'GEMM':32} {'m x k x n':>18} " + " ".join(f"{m[0][:26]:>26}" for m in MODES))
    for r in rows:
        cells = " ".join(f"{r[m[0]]['us']:10.2f} us {r[m[0]]['tflops']:6.0f} TF/s" for m in MODES)
        print(f"{r['gemm']:32} {r['m']:>5} x {r['k']:>5} x {r['n']:>5} {cells}")
    write_result(a.json, workload={"dtype": "bfloat16", "calls_per_graph": 20, "rounds": 5,
                                   "default_library": str(lib0), "torch": torch.__version__}, results={"rows": rows})
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
