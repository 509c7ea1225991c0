"""Real-time chunking (flashrt_core.models.rtc) against LeRobot 0.6.1's own RTC outputs on the tiny pi0.5 and pi0
fixtures (test/fixtures/lerobot_rtc, made by scripts/lerobot_golden/make_rtc_fixture.py), in the reference
engines and the fused engines (the kernels' torch references on the CPU, the Triton kernels in the interpreter)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first kernel-module import

import json  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from flashrt_core.errors import InputError  # noqa: E402
from flashrt_core.models import pi0, pi05, rtc  # noqa: E402
from flashrt_core.models.pi0 import reference as R0  # noqa: E402
from flashrt_core.models.pi05 import reference as R5  # noqa: E402
from kernel_testing import dev  # noqa: E402,F401  (the kernel device fixture: interpreter or CUDA)
from lerobot_cases import load_cases, model_inputs  # noqa: E402

MS = 1_000_000
TOL = {"vs_lerobot": 1e-4}  # fp32 (absolute): our RTC vs LeRobot's on the same weights, inputs and noise
CASE = "two_views_padded_prompt"


@pytest.fixture(scope="module")
def golden(fixtures_dir):
    with safe_open(str(fixtures_dir / "lerobot_rtc" / "rtc_cases.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        settings = json.loads(f.metadata()["settings"])
    return tensors, settings


def model(fixtures_dir, kind):
    folder = {"pi05": "lerobot_pi05_tiny", "pi0": "lerobot_pi0_tiny"}[kind]
    config, state = pi05.load_checkpoint(fixtures_dir / folder)
    weights = (pi05 if kind == "pi05" else pi0).convert(config, state)
    case = load_cases(fixtures_dir, folder)[CASE]
    return weights, case


def guidance(tensors, settings, kind, name, chunk, action_dim):
    s = settings[name]
    options = rtc.RTCOptions(execution_horizon=s["execution_horizon"], max_guidance_weight=s["max_guidance_weight"],
                             schedule=s["schedule"])
    return rtc.rtc_inputs(tensors[f"{kind}.{name}.prev_chunk_left_over"], s["inference_delay"],
                          s["execution_horizon"], options, chunk, action_dim, batch=1)


def test_prefix_weights_are_lerobots():
    """The schedules as LeRobot's get_prefix_weights builds them (hand-checked values)."""
    torch.testing.assert_close(rtc.prefix_weights(2, 6, 8, "linear"),
                               torch.tensor([1, 1, 0.8, 0.6, 0.4, 0.2, 0, 0], dtype=torch.float32))
    torch.testing.assert_close(rtc.prefix_weights(2, 6, 8, "zeros"), torch.tensor([1, 1, 0, 0, 0, 0, 0, 0.]))
    torch.testing.assert_close(rtc.prefix_weights(2, 6, 8, "ones"), torch.tensor([1, 1, 1, 1, 1, 1, 0, 0.]))
    exp = rtc.prefix_weights(1, 4, 6, "exp")
    ramp = torch.tensor([0.75, 0.5, 0.25])  # 6 - 2 trailing zeros - 1 leading one = 3 ramp steps
    torch.testing.assert_close(exp, torch.cat([torch.ones(1), ramp * torch.expm1(ramp) / (torch.e - 1),
                                               torch.zeros(2)]))
    assert rtc.prefix_weights(5, 3, 8, "linear").tolist() == [1, 1, 1, 0, 0, 0, 0, 0]  # delay past the horizon
    assert rtc.guidance_weight(1.0, 10.0) == 10.0  # tau = 0 at the first step: the clip
    assert rtc.guidance_weight(0.5, 10.0) == pytest.approx(2.0)  # c = 1, inv_r2 = 2
    assert rtc.guidance_weight(0.1, 10.0) == pytest.approx(0.82 / 0.09)  # c = 1/9, inv_r2 = 82


@pytest.mark.parametrize("kind", ["pi05", "pi0"])
def test_reference_rtc_matches_lerobot(fixtures_dir, golden, kind):
    tensors, settings = golden
    w, c = model(fixtures_dir, kind)
    cfg = w.config
    with torch.no_grad():
        if kind == "pi05":
            prefix = R5.encode_prefix(w, *model_inputs(c))
            plain = R5.denoise(w, prefix, c["noise"])
        else:
            prefix = R0.encode_prefix(w, *model_inputs(c))
            plain = R0.denoise(w, prefix, c["state_padded"], c["noise"])
        for name in settings:
            g = guidance(tensors, settings, kind, name, cfg.chunk_size, cfg.action_dim)
            if kind == "pi05":
                got = R5.denoise(w, prefix, c["noise"], g)
            else:
                got = R0.denoise(w, prefix, c["state_padded"], c["noise"], g)
            want = tensors[f"{kind}.{name}.actions"]
            err = (got - want).abs().max().item()
            assert err < TOL["vs_lerobot"], f"{kind} {name}: max abs error {err:.3g}"
            assert (got - plain).abs().max() > 0.1  # the guidance moved the chunk (LeRobot's by up to ~5)


