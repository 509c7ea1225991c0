"""pi0 on the GPU: the fused engine vs LeRobot 0.6.1 eager and torch.compile, in one process (GPU round).

bench_pi05.py's driver for pi0 (`PI0Policy`; the robot state is a model input: a state token read by every
flow step). Full-size pi0 with every parameter normal(0, 0.02), W2 shapes: 2 views 224x224, 48-token prompt,
10 steps, chunk 50, bf16, a random normalized state [1, 32]. Writes into --out-dir, each file as soon as its
workload is done:
  pi0_w2.json           W2 with lerobot-eager and lerobot-compile (unless --skip-compile), per-stage TFLOP/s
                        and GB/s, parity
  pi0_views1.json, pi0_views3.json, pi0_w2_siglip_fp32.json   as bench_pi05.py's
  pi0_parity.json       the parity sections side by side: the bf16 engine against the project's fp32
                        reference (flashrt_core.models.pi0.reference) and against LeRobot in bf16 and in float32
                        (same weights, noise and state); targets cosine >= 0.999, relative L2 <= 2e-2
flashrt-act-only is `engine.denoise(prefix, state, noise)` over the cached prefix, another state each call.

    python benchmarks/bench_pi0.py --out-dir benchmarks/results --workloads w2 [--skip-compile] [--no-parity]
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's flashrt_core first
import bench_pi05  # noqa: E402


def main(argv=None) -> int:
    return bench_pi05.main(argv, kind="pi0", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
