"""`flashrt bench --model pi0` and benchmarks/bench_pi0.py without a GPU: the tiny model on the CPU through the
same code the H200 runs, with the pi0 reference engine (or a stand-in for the fused Pi0Engine that records how
the bench drives it) and a stand-in for LeRobot's PI0Policy computing the project's reference. Nothing is timed
against a number: these check what is called with what, what is compared with what, and what is written."""
import dataclasses
import json
import sys
import types

import pytest
import torch

from benchmark_loading import load_benchmark
from flashrt_bench import harness as bench, lerobot as bench_lerobot
from flashrt_core.models import pi0 as pi0_model
from flashrt_core.models.pi0 import reference as R0
from flashrt_core.models.pi05 import Pi05Config, expected_keys

TINY = Pi05Config.tiny()
SHAPES = dict(views=2, prompt_len=16, steps=3, chunk=5)
PARITY_KEYS = {"flashrt_vs_reference_fp32", "flashrt_vs_lerobot", "reference_fp32_vs_lerobot",
               "flashrt_vs_lerobot_fp32", "reference_fp32_vs_lerobot_fp32"}


class FakeLeRobotPi0:
    """LeRobot's PI0Policy as the bench uses it: `model.sample_actions(images list, masks list, lang_tokens,
    lang_masks, state, noise=)`, here the project's fp32 reference on the same state dict."""
    built: list = []

    def __init__(self, config, state, dtype):
        assert config.kind == "pi0"
        self.weights = pi0_model.convert(config, state)
        self.calls = []
        self.model = types.SimpleNamespace(sample_actions=self.sample_actions)
        FakeLeRobotPi0.built.append(dtype)

    def sample_actions(self, images, img_masks, lang_tokens, lang_masks, state, noise=None):
        assert isinstance(images, list) and isinstance(img_masks, list) and noise is not None
        self.calls.append(state)
        return R0.sample_actions(self.weights, torch.stack(images, 1), torch.stack(img_masks, 1), lang_tokens,
                                 lang_masks, state, noise)


@pytest.fixture
def fake_lerobot(monkeypatch):
    FakeLeRobotPi0.built = []
    monkeypatch.setattr(bench_lerobot, "build_lerobot",
                        lambda config, state, dtype="bfloat16", device="cuda": FakeLeRobotPi0(config, state, dtype))
    return FakeLeRobotPi0


class FakePi0Engine:
    """The fused Pi0Engine's interface as the bench drives it (same constructor as Pi05Engine; sample_actions,
    encode_prefix, denoise(prefix, state, noise), set_observation, set_state, buffers, observe/act/decision),
    over the reference; it records the states its act stage read."""
    instances: list = []

    def __init__(self, weights, device=None, dtype=None, *, vision_dtype=None, **options):
        self.options = options
        self.ref = R0.ReferenceEngine(weights.to(device=device, dtype=dtype, vision_dtype=vision_dtype))
        c = weights.config
        self.buffers = types.SimpleNamespace(state=torch.zeros(1, c.state_dim),
                                             noise=torch.zeros(1, c.chunk_size, c.action_dim))
        self.observation, self.prefix, self.act_states, self.captures = None, None, [], 0
        self.linear = self.attend = types.SimpleNamespace(report=lambda: {"fake": True})
        FakePi0Engine.instances.append(self)

    def set_observation(self, *observation):
        self.observation = observation

    def set_state(self, state):
        self.buffers.state.copy_(state)

    def observe(self):
        self.prefix = self.ref.encode_prefix(*self.observation)

    def act(self):
        self.act_states.append(self.buffers.state.clone())
        self.actions = self.ref.denoise(self.prefix, self.buffers.state, self.buffers.noise)

    def decision(self):
        self.observe()
        self.act()

    def encode_prefix(self, *observation):
        self.set_observation(*observation)
        self.observe()
        return self.prefix

    def denoise(self, prefix, state, noise):
        self.prefix = prefix
        self.set_state(state)
        self.buffers.noise.copy_(noise)
        self.act()
        return self.actions.clone()

    def sample_actions(self, images, image_masks, lang_tokens, lang_mask, state, noise):
        self.set_observation(images, image_masks, lang_tokens, lang_mask)
        self.set_state(state)
        self.buffers.noise.copy_(noise)
        self.decision()
        return self.actions.clone()