def test_bad_rtc_arguments_are_refused_by_name():
    options = rtc.RTCOptions()
    prev = torch.zeros(1, 40, 7)
    with pytest.raises(InputError, match="prev_chunk_left_over"):
        rtc.rtc_inputs(torch.zeros(1, 60, 7), 3, None, options, 50, 32, 1)
    with pytest.raises(InputError, match="prev_chunk_left_over"):
        rtc.rtc_inputs(torch.zeros(1, 40, 33), 3, None, options, 50, 32, 1)
    with pytest.raises(InputError, match="inference_delay"):
        rtc.rtc_inputs(prev, -1, None, options, 50, 32, 1)
    with pytest.raises(InputError, match="execution_horizon"):
        rtc.rtc_inputs(prev, 2, 2.5, options, 50, 32, 1)
    with pytest.raises(ValueError, match="schedule"):
        rtc.RTCOptions(schedule="cosine")
    with pytest.raises(ValueError, match="max_guidance_weight"):
        rtc.RTCOptions(max_guidance_weight=0)
    g = rtc.rtc_inputs(prev[0], 2, 100, options, 50, 32, 1)  # [T, A] is one batch; the horizon clipped to 40
    assert g.prev.shape == (1, 50, 32) and g.weights[39] > 0 and g.weights[40:].abs().sum() == 0


def test_step_coefficients_give_lerobots_step():
    """x + a v + b (prev - x) is LeRobot's guided Euler step, step by step (the fused engines' form)."""
    gen = torch.Generator().manual_seed(3)
    x, v, prev = (torch.randn(1, 12, 5, generator=gen) for _ in range(3))
    g = rtc.RTCInputs(prev=prev, weights=rtc.prefix_weights(3, 9, 12, "exp"), max_guidance_weight=6.0)
    a, b = rtc.step_coefficients(g.weights, 4, g.max_guidance_weight)
    for s in range(4):
        t = 1.0 + s * -0.25
        want = rtc.guided_step(x, v, g, t, -0.25)
        got = x + a[s][None, :, None] * v + b[s][None, :, None] * (prev - x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["pi05", "pi0"])
def test_fused_engine_rtc_matches_lerobot_on_the_cpu(fixtures_dir, golden, kind):
    """The fused engines' "act+rtc" stage (the kernels' torch references on the CPU) against LeRobot's RTC, and
    the plain act stage unchanged after it (the guided graph is a variant, not a mode)."""
    from flashrt_core.models.pi0.engine import Pi0Engine
    from flashrt_core.models.pi05.engine import Pi05Engine

    tensors, settings = golden
    w, c = model(fixtures_dir, kind)
    engine = (Pi05Engine if kind == "pi05" else Pi0Engine)(w, backend="torch")
    prefix = engine.encode_prefix(*model_inputs(c))
    act = (lambda *a: engine.denoise(prefix, *a)) if kind == "pi05" else \
        (lambda *a: engine.denoise(prefix, c["state_padded"], *a))
    for name in settings:
        g = guidance(tensors, settings, kind, name, w.config.chunk_size, w.config.action_dim)
        got = act(c["noise"], g)
        err = (got - tensors[f"{kind}.{name}.actions"]).abs().max().item()
        assert err < TOL["vs_lerobot"], f"{kind} {name}: max abs error {err:.3g}"
    assert (act(c["noise"]) - c["actions"]).abs().max() < TOL["vs_lerobot"]


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["pi05", "pi0"])
def test_triton_rtc_matches_the_reference(dev, kind):
    """The Triton kernels (interpreter on a CPU, compiled on CUDA) in the guided act stage, on micro models
    with odd shapes, against the reference engine's RTC."""
    import test_pi05_engine as T5
    import test_pi0_engine as T0
    from flashrt_core.models.pi0.engine import Pi0Engine
    from flashrt_core.models.pi05.engine import Pi05Engine

    T = T5 if kind == "pi05" else T0
    config, state = pi05.build_tiny(4, T.micro_config())
    w = (pi05 if kind == "pi05" else pi0).convert(config, state)
    inputs = T.micro_inputs(config)
    noise = inputs[-1]
    gen = torch.Generator().manual_seed(9)
    prev = torch.randn(1, config.chunk_size - 2, 5, generator=gen)
    g = rtc.rtc_inputs(prev, 2, 3, rtc.RTCOptions(schedule="exp", max_guidance_weight=4.0), config.chunk_size,
                       config.action_dim, batch=1)
    with torch.no_grad():
        if kind == "pi05":
            want = R5.denoise(w, R5.encode_prefix(w, *inputs[:4]), noise, g)
        else:
            want = R0.denoise(w, R0.encode_prefix(w, *inputs[:4]), inputs[4], noise, g)
    engine = (Pi05Engine if kind == "pi05" else Pi0Engine)(w, device=dev, backend="triton", gemm="triton",
                                                           graphs=False)
    prefix = engine.encode_prefix(*(t.to(dev) for t in inputs[:4]))
    g_dev = rtc.RTCInputs(prev=g.prev.to(dev), weights=g.weights.to(dev), max_guidance_weight=g.max_guidance_weight)
    extra = () if kind == "pi05" else (inputs[4].to(dev),)
    got = engine.denoise(prefix, *extra, noise.to(dev), g_dev).cpu()
    assert (got - want).abs().max() < 1e-3


