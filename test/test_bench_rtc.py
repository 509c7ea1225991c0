"""benchmarks/bench_rtc.py on the CPU with the tiny model: the guided act of the fused engine against the fp32
reference's RTC, the plain act unchanged, and the JSON fields the GPU run reports."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

from flashrt_core.models.pi05 import Pi05Config  # noqa: E402


def test_bench_rtc_tiny_reports_parity_and_the_act_ratio():
    import bench_rtc

    for kind in ("pi05", "pi0"):
        workload, results, ok = bench_rtc.measure(kind, views=2, prompt_len=16, steps=10, chunk=20, iters=2,
                                                  warmup=1, lerobot=False, dtype=torch.float32, device="cpu",
                                                  base_config=Pi05Config.tiny(), log=lambda *a: None)
        parity = results["parity"]
        assert parity["flashrt_vs_reference_fp32"]["max_abs"] < 1e-4, kind
        assert parity["flashrt_plain_vs_reference_fp32"]["max_abs"] < 1e-4, kind
        # the guidance moves the actions (else the parity would not show it)
        assert parity["rtc_effect_reference_fp32"]["rel_l2"] > 1e-2, kind
        assert set(results["timing"]) == {"act", "act+rtc", "denoise", "denoise+rtc"}
        assert results["rtc_act_over_plain_act"] > 0 and workload["rtc"]["inference_delay"] == 4
        assert ok == (results["rtc_act_over_plain_act"] <= 2.5), kind