def tiny_run(**kwargs):
    args = dict(SHAPES, dtype="fp32", baselines=("lerobot-eager",), iters=3, warmup=1, device="cpu",
                base_config=TINY, log=lambda *a: None)
    args.update(kwargs)
    return bench.bench_pi0(**args)


# ---- inputs -------------------------------------------------------------------------------------------------
def test_pi0_inputs_add_a_state_and_leave_the_pi05_inputs_of_a_seed_as_they_were():
    c05 = bench.workload_config(2, 16, 3, 5, base=TINY)
    c0 = bench.workload_config(2, 16, 3, 5, "pi0", base=TINY)
    a, b = bench.random_inputs(c05, 7, "cpu"), bench.random_inputs(c0, 7, "cpu")
    assert "state" not in a and tuple(b["state"].shape) == (1, c0.state_dim)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert bench.decision_args(a)[-1] is a["noise"] and len(bench.decision_args(a)) == 5
    args = bench.decision_args(b)
    assert len(args) == 6 and args[4] is b["state"] and args[5] is b["noise"]
    other = torch.ones(1, c0.state_dim)
    assert bench.act_args(b, other)[0] is other and bench.act_args(a) == (a["noise"],)
    states = bench.fresh_states(c0, 7, "cpu")
    assert len(states) == 4 and all(not torch.equal(states[0], s) for s in states[1:])


def test_pi0_random_state_has_pi0s_keys_and_the_workload_pi0s_sizes():
    config = bench.workload_config(2, 48, 10, 50, "pi0")
    assert config.kind == "pi0" and config.prefix_len == 2 * 256 + 48
    keys = expected_keys(config)
    assert "model.state_proj.weight" in keys and "model.action_time_mlp_in.weight" in keys
    assert not any("time_mlp_in" in k and "action" not in k for k in keys)
    sd = bench.random_state(bench.workload_config(2, 16, 3, 5, "pi0", base=TINY), 0, "cpu")
    assert set(sd) == set(expected_keys(bench.workload_config(2, 16, 3, 5, "pi0", base=TINY)))
    assert all(0.01 < float(t.std()) < 0.03 for t in sd.values() if t.numel() > 1000)


def test_stage_costs_pi0_adds_the_state_token_and_action_time_mlp_and_leaves_pi05_as_it_was():
    pi05 = bench.stage_costs(bench.workload_config(2, 48, 10, 50))
    pi0 = bench.stage_costs(bench.workload_config(2, 48, 10, 50, "pi0"))
    # pi0.5's figures as they were before pi0 (the numbers of every pi05_w2.json)
    assert pi05 == {"observe": {"flops": 2586211516416, "bytes": 4592634880},
                    "act": {"flops": 356466688000, "bytes": 6333071360}}
    assert pi0["observe"] == pi05["observe"]  # the same prefix
    w, steps, chunk = 1024, 10, 50
    mlp = 2 * w * w  # the action-time MLP's action half and output, per action token and step
    assert pi0["act"]["bytes"] - pi05["act"]["bytes"] == steps * mlp * 2  # (bf16 weights read every step)
    # beside pi0.5's: the MLP, one more key (the state token) per action query, the state token once
    config = bench.workload_config(2, 48, 10, 50, "pi0")
    e, p = config.expert, config.prefix_len
    layers = e.depth * (e.width * (e.heads + 2 * e.kv_heads) * e.head_dim + e.heads * e.head_dim * e.width
                        + 3 * e.width * e.mlp)
    attend = e.depth * 4 * e.heads * e.head_dim
    state_token = 2 * layers + attend * (p + 1) + 2 * 32 * w
    assert pi0["act"]["flops"] - pi05["act"]["flops"] == steps * (2 * chunk * mlp + attend * chunk) + state_token