@pytest.mark.parametrize("kind,engine", [("pi05", "reference"), ("pi05", "fused"), ("pi0", "reference"),
                                         ("pi0", "fused")])
def test_policy_sample_actions_takes_lerobots_rtc_arguments(fixtures_dir, golden, tmp_path, kind, engine, model_ckpt):
    """`policy.sample_actions(..., inference_delay=, prev_chunk_left_over=, execution_horizon=)` as LeRobot's
    model.sample_actions, with the options from a config.json rtc_config as LeRobot saves it; without
    rtc_config a previous chunk is ignored (LeRobot's behaviour), and a bad rtc_config is refused."""
    import shutil

    tensors, settings = golden
    name = "exp_d2_h20_w6"
    s = settings[name]
    folder = tmp_path / "ckpt"
    shutil.copytree(model_ckpt[kind], folder)
    mod = pi05 if kind == "pi05" else pi0
    plain_policy = mod.load(folder, engine=engine)
    assert plain_policy.rtc is None
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rtc_config"] = {"enabled": True, "prefix_attention_schedule": s["schedule"].upper(),
                         "max_guidance_weight": s["max_guidance_weight"], "execution_horizon": 99,
                         "debug": False, "debug_maxlen": 100}
    (folder / "config.json").write_text(json.dumps(cfg))
    policy = mod.load(folder, engine=engine)
    assert policy.rtc == rtc.RTCOptions(execution_horizon=99, max_guidance_weight=s["max_guidance_weight"],
                                        schedule=s["schedule"])
    if engine == "fused":
        policy.engine.backend = plain_policy.engine.backend = "torch"
    _, c = model(fixtures_dir, kind)
    images, masks, tokens, lang_mask = model_inputs(c)
    state = (c["state_padded"],) if kind == "pi0" else ()
    prev = tensors[f"{kind}.{name}.prev_chunk_left_over"]
    kw = dict(noise=c["noise"], inference_delay=s["inference_delay"], prev_chunk_left_over=prev,
              execution_horizon=s["execution_horizon"])
    got = policy.sample_actions(list(images.unbind(1)), list(masks.unbind(1)), tokens, lang_mask, *state, **kw)
    assert (got - tensors[f"{kind}.{name}.actions"]).abs().max() < TOL["vs_lerobot"]
    ignored = plain_policy.sample_actions(images, masks, tokens, lang_mask, *state, **kw)
    assert (ignored - c["actions"]).abs().max() < TOL["vs_lerobot"]
    cfg["rtc_config"]["prefix_attention_schedule"] = "COSINE"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="rtc_config"):
        mod.load(folder, engine=engine)


# ---- through the contract runtime (model.options.rtc) ---------------------------------------------------
def rtc_runtime(engine: str, rtc_option, seed: int = 0):
    from flashrt_core.contract.runtime import Runtime

    config = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"
    return Runtime.from_config(config, seed=seed, options={"engine": engine, "rtc": rtc_option},
                               rates={"observe": 10, "act": 50}, deferred={"observe": False},
                               max_observation_age_ms=1000.0)


