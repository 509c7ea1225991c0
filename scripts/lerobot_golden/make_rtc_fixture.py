#!/usr/bin/env python3
"""Make test/fixtures/lerobot_rtc/rtc_cases.safetensors: LeRobot 0.6.1's real-time chunking (RTC) outputs for the
tiny pi0.5 and pi0 checkpoints of test/fixtures (`lerobot_pi05_tiny`, `lerobot_pi0_tiny`).

For each model, on the inputs of its `two_views_padded_prompt` case: a previous chunk (LeRobot's actions for
another noise), then `policy.model.sample_actions(..., noise=noise, inference_delay=d, prev_chunk_left_over=
prev[:, executed:, :A], execution_horizon=h)` with `PI05Config.rtc_config` / `PI0Config.rtc_config` set to
`RTCConfig(prefix_attention_schedule=..., max_guidance_weight=...)`, in several settings (schedules, delays,
horizons, a previous chunk narrower than max_action_dim). Keys: `<model>.prev_actions` (the previous chunk
[1, chunk, 32]), `<model>.<setting>.prev_chunk_left_over` (the argument as given) and
`<model>.<setting>.actions`; the file's metadata `settings` holds each setting's arguments (JSON).

Needs Python >= 3.12 with lerobot==0.6.1, transformers==5.5.4 and torch (CPU). Run from the repository root:
    python scripts/lerobot_golden/make_rtc_fixture.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FIXTURES, tiny_model_sizes, versions  # noqa: E402

sys.path.insert(0, str(FIXTURES.parent))
OUT = FIXTURES / "lerobot_rtc" / "rtc_cases.safetensors"
CASE = "two_views_padded_prompt"
SETTINGS = {  # name: (schedule, max_guidance_weight, inference_delay, execution_horizon, executed, action width)
    "linear_d4_h10": ("LINEAR", 10.0, 4, 10, 5, 32),
    "exp_d2_h20_w6": ("EXP", 5.0, 2, 20, 3, 6),
    "zeros_d3_h8": ("ZEROS", 10.0, 3, 8, 6, 32),
    "ones_d0_h30_short": ("ONES", 2.0, 0, 30, 30, 32),  # 20 actions left: the horizon is clipped to them
}


def main() -> int:
    import torch
    from safetensors.torch import save_file

    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.pi0 import PI0Policy, modeling_pi0
    from lerobot.policies.pi05 import PI05Policy, modeling_pi05
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    from lerobot_cases import load_cases, model_inputs

    out, settings = {}, {}
    for model, folder, cls, modeling in (("pi05", "lerobot_pi05_tiny", PI05Policy, modeling_pi05),
                                         ("pi0", "lerobot_pi0_tiny", PI0Policy, modeling_pi0)):
        dims = json.loads((FIXTURES / folder / "dims.json").read_text())
        with tiny_model_sizes(modeling, dims):
            policy = cls.from_pretrained(str(FIXTURES / folder))
        policy.eval()
        c = load_cases(FIXTURES, folder)[CASE]
        args = list(model_inputs(c)) + ([c["state_padded"]] if model == "pi0" else [])
        images, masks = list(c["images"].unbind(1)), list(c["image_masks"].unbind(1))
        call = [images, masks, *args[2:]]
        gen = torch.Generator().manual_seed(7)
        prev_noise = torch.randn(c["noise"].shape, generator=gen)
        with torch.no_grad():
            prev_actions = policy.model.sample_actions(*call, noise=prev_noise)
            plain = policy.model.sample_actions(*call, noise=c["noise"])
        assert (plain - c["actions"]).abs().max() < 1e-5, "the tiny checkpoint no longer gives its own actions"
        out[f"{model}.prev_actions"] = prev_actions.clone()
        for name, (schedule, max_w, delay, horizon, executed, width) in SETTINGS.items():
            policy.config.rtc_config = RTCConfig(prefix_attention_schedule=RTCAttentionSchedule[schedule],
                                                 max_guidance_weight=max_w, execution_horizon=horizon)
            policy.init_rtc_processor()
            left = prev_actions[:, executed:, :width].clone()
            actions = policy.model.sample_actions(*call, noise=c["noise"], inference_delay=delay,
                                                  prev_chunk_left_over=left, execution_horizon=horizon)
            out[f"{model}.{name}.prev_chunk_left_over"] = left
            out[f"{model}.{name}.actions"] = actions.detach().contiguous()
            moved = (actions - plain).abs().max().item()
            print(f"{model} {name}: max |rtc - plain| {moved:.3g}")
            settings[name] = {"schedule": schedule.lower(), "max_guidance_weight": max_w, "inference_delay": delay,
                              "execution_horizon": horizon, "executed": executed, "width": width}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(OUT), metadata={"settings": json.dumps(settings), "case": CASE,
                                       "versions": json.dumps(versions())})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