# ---- the bench on the CPU -----------------------------------------------------------------------------------
def test_bench_pi0_with_the_reference_engine_checks_parity_against_lerobot_fp32_and_bf16(fake_lerobot):
    run = tiny_run(engine="reference")
    assert run["workload"]["model"] == "pi0" and run["extra"]["engine_kind"] == "reference"
    for system in ("flashrt", "flashrt-act-only", "lerobot-eager"):
        assert run["results"][system]["p50_ms"] > 0, system
    parity = run["extra"]["parity"]
    assert set(parity) - {"targets", "state_effect_reference_fp32"} == PARITY_KEYS
    for name in PARITY_KEYS:  # fp32 everywhere here: the reference against itself
        assert parity[name]["pass"] and parity[name]["rel_l2"] < 1e-5, (name, parity[name])
    # the fp32 policy built for parity, then the timed policy in the engine's dtype (fp32 here)
    assert fake_lerobot.built == ["float32", "float32"]
    assert "lerobot_error" not in run["extra"]
    doc = bench.document(run)
    lines = []
    bench.print_table(doc, out=lines.append)
    assert lines[0].startswith("pi0 2 views") and any("flashrt rows: pi0 reference" in x for x in lines)
    assert sum("PASS" in x for x in lines) == len(PARITY_KEYS)


def test_bench_pi0_reports_how_much_the_state_moves_the_reference_actions(fake_lerobot):
    """With normal(0, 0.02) weights the expert's attention is near uniform, so the one state token among ~500
    keys moves the actions little: the bench reports by how much, beside the parity it cannot be told from."""
    effect = tiny_run(engine="reference", baselines=())["extra"]["parity"]["state_effect_reference_fp32"]
    assert 0 < effect["rel_l2"] < 1e-2


@pytest.mark.parametrize("kind", ["pi05", "pi0"])
def test_a_missing_fused_engine_is_an_error_not_a_fallback(monkeypatch, kind):
    monkeypatch.setitem(sys.modules, f"flashrt_core.models.{kind}.engine", None)
    with pytest.raises(ImportError):
        bench.bench_model(kind, **SHAPES, dtype="fp32", baselines=(), parity=False, iters=1, warmup=0,
                          device="cpu", base_config=TINY, log=lambda *a: None)


def test_bench_pi0_drives_the_fused_engine_with_a_fresh_state_per_act_tick(fake_lerobot, monkeypatch):
    FakePi0Engine.instances = []
    monkeypatch.setitem(sys.modules, "flashrt_core.models.pi0.engine", types.SimpleNamespace(Pi0Engine=FakePi0Engine))
    run = tiny_run(engine="fused", iters=4, warmup=1)
    (engine,) = FakePi0Engine.instances
    assert engine.options == {}  # the first (full) options worked
    extra, flashrt = run["extra"], run["results"]["flashrt"]
    assert extra["engine"] == "flashrt_core.models.pi0.engine.Pi0Engine" and extra["engine_kind"] == "fused"
    assert list(flashrt["phases_p50_ms"]) == ["set_observation", "set_state", "decision"]
    assert set(extra["stages"]) == {"observe", "act"} and extra["gemm_choices"] == {"fake": True}
    assert all(p["pass"] for k, p in extra["parity"].items() if "cosine" in p)
    # act-only: the 5 calls (1 warm-up + 4 timed) read 4 different states in turn
    config = bench.workload_config(2, 16, 3, 5, "pi0", base=TINY)
    fresh = bench.fresh_states(config, 0, "cpu")
    reads = engine.act_states
    inputs_state = bench.random_inputs(config, 0, "cpu")["state"]
    first = next(i for i, s in enumerate(reads) if torch.equal(s, fresh[0]))
    act_only = reads[first:first + 5]
    assert [next(j for j, f in enumerate(fresh) if torch.equal(s, f)) for s in act_only] == [0, 1, 2, 3, 0]
    # every whole decision, phase run and stage timing reads the workload's own state
    assert all(torch.equal(s, inputs_state) for s in reads[:first] + reads[first + 5:])


def test_a_failing_lerobot_is_reported_not_raised(monkeypatch):
    def broken(*a, **k):
        raise ModuleNotFoundError("No module named 'lerobot'")
    monkeypatch.setattr(bench_lerobot, "build_lerobot", broken)
    run = tiny_run(engine="reference")
    assert "lerobot" in run["extra"]["lerobot_error"]
    assert "error" in run["results"]["lerobot-eager"]
    assert set(run["extra"]["parity"]) == {"targets", "flashrt_vs_reference_fp32", "state_effect_reference_fp32"}