@pytest.mark.parametrize("engine", ["reference", "fused"])
def test_contract_rtc_guides_each_act_tick_towards_the_rest_of_the_previous_chunk(engine):
    """model.options.rtc on: at act tick k the robot has executed k - k_prev actions of the previous chunk
    (50 Hz act, 50 Hz actions: one), so the chunk is the policy's guided flow towards prev[1:], with the
    inference delay and horizon of the options, over the same prefix and noise (LeRobot's RTC, as the policy
    API computes it). Off, the same ticks give plain chunks."""
    import numpy as np

    from flashrt_core.contract.bindings.flow import prefix_cache

    opts = {"execution_horizon": 12, "max_guidance_weight": 6.0, "schedule": "exp", "inference_delay": 2}
    rt = rtc_runtime(engine, opts)
    if engine == "fused":
        rt.binding.policy.engine.backend = "torch"
    plain = rtc_runtime("reference", None)
    rng = np.random.default_rng(4)
    imgs = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    noise = torch.Generator().manual_seed(0)  # the runtime's host generator: one [50, 32] draw per act tick
    policy, b = rt.binding.policy, rt.buffers
    options = rtc.RTCOptions(execution_horizon=12, max_guidance_weight=6.0, schedule="exp")
    prev, moved = None, 0.0
    for r_ in (rt, plain):
        r_.set_prompt("stack the cups")
    for k in range(5):  # observe at tick 0 only (10 Hz): one prefix for all five
        for r_ in (rt, plain):
            r_.set_observation(images=imgs, state=np.full(8, 0.1, np.float32), stamp_ns=1 + k * 20 * MS)
        out = rt.step(1 + k * 20 * MS)
        base = plain.step(1 + k * 20 * MS)
        draw = torch.randn(50, 32, generator=noise)[None]
        chunk = b["prev_chunk"].clone()
        with torch.no_grad():
            if prev is None:  # the first chunk has nothing to follow: a plain flow
                want = policy.denoise(prefix_cache(b), draw)[0]
            else:
                guide = rtc.rtc_inputs(prev[1:][None], 2, 12, options, 50, 32, batch=1)
                want = policy.denoise(prefix_cache(b), draw, rtc=guide)[0]
        assert (chunk - want).abs().max() < 1e-4, k
        assert out.actions is not None and base.actions is not None
        if k:
            moved = max(moved, float(np.abs(out.actions - base.actions).max()))
        prev = chunk
    assert moved > 1e-2  # the guidance changed the chunks (the plain runtime drew the same noise)
    assert int(rt.buffers["rtc_shift"][0]) == 1


def test_contract_rtc_options_are_checked():
    from flashrt_core.errors import ContractError

    for bad, match in (({"schedule": "cosine"}, "schedule"), ({"inference_delay": -1}, "inference_delay"),
                       ({"action_rate_hz": 0}, "action_rate_hz"), ({"horizon": 3}, "rtc.horizon"),
                       ("on", "rtc")):
        with pytest.raises(ContractError, match=match):
            rtc_runtime("reference", bad)
    on = rtc_runtime("reference", True).binding.rtc
    assert on.options == rtc.RTCOptions() and on.inference_delay == "auto"  # LeRobot's defaults, measured delay


def test_contract_rtc_auto_delay_follows_the_measured_act_latency():
    """inference_delay auto: the act stage's latest latency over the action period, rounded up (1 before any
    measurement)."""
    rt = rtc_runtime("reference", {"action_rate_hz": 100})
    io = rt._io
    assert rt.binding._rtc_delay(io) == 1
    io.stage_ms["act"] = 25.0  # 2.5 action periods of 10 ms
    assert rt.binding._rtc_delay(io) == 3
    io.stage_ms["act"] = 4.0
    assert rt.binding._rtc_delay(io) == 1


def test_node_parameters_turn_rtc_on_with_the_robots_action_period():
    """policy_node: rtc: true (and its rtc_* options) becomes the contract's model.options.rtc, the robot's
    action rate from action_dt; a bad schedule is refused naming the parameter; the runtime it gives guides."""
    from flashrt_ros.params import PARAMETERS, validate
    from flashrt_ros.runtime_loader import runtime_arguments

    values = {name: default for name, (default, *_rest) in PARAMETERS.items()}
    values.update(rtc=True, rtc_execution_horizon=12, rtc_schedule="exp", rtc_inference_delay=2, action_dt=0.025,
                  joint_names=[f"j{i}" for i in range(8)])
    args = runtime_arguments(validate(values), n_cameras=2)
    assert args["options"]["rtc"] == {"execution_horizon": 12, "max_guidance_weight": 10.0, "schedule": "exp",
                                      "inference_delay": 2, "action_rate_hz": 40.0}
    assert "rtc" not in (runtime_arguments(validate({**values, "rtc": False}), 2)["options"] or {})
    measured = runtime_arguments(validate({**values, "rtc_inference_delay": -1}), 2)["options"]["rtc"]
    assert measured["inference_delay"] == "auto"
    with pytest.raises(ValueError, match="rtc_schedule"):
        validate({**values, "rtc_schedule": "cosine"})
    with pytest.raises(ValueError, match="action_dt"):
        validate({**values, "action_dt": 5e-4})
    from flashrt_core.contract.runtime import Runtime

    rt = Runtime.from_config(device="cpu", seed=0, **args)
    assert rt.binding.rtc.action_rate_hz == 40.0 and rt.binding.rtc.options.schedule == "exp"


