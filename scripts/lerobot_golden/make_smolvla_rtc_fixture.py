#!/usr/bin/env python3
"""Make test/fixtures/lerobot_rtc/smolvla_rtc_cases.safetensors: LeRobot 0.6.1's real-time chunking (RTC) outputs for
the tiny SmolVLA checkpoint test/fixtures/lerobot_smolvla_three_cams (its VLM folder hf_vlm/ beside it).

LeRobot loads the checkpoint offline as make_smolvla_fixture.py makes it: a temporary hub cache whose snapshot of
the config's vlm_model_name is the fixture's hf_vlm/ folder, HF_HUB_OFFLINE=1. On the model-level inputs of a
fixture case (the tensors `model.sample_actions` took when the fixture was made; cases.safetensors): a previous
chunk (LeRobot's actions for another noise), then
    policy.model.sample_actions(images, img_masks, lang_tokens, lang_mask, state, noise=noise,
                                inference_delay=d, prev_chunk_left_over=prev[:, executed:, :width],
                                execution_horizon=h)
with `SmolVLAConfig.rtc_config = RTCConfig(prefix_attention_schedule=..., max_guidance_weight=...,
execution_horizon=h)` and `policy.init_rtc_processor()`, in several settings. Keys: `<case>.prev_actions` (the
previous chunk [1, chunk, 32]), `<setting>.prev_chunk_left_over` (the argument as given) and `<setting>.actions`;
the metadata's `settings` (JSON) holds each setting's case and arguments, `versions` the software.

Needs the LeRobot 0.6.1 venv (a Python 3.11 venv with lerobot 0.6.1). CPU, fp32, no network. From the repository root:
    ~/.cache/lerobot-py311/bin/python scripts/lerobot_golden/make_smolvla_rtc_fixture.py
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import FIXTURES, REPO_ROOT, offline_hub_cache  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "test"))

FOLDER = FIXTURES / "lerobot_smolvla_three_cams"
OUT = FIXTURES / "lerobot_rtc" / "smolvla_rtc_cases.safetensors"
PREV_SEED = 11
SETTINGS = {  # name: (case, schedule, max_guidance_weight, inference_delay, execution_horizon, executed, width)
    "linear_d4_h10": ("three_96x96", "LINEAR", 10.0, 4, 10, 5, 32),
    "exp_d2_h20_w7": ("three_96x96", "EXP", 5.0, 2, 20, 3, 7),  # the robot's 7 action columns only
    "ones_d0_h30_short": ("three_96x96", "ONES", 2.0, 0, 30, 30, 32),  # 20 left: the horizon is clipped to them
    "zeros_d3_h8_side_missing": ("side_missing", "ZEROS", 10.0, 3, 8, 6, 32),  # a masked camera slot
}


def main() -> int:
    hub_cache = offline_hub_cache("smolvla_rtc_hub_")  # before anything imports huggingface_hub
    try:
        return make(hub_cache)
    finally:
        shutil.rmtree(hub_cache, ignore_errors=True)


def make(hub_cache: Path) -> int:
    import torch
    from safetensors.torch import save_file

    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    from lerobot.policies.smolvla import SmolVLAPolicy
    from lerobot_cases import load_case_tensors
    from make_smolvla_fixture import lay_out_hub_cache, versions

    torch.set_num_threads(1)
    lay_out_hub_cache(FOLDER / "hf_vlm", hub_cache)
    policy = SmolVLAPolicy.from_pretrained(str(FOLDER / "checkpoint"))
    policy.eval()
    meta = json.loads((FOLDER / "cases.json").read_text())
    raw = load_case_tensors(FOLDER / "cases.safetensors")

    def inputs(case: str):
        rec = next(r for r in meta["cases"] if r["name"] == case)
        t = {k[len(case) + 1:]: v for k, v in raw.items() if k.startswith(case + ".")}
        images = [t[f"image.{i}"] for i in range(rec["image_slots"])]
        masks = [t[f"image_mask.{i}"] for i in range(rec["image_slots"])]
        return [images, masks, t["lang_tokens"], t["lang_mask"], t["state"]], t["noise"], t["actions"]

    out, settings, prev = {}, {}, {}
    for case in dict.fromkeys(s[0] for s in SETTINGS.values()):
        call, noise, want = inputs(case)
        policy.config.rtc_config = None
        policy.init_rtc_processor()
        gen = torch.Generator().manual_seed(PREV_SEED)
        with torch.no_grad():
            plain = policy.model.sample_actions(*call, noise=noise.clone())
            prev[case] = policy.model.sample_actions(*call, noise=torch.randn(noise.shape, generator=gen))
        assert (plain - want).abs().max() < 1e-5, f"{case}: the checkpoint no longer gives its own actions"
        out[f"{case}.prev_actions"] = prev[case].contiguous()
    for name, (case, schedule, max_w, delay, horizon, executed, width) in SETTINGS.items():
        call, noise, want = inputs(case)
        policy.config.rtc_config = RTCConfig(prefix_attention_schedule=RTCAttentionSchedule[schedule],
                                             max_guidance_weight=max_w, execution_horizon=horizon)
        policy.init_rtc_processor()
        left = prev[case][:, executed:, :width].clone()
        actions = policy.model.sample_actions(*call, noise=noise.clone(), inference_delay=delay,
                                              prev_chunk_left_over=left, execution_horizon=horizon)
        out[f"{name}.prev_chunk_left_over"] = left.contiguous()
        out[f"{name}.actions"] = actions.detach().contiguous()
        print(f"{name} ({case}): max |rtc - plain| {(actions - want).abs().max().item():.3g}")
        settings[name] = {"case": case, "schedule": schedule.lower(), "max_guidance_weight": max_w,
                          "inference_delay": delay, "execution_horizon": horizon, "executed": executed,
                          "width": width}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(OUT), metadata={"settings": json.dumps(settings), "fixture": FOLDER.name,
                                       "prev_seed": str(PREV_SEED), "versions": json.dumps(versions())})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