# ---- LeRobot's side ------------------------------------------------------------------------------------------
def test_lerobot_call_puts_pi0s_state_before_the_noise_and_pi05_has_none():
    seen = []

    def fn(*args, **kwargs):
        seen.append((args, kwargs))
    inputs = bench.random_inputs(bench.workload_config(2, 16, 3, 5, "pi0", base=TINY), 0, "cpu")
    bench_lerobot.lerobot_call(None, inputs, fn)()
    args, kwargs = seen[-1]
    assert len(args) == 5 and args[4] is inputs["state"] and kwargs == {"noise": inputs["noise"]}
    assert len(args[0]) == 2 and torch.equal(args[0][1], inputs["images"][:, 1])
    del inputs["state"]
    bench_lerobot.lerobot_call(None, inputs, fn)()
    assert len(seen[-1][0]) == 4


@pytest.fixture
def fake_lerobot_modules(monkeypatch):
    """lerobot.configs.types and both policies' modules as the bench imports them, recording what it built."""
    built = []

    class Config:
        def __init__(self, **kw):
            self.kw = kw

    def policy_class(name):
        class Policy(torch.nn.Module):
            def __init__(self, cfg):
                super().__init__()
                self.cfg, self.name, self.device_at_init = cfg, name, torch.get_default_device()
                self.model = torch.nn.Linear(2, 2)
                self.lm_head = torch.nn.Linear(2, 2, bias=False)
                built.append(self)
        return Policy

    types_mod = types.SimpleNamespace(FeatureType=types.SimpleNamespace(VISUAL="VISUAL", ACTION="ACTION"),
                                      PolicyFeature=lambda type, shape: (type, shape))
    mods = {"lerobot": types.ModuleType("lerobot"), "lerobot.configs": types.ModuleType("lerobot.configs"),
            "lerobot.configs.types": types_mod}
    for kind, (conf_mod, conf_cls, model_mod, policy_cls) in bench_lerobot.POLICIES.items():
        mods[conf_mod] = types.SimpleNamespace(**{conf_cls: type(conf_cls, (Config,), {})})
        mods[model_mod] = types.SimpleNamespace(**{policy_cls: policy_class(policy_cls)})
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return built


def test_build_lerobot_picks_pi0policy_with_the_workload_config_under_the_device(fake_lerobot_modules):
    config = bench.workload_config(2, 48, 10, 50, "pi0")
    state = {"model.weight": torch.ones(2, 2), "model.bias": torch.ones(2)}  # (lm_head left out, as the bench)
    policy = bench_lerobot.build_lerobot(config, state, "float32", device="cpu")
    assert policy.name == "PI0Policy" and type(policy.cfg).__name__ == "PI0Config"
    assert policy.device_at_init == torch.device("cpu") and not policy.training
    kw = policy.cfg.kw
    assert kw["dtype"] == "float32" and kw["device"] == "cpu" and kw["chunk_size"] == 50
    assert kw["n_action_steps"] == 50 and kw["num_inference_steps"] == 10 and kw["tokenizer_max_length"] == 48
    assert kw["max_state_dim"] == 32 and kw["max_action_dim"] == 32
    assert sorted(kw["input_features"]) == ["observation.images.cam0", "observation.images.cam1"]
    assert torch.equal(policy.model.weight, torch.ones(2, 2))
    pi05 = bench_lerobot.build_lerobot(config.as_kind("pi05"), state, device="cpu")
    assert pi05.name == "PI05Policy" and pi05.cfg.kw["dtype"] == "bfloat16"
    with pytest.raises(RuntimeError, match="missing"):
        bench_lerobot.build_lerobot(config, {"model.weight": torch.ones(2, 2)}, device="cpu")


