"""Real-time chunking (RTC) for SmolVLA against LeRobot 0.6.1's own RTC outputs on the tiny three-camera checkpoint
(test/fixtures/lerobot_rtc/smolvla_rtc_cases.safetensors, made by scripts/lerobot_golden/make_smolvla_rtc_fixture.py
on test/fixtures/lerobot_smolvla_three_cams): the eager reference, the fused engine's "act+rtc" stage (the kernels'
torch references on the CPU; the Triton kernels in the interpreter on a two-step flow over the reference's prefix,
against the reference's guided flow), the policy API with LeRobot's arguments (`sample_actions(...,
inference_delay=, prev_chunk_left_over=, execution_horizon=)`, options from config.json's rtc_config) and the
contract runtime (config/smolvla.yaml with model.options.rtc).

Tolerance: 1e-4 max abs (fp32) against LeRobot's RTC chunks on the same weights, inputs and noise (measured ~1e-6 for
the reference and the fused engine on the CPU); RTC off (no rtc_config / no previous chunk) gives the plain chunk,
LeRobot's `sample_actions(noise=)`, within the same 1e-4.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first kernel-module import

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from flashrt_core.models import rtc  # noqa: E402
from flashrt_core.models.smolvla import reference as R  # noqa: E402
from flashrt_core.models.smolvla.engine import SmolVLAEngine  # noqa: E402
from smolvla_cases import FIXTURES, model  # noqa: E402

TOL = 1e-4  # fp32 max abs: ours vs LeRobot's RTC chunks (and RTC off vs the plain chunk)
FOLDER = "lerobot_smolvla_three_cams"
REPO = pathlib.Path(__file__).resolve().parents[1]
MS = 1_000_000


@pytest.fixture(scope="module")
def golden():
    with safe_open(str(FIXTURES / "lerobot_rtc" / "smolvla_rtc_cases.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    assert meta["fixture"] == FOLDER
    return tensors, json.loads(meta["settings"])


def options(s) -> rtc.RTCOptions:
    return rtc.RTCOptions(execution_horizon=s["execution_horizon"], max_guidance_weight=s["max_guidance_weight"],
                          schedule=s["schedule"])


def guidance(tensors, settings, name, config) -> rtc.RTCInputs:
    s = settings[name]
    return rtc.rtc_inputs(tensors[f"{name}.prev_chunk_left_over"], s["inference_delay"], s["execution_horizon"],
                          options(s), config.chunk_size, config.max_action_dim, batch=1)


def test_the_fixture_covers_delays_horizons_widths_and_a_masked_camera(golden):
    tensors, settings = golden
    assert len(settings) >= 3
    assert len({s["inference_delay"] for s in settings.values()}) >= 3
    assert len({s["execution_horizon"] for s in settings.values()}) >= 3
    assert {s["width"] for s in settings.values()} == {7, 32}  # the robot's columns only, and all of them
    assert {s["case"] for s in settings.values()} == {"three_96x96", "side_missing"}
    for name, s in settings.items():
        assert tensors[f"{name}.prev_chunk_left_over"].shape == (1, 50 - s["executed"], s["width"])


def test_reference_rtc_matches_lerobot_and_off_is_the_plain_chunk(golden):
    tensors, settings = golden
    config, w, _, cases = model(FOLDER)
    engine = R.ReferenceEngine(w)
    for name, s in settings.items():
        c = cases[s["case"]]
        prefix = engine.encode_prefix(*c.inputs())
        got = engine.denoise(prefix, c.noise, guidance(tensors, settings, name, config))
        err = (got - tensors[f"{name}.actions"]).abs().max().item()
        assert err < TOL, f"{name}: max abs {err:.3g} vs LeRobot's RTC"
        plain = engine.denoise(prefix, c.noise)
        assert (plain - c.actions).abs().max().item() < TOL  # RTC off: LeRobot's plain chunk
        assert (got - plain).abs().max().item() > 0.1  # the guidance moved it (LeRobot's by ~4-5)
    # zero prefix weights (nothing left to follow) are a plain flow in the guided step too
    c = cases["three_96x96"]
    prefix = engine.encode_prefix(*c.inputs())
    none = rtc.RTCInputs(prev=torch.randn(1, 50, 32), weights=torch.zeros(50), max_guidance_weight=10.0)
    assert (engine.denoise(prefix, c.noise, none) - c.actions).abs().max().item() < TOL


def test_fused_engine_act_rtc_matches_lerobot_on_the_cpu(golden):
    """The "act+rtc" stage (the kernels' torch references) against LeRobot's RTC; the plain act stage after it is
    unchanged (the guided graph is a variant of act, not a mode)."""
    tensors, settings = golden
    config, w, _, cases = model(FOLDER)
    engine = SmolVLAEngine(w, torch.device("cpu"), torch.float32, backend="torch", gemm="torch")
    for name, s in settings.items():
        c = cases[s["case"]]
        prefix = engine.encode_prefix(*c.inputs())
        got = engine.denoise(prefix, c.noise, guidance(tensors, settings, name, config))
        err = (got - tensors[f"{name}.actions"]).abs().max().item()
        assert err < TOL, f"{name}: max abs {err:.3g} vs LeRobot's RTC"
        assert (engine.denoise(prefix, c.noise) - c.actions).abs().max().item() < TOL
    # the staged buffers path (a runtime's): set_rtc + act(rtc=True) is the same as denoise(..., rtc)
    name = "linear_d4_h10"
    engine.encode_prefix(*cases["three_96x96"].inputs())
    engine.buffers.noise.copy_(cases["three_96x96"].noise)
    engine.set_rtc(guidance(tensors, settings, name, config))
    engine.act(rtc=True)
    assert (engine.buffers.actions - tensors[f"{name}.actions"]).abs().max().item() < TOL


@pytest.mark.interpret
def test_triton_act_rtc_matches_the_reference():
    """The Triton kernels (interpreter) in the guided act stage on a two-step flow (the clip at t = 1, then
    g(0.5) = 2: both coefficient rows), against the reference's guided flow on the same weights."""
    from safetensors.torch import load_file

    from flashrt_core import kernels as K
    from flashrt_core.models.smolvla import convert

    if not K.available("cpu"):
        pytest.skip("needs TRITON_INTERPRET=1 before the kernels are imported")
    config, _, _, cases = model(FOLDER)
    two = dataclasses.replace(config, num_steps=2)
    w = convert(two, load_file(str(FIXTURES / FOLDER / "checkpoint" / "model.safetensors")))
    c = cases["side_missing"]
    prev = torch.randn(1, 40, 7, generator=torch.Generator().manual_seed(3))
    g = rtc.rtc_inputs(prev, 3, 12, rtc.RTCOptions(schedule="exp", max_guidance_weight=4.0), two.chunk_size,
                       two.max_action_dim, batch=1)
    with torch.no_grad():
        prefix = R.encode_prefix(w, *c.inputs())
        want = R.denoise(w, prefix, c.noise, g)
        plain = R.denoise(w, prefix, c.noise)
    engine = SmolVLAEngine(w, torch.device("cpu"), torch.float32, backend="triton", gemm="torch", graphs=False)
    got = engine.denoise(prefix, c.noise, g)  # (the reference's prefix: the observe stage is test_smolvla_engine's)
    err = (got - want).abs().max().item()
    assert err < TOL, f"Triton act+rtc vs the reference: max abs {err:.3g}"
    assert (want - plain).abs().max().item() > 0.1


def rtc_checkpoint(tmp_path, s, horizon=99):
    """A copy of the fixture checkpoint whose config.json carries LeRobot's rtc_config (as save_pretrained writes
    it with RTCConfig set)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / FOLDER / "checkpoint", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rtc_config"] = {"enabled": True, "prefix_attention_schedule": s["schedule"].upper(),
                         "max_guidance_weight": s["max_guidance_weight"], "execution_horizon": horizon,
                         "debug": False, "debug_maxlen": 100}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, cfg


@pytest.mark.parametrize("engine", ["reference", "fused"])
def test_policy_sample_actions_takes_lerobots_rtc_arguments(golden, tmp_path, engine):
    """`SmolVLAPolicy.sample_actions(..., inference_delay=, prev_chunk_left_over=, execution_horizon=)` as LeRobot's
    model.sample_actions, with the options of a config.json rtc_config (load(rtc="checkpoint")); without
    rtc_config a previous chunk is ignored (LeRobot's behaviour); a bad rtc_config is refused."""
    from flashrt_core.models.smolvla import policy as smolvla_policy

    tensors, settings = golden
    vlm = FIXTURES / FOLDER / "hf_vlm"
    plain_policy = smolvla_policy.load(FIXTURES / FOLDER / "checkpoint", vlm=vlm, engine=engine, dtype="float32")
    assert plain_policy.rtc is None
    _, _, _, cases = model(FOLDER)
    for name in ("exp_d2_h20_w7", "zeros_d3_h8_side_missing"):
        s = settings[name]
        folder, cfg = rtc_checkpoint(tmp_path / name, s)
        policy = smolvla_policy.load(folder, vlm=vlm, engine=engine, dtype="float32")
        assert policy.rtc == rtc.RTCOptions(execution_horizon=99, max_guidance_weight=s["max_guidance_weight"],
                                            schedule=s["schedule"])
        if engine == "fused":
            policy.engine.backend = plain_policy.engine.backend = "torch"
        c = cases[s["case"]]
        images, masks, tokens, lang_mask, state = c.inputs()
        kw = dict(noise=c.noise, inference_delay=s["inference_delay"],
                  prev_chunk_left_over=tensors[f"{name}.prev_chunk_left_over"], execution_horizon=s["execution_horizon"])
        got = policy.sample_actions(list(images.unbind(1)), list(masks.unbind(1)), tokens, lang_mask, state, **kw)
        err = (got - tensors[f"{name}.actions"]).abs().max().item()
        assert err < TOL, f"{engine} {name}: max abs {err:.3g} vs LeRobot's RTC"
        # the two stages with the policy's guidance are the same chunk
        guide = policy.guidance(1, s["inference_delay"], tensors[f"{name}.prev_chunk_left_over"],
                                s["execution_horizon"])
        staged = policy.denoise(policy.encode_prefix(images, masks, tokens, lang_mask, state), c.noise, guide)
        assert (staged - got).abs().max().item() < 1e-6
        # no previous chunk, or no rtc_config: the plain chunk
        no_prev = policy.sample_actions(images, masks, tokens, lang_mask, state, noise=c.noise)
        ignored = plain_policy.sample_actions(images, masks, tokens, lang_mask, state, **kw)
        for out in (no_prev, ignored):
            assert (out - c.actions).abs().max().item() < TOL
    cfg["rtc_config"]["prefix_attention_schedule"] = "COSINE"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="rtc_config"):
        smolvla_policy.load(folder, vlm=vlm, engine=engine, dtype="float32")


def test_policy_refuses_bad_rtc_arguments_by_name(tmp_path, golden):
    from flashrt_core.errors import InputError
    from flashrt_core.models.smolvla import policy as smolvla_policy

    _, settings = golden
    folder, _ = rtc_checkpoint(tmp_path, settings["linear_d4_h10"])
    policy = smolvla_policy.load(folder, vlm=FIXTURES / FOLDER / "hf_vlm", engine="reference", dtype="float32")
    c = model(FOLDER)[3]["three_96x96"]
    for bad, match in (({"prev_chunk_left_over": torch.zeros(1, 51, 7)}, "prev_chunk_left_over"),
                       ({"prev_chunk_left_over": torch.zeros(1, 40, 33)}, "prev_chunk_left_over"),
                       ({"prev_chunk_left_over": torch.zeros(1, 40, 7), "inference_delay": -1}, "inference_delay")):
        with pytest.raises(InputError, match=match):
            policy.sample_actions(*c.inputs(), noise=c.noise, **bad)


# ---- through the contract runtime (config/smolvla.yaml, model.options.rtc) --------------------------------------
def smolvla_runtime(engine: str, rtc_option, seed: int = 4):
    from flashrt_core import Runtime

    fixture = FIXTURES / FOLDER
    rt = Runtime.from_config(REPO / "config" / "smolvla.yaml", checkpoint=str(fixture / "checkpoint"), device="cpu",
                             seed=seed, deferred={"observe": False},
                             options={"vlm": str(fixture / "hf_vlm"), "image_height": 96, "image_width": 96,
                                      "engine": engine, "rtc": rtc_option})
    if engine == "fused":
        rt.binding.policy.engine.backend = "torch"
    return rt


@pytest.mark.parametrize("engine", ["reference", "fused"])
def test_contract_rtc_chunk_is_the_policy_apis_guided_chunk(engine):
    """model.options.rtc on config/smolvla.yaml: the act tick k (50 Hz act, 50 Hz actions: the robot executed one
    action of the previous chunk) is a separately loaded policy's `sample_actions` with LeRobot's arguments
    (prev_chunk_left_over = the previous chunk past that action, the options' delay and horizon) for the same
    frames, state, task and noise; the same runtime with RTC off gives other (plain) chunks from the same noise,
    and the first chunk (nothing to follow) is that plain one."""
    from flashrt_core.models.smolvla import policy as smolvla_policy

    opts = {"execution_horizon": 15, "max_guidance_weight": 6.0, "schedule": "exp", "inference_delay": 2}
    rt, plain = smolvla_runtime(engine, opts), smolvla_runtime(engine, None)
    policy = smolvla_policy.load(FIXTURES / FOLDER / "checkpoint", vlm=FIXTURES / FOLDER / "hf_vlm",
                                 engine="reference", dtype="float32",
                                 rtc=rtc.RTCOptions(execution_horizon=15, max_guidance_weight=6.0, schedule="exp"))
    case = model(FOLDER)[3]["three_96x96"]
    frames = [case.tensors[f"frame.{n}"].numpy() for n in ("top", "wrist", "side")]
    state = case.tensors["state_raw"][0].numpy()
    task = "pick up the red cube"
    images, masks = policy.preprocess_images(frames)
    tokens, mask = policy.tokenize(task)
    state_n = policy.normalizer.normalize_state(torch.from_numpy(state))[None]
    for r in (rt, plain):
        r.set_prompt(task)
    noise = torch.Generator().manual_seed(4)  # the runtimes' host generator: one [50, 32] draw per act tick
    prev, moved = None, 0.0
    for k in range(3):
        for r in (rt, plain):
            r.set_observation(images=frames, state=state, stamp_ns=1 + k * 20 * MS)
        out, base = rt.step(1 + k * 20 * MS), plain.step(1 + k * 20 * MS)
        assert "act" in out.ran and "act" in base.ran
        draw = torch.randn(50, 32, generator=noise)[None]
        chunk = rt.buffers["prev_chunk"].clone()
        rest = None if prev is None else prev[1:][None]
        with torch.no_grad():
            want = policy.sample_actions(images, masks, tokens, mask, state_n, noise=draw, inference_delay=2,
                                         prev_chunk_left_over=rest, execution_horizon=15)[0]
        err = (chunk - want).abs().max().item()
        assert err < TOL, f"tick {k}: max abs {err:.3g} vs the policy API"
        diff = float(np.abs(out.actions - base.actions).max())
        if k == 0:
            assert diff < TOL  # nothing to follow yet: the plain flow
        else:
            assert int(rt.buffers["rtc_shift"][0]) == 1
            moved = max(moved, diff)
        prev = chunk
    assert moved > 1e-2  # the guidance changed the chunks (robot units; the plain runtime drew the same noise)