def test_contract_rtc_after_a_live_restore_is_a_plain_flow_and_after_a_rewind_guided():
    """A live restore keeps the world's time but brings back the capsule's prev_chunk, which the robot is not
    executing: the next chunk is a plain flow (shift = chunk: nothing to follow). A rewind restore replays the
    snapshot's timeline: the same guided chunk as the first time."""
    import numpy as np

    rt = rtc_runtime("reference", {"inference_delay": 2, "action_rate_hz": 50})
    rng = np.random.default_rng(6)
    imgs = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    rt.set_prompt("stack the cups")

    def tick(k):
        rt.set_observation(images=imgs, state=np.full(8, 0.2, np.float32), stamp_ns=1 + k * 20 * MS)
        return rt.step(1 + k * 20 * MS)
    for k in range(3):
        tick(k)
    cid = rt.snapshot("mid")
    first = tick(3).actions
    assert int(rt.buffers["rtc_shift"][0]) == 1
    tick(4)
    rt.restore(cid)  # live
    tick(5)
    assert int(rt.buffers["rtc_shift"][0]) == 50 and float(rt.buffers["rtc_weights"].abs().sum()) == 0.0
    tick(6)
    assert int(rt.buffers["rtc_shift"][0]) == 1  # guided again from the chunk it just made
    rt.restore(cid, rewind_time=True)
    np.testing.assert_array_equal(tick(3).actions, first)


def test_guidance_weight_follows_lerobots_nan_to_num_at_the_ends():
    """At time 0 (never an Euler step, but the formula's end) LeRobot's nan_to_num makes 0 * inf a 0; at time 1
    the clip. An empty rtc_config in config.json is LeRobot's default RTCConfig (enabled)."""
    assert rtc.guidance_weight(0.0, 10.0) == 0.0 and rtc.guidance_weight(1.0, 7.0) == 7.0
    assert rtc.options_from_lerobot({"rtc_config": {}}) == rtc.RTCOptions()
    assert rtc.options_from_lerobot({"rtc_config": None}) is None
    assert rtc.options_from_lerobot({"rtc_config": {"enabled": False}}) is None


def test_contract_rtc_with_pi0_guides_its_act_ticks_too(model_ckpt):
    """config/pi0.yaml with model.options.rtc (act reads the state and follows the previous chunk's rest):
    each act tick is the pi0 policy's guided flow over the same prefix, state and noise."""
    import numpy as np

    from flashrt_core.contract.bindings.flow import prefix_cache
    from flashrt_core.contract.runtime import Runtime

    repo = pathlib.Path(__file__).resolve().parents[1]
    rt = Runtime.from_config(repo / "config" / "pi0.yaml", checkpoint=str(model_ckpt["pi0"]),
                             device="cpu", num_cameras=2, seed=2, deferred={"observe": False},
                             options={"rtc": {"inference_delay": 1, "execution_horizon": 15}})
    policy, b = rt.binding.policy, rt.buffers
    options = rtc.RTCOptions(execution_horizon=15)
    rng = np.random.default_rng(8)
    imgs = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    noise = torch.Generator().manual_seed(2)
    rt.set_prompt("stack the cups")
    prev = None
    for k in range(3):
        rt.set_observation(images=imgs, state=rng.uniform(-1, 1, 8).astype(np.float32), stamp_ns=1 + k * 20 * MS)
        assert rt.step(1 + k * 20 * MS).actions is not None
        draw = torch.randn(50, 32, generator=noise)[None]
        guide = None if prev is None else rtc.rtc_inputs(prev[1:][None], 1, 15, options, 50, 32, batch=1)
        with torch.no_grad():
            want = policy.denoise(prefix_cache(b), b["act_state"][None], draw, rtc=guide)[0]
        assert (b["prev_chunk"] - want).abs().max() < 1e-4, k
        prev = b["prev_chunk"].clone()
    assert int(b["rtc_shift"][0]) == 1