# ---- the scripts and the CLI -------------------------------------------------------------------------------------
def test_bench_pi0_script_writes_pi0_files(tmp_path, monkeypatch):
    script = load_benchmark("bench_pi0")
    driver = sys.modules["bench_pi05"]
    calls = []

    def fake_bench_model(kind, **kw):
        calls.append((kind, kw))
        row = {"p50_ms": 1.0, "p90_ms": 1.0, "p99_ms": 1.0}
        return {"workload": {"model": kind, "views": kw["views"], "prompt_len": 48, "steps": 10, "chunk": 50,
                             "dtype": "bfloat16"},
                "results": {"flashrt": row}, "extra": {"parity": {"targets": {}}, "notes": []}}
    monkeypatch.setattr(driver, "bench_model", fake_bench_model)
    assert script.main(["--out-dir", str(tmp_path), "--workloads", "w2", "--skip-compile"]) == 0
    assert [c[0] for c in calls] == ["pi0"] and calls[0][1]["parity"] and calls[0][1]["engine"] == "fused"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pi0_parity.json", "pi0_w2.json"]
    assert json.loads((tmp_path / "pi0_parity.json").read_text())["workload"]["model"] == "pi0"
    assert driver.result_file("siglip32", "pi0") == "pi0_w2_siglip_fp32.json"
    assert driver.result_file("w2") == "pi05_w2.json"
    assert driver.parity_file(["views1"], "pi0") == "pi0_parity_views.json"
    assert script.main(["--out-dir", str(tmp_path), "--workloads", "w2", "--no-parity", "--skip-compile"]) == 0
    assert not calls[-1][1]["parity"]


def test_flashrt_bench_cli_takes_model_pi0(monkeypatch, tmp_path):
    import argparse

    calls = []
    monkeypatch.setattr(bench, "gpu_missing", lambda: None)  # (the command refuses a machine without a GPU)
    monkeypatch.setattr(bench, "bench_model", lambda kind, **kw: calls.append((kind, kw)) or {
        "workload": {"model": kind, "views": 2, "prompt_len": 48, "steps": 10, "chunk": 50, "dtype": "bfloat16"},
        "results": {}, "extra": {}})
    parser = argparse.ArgumentParser()
    bench.add_subparsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--model", "pi0", "--baselines", "lerobot-eager", "--json",
                              str(tmp_path / "x.json")])
    assert args.func(args) == 0
    assert calls[0][0] == "pi0" and calls[0][1]["baselines"] == ("lerobot-eager",)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--model", "pi1"])


def test_bench_pi0_with_the_fused_pi0engine_on_the_cpu(fake_lerobot):
    """The real Pi0Engine: the tiny model in fp32 on the CPU, every parity check passing and the stages
    reported."""
    run = tiny_run(engine="fused", iters=2, warmup=1)
    extra = run["extra"]
    assert extra["engine_kind"] == "fused"
    assert list(run["results"]["flashrt"]["phases_p50_ms"]) == ["set_observation", "set_state", "decision"]
    assert set(extra["stages"]) == {"observe", "act"}
    for name, p in extra["parity"].items():
        if "cosine" in p:
            assert p["pass"] and p["rel_l2"] < 1e-4, (name, p)


@pytest.mark.gpu
def test_bench_pi0_against_the_real_lerobot_at_the_tiny_fixture_sizes(fixtures_dir):
    """Where LeRobot 0.6.1 is installed (the GPU machine, from .whl/): its PI0Policy built by build_lerobot at the
    tiny fixture's sizes takes the bench's state dict without a missing key and matches the fp32 reference."""
    pytest.importorskip("lerobot.policies.pi0")
    from lerobot.policies.pi0 import modeling_pi0

    sys.path.insert(0, str(fixtures_dir.parents[1] / "scripts" / "lerobot_golden"))
    from common import tiny_model_sizes

    dims = json.loads((fixtures_dir / "lerobot_pi0_tiny" / "dims.json").read_text())
    with tiny_model_sizes(modeling_pi0, dims):
        run = tiny_run(device="cuda", engine="reference", iters=2, warmup=1)
    extra = run["extra"]
    assert "lerobot_error" not in extra, extra.get("lerobot_error")
    parity = extra["parity"]
    assert set(parity) - {"targets", "state_effect_reference_fp32"} == PARITY_KEYS
    assert parity["reference_fp32_vs_lerobot_fp32"]["rel_l2"] < 1e-4, parity["reference_fp32_vs_lerobot_fp32"]
    assert all(p["pass"] for p in parity.values() if "cosine" in p), parity
