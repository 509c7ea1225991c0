"""benchmarks/bench_smolvla.py without a GPU and without LeRobot: the workload (full-size sizes, the published VLM
config LeRobot reads, the random state dict), the bytes / FLOPs / floors table, and the whole script on the CPU at
tiny sizes with FlashRT's engine (torch kernels, no graphs) and a stand-in for LeRobot's SmolVLAPolicy computing
the project's fp32 reference. The real LeRobot run on the CPU: `PYTHONPATH=$PWD ~/.cache/lerobot-py311/bin/python
benchmarks/bench_smolvla.py --tiny --device cpu --out-dir /tmp/b` (and `--keys-only` for the full-size state dict)."""
import dataclasses
import json
import types

import pytest
import torch

from benchmark_loading import load_benchmark
from flashrt_core.models.smolvla import SmolVLAConfig, convert, expected_keys
from flashrt_core.models.smolvla import reference as R
from flashrt_core.models.smolvla.weights import UNUSED

B = load_benchmark("bench_smolvla")
TINY_ARGS = ["--tiny", "--device", "cpu", "--iters", "2", "--warmup", "1"]
SYSTEMS = ["flashrt", "flashrt-act-only", "flashrt-observe", "flashrt-act", "lerobot-eager", "lerobot-compile"]


# ---- the workload ----------------------------------------------------------------------------------------------
def test_w2_is_the_full_size_smolvla_with_two_512px_views_and_a_48_token_prompt():
    c = B.workload_config()
    full = SmolVLAConfig.full_size()
    assert dataclasses.replace(c, num_image_slots=3) == full  # only the views differ from smolvla_base's three
    assert (c.num_image_slots, c.image_size, c.tokenizer_max_length, c.num_steps, c.chunk_size) == (2, 512, 48, 10, 50)
    assert c.image_tokens == 64 and c.prefix_len == 2 * 64 + 48 + 1
    assert (c.vision.hidden, c.vlm.width, c.vlm.depth, c.expert.width, c.expert.mlp, c.vocab_size) == \
        (768, 960, 16, 720, 2048, 49280)


@pytest.mark.parametrize("tiny", [False, True])
def test_the_vlm_config_lerobot_reads_gives_the_workload_sizes(tiny):
    config = B.workload_config(tiny)
    B.check_sizes(config, tiny)  # SmolVLAConfig.from_lerobot over the VLM config and LeRobot's options
    vlm = B.vlm_config_dict(config, tiny)
    assert vlm["text_config"]["vocab_size"] == config.vocab_size
    if not tiny:  # the published numbers (hub config.json of SmolVLM2-500M-Video-Instruct)
        t, v = vlm["text_config"], vlm["vision_config"]
        assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
                t["head_dim"], t["intermediate_size"]) == (960, 32, 15, 5, 64, 2560)
        assert (v["hidden_size"], v["image_size"], v["patch_size"], v["num_attention_heads"]) == (768, 512, 16, 12)
        assert (vlm["scale_factor"], vlm["image_token_id"]) == (4, 49190)


def test_a_vlm_config_with_other_sizes_is_refused(monkeypatch):
    bad = json.loads(json.dumps(B.FULL_VLM_CONFIG))
    bad["text_config"]["intermediate_size"] = 2048
    monkeypatch.setattr(B, "FULL_VLM_CONFIG", bad)
    with pytest.raises(RuntimeError, match="other sizes"):
        B.check_sizes(B.workload_config())


def test_random_state_has_lerobots_keys_norms_near_one_and_the_rest_normal_002():
    config = B.workload_config(tiny=True)
    sd = B.random_state(config, 0, "cpu")
    assert set(sd) == set(expected_keys(config)) | set(UNUSED)
    assert all(tuple(sd[k].shape) == s for k, s in B.state_shapes(config).items())
    norms = [k for k in sd if B.is_norm_weight(k)]
    # per vision layer 2 LayerNorms + post LayerNorm; per Llama layer 2 RMSNorms; the text and expert final norms
    assert len(norms) == 2 * config.vision.layers + 1 + 2 * (config.vlm.depth + config.expert.depth) + 2
    assert all(abs(float(sd[k].mean()) - 1.0) < 0.02 for k in norms)
    rest = torch.cat([sd[k].flatten() for k in sd if k not in norms])
    assert abs(float(rest.std()) - 0.02) < 1e-3 and abs(float(rest.mean())) < 1e-3
    plain = B.random_state(config, 0, "cpu", norm_init="normal")
    assert all(abs(float(plain[k].mean())) < 0.05 for k in norms)
    assert torch.equal(plain[B.LM_HEAD], sd[B.LM_HEAD])  # same draw, only the norms shifted
    convert(config, sd)  # the engine reads it (the two unused tensors are allowed)


def test_inputs_mask_the_end_of_the_prompt():
    config = B.workload_config(tiny=True)
    x = B.random_inputs(config, 0, "cpu")
    assert list(x) == list(B.OBSERVATION) + ["noise"]
    assert int(x["lang_mask"].sum()) == 14 and bool(x["lang_mask"][0, :14].all())
    assert float(x["images"].min()) >= -1 and float(x["images"].max()) <= 1
    assert int(B.random_inputs(B.workload_config(), 0, "cpu", valid_tokens=30)["lang_mask"].sum()) == 30
    with pytest.raises(ValueError):
        B.random_inputs(config, 0, "cpu", valid_tokens=0)


# ---- bytes, FLOPs, floors --------------------------------------------------------------------------------------
def test_stage_parts_count_the_full_size_weights():
    parts = {p["part"].split(" ")[0]: p for p in B.stage_parts(B.workload_config())}
    assert parts["siglip"]["weights"] == 3 * 16 * 16 * 768 + 12 * (4 * 768 ** 2 + 2 * 768 * 3072)
    assert parts["connector"]["weights"] == 768 * 16 * 960
    vlm_layer = 960 * 25 * 64 + 960 * 960 + 3 * 960 * 2560
    assert parts["vlm"]["weights"] == 16 * vlm_layer - (960 * 960 + 3 * 960 * 2560) + 32 * 960
    expert = 8 * 720 * 25 * 64 + 8 * 720 * 960 + 16 * (960 * 720 + 3 * 720 * 2048)
    assert parts["expert"]["weights"] == expert == 96_583_680
    kv = 16 * 2 * 177 * 320
    assert parts["expert"]["bytes"] == 10 * 2 * (expert + kv)
    assert parts["siglip"]["flops"] == 2 * parts["siglip"]["flops_per_view"]


def test_floors_on_each_device_are_the_slower_of_bandwidth_and_compute():
    roof = B.stage_floors(B.workload_config())
    assert set(roof["floors"]) == {"thor", "orin", "h100", "h200"}
    act = roof["stages"]["act"]
    for key, dev in B.DEVICES.items():
        f = roof["floors"][key]
        assert f["act"]["memory_ms"] == pytest.approx(act["bytes"] / dev["gbps"] / 1e6)
        assert f["act"]["floor_ms"] == max(f["act"]["memory_ms"], f["act"]["compute_ms"])
        assert f["decision"]["floor_ms"] == pytest.approx(f["observe"]["floor_ms"] + f["act"]["floor_ms"])
    assert B.DEVICES["thor"]["gbps"] == 273.0 and B.DEVICES["orin"]["gbps"] == 204.8
    assert roof["floors"]["thor"]["act"]["bound"] == "memory"  # 10 passes over the expert's ~0.19 GB


@pytest.mark.parametrize("name,short", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA GH200 480GB", "gh200"), ("cpu", "cpu")])
def test_result_file_is_named_by_the_gpu(name, short):
    assert B.gpu_short(name) == short
    assert B.result_name(name) == f"smolvla_w2_{short}.json"
    assert B.result_name(name, tiny=True) == f"smolvla_tiny_{short}.json"


# ---- the script on the CPU, LeRobot replaced ------------------------------------------------------------------
class FakeSmolVLAPolicy:
    """LeRobot's SmolVLAPolicy as the bench calls it: `model.sample_actions(images list, masks list, lang_tokens,
    lang_masks, state, noise=)`, here the project's fp32 reference on the same state dict."""

    built: list = []

    def __init__(self, config, state, dtype):
        self.weights = convert(config, state)
        self.model = types.SimpleNamespace(sample_actions=self.sample_actions)
        FakeSmolVLAPolicy.built.append(dtype)

    def sample_actions(self, images, img_masks, lang_tokens, lang_masks, state, noise=None):
        assert isinstance(images, list) and len(images) == len(img_masks) and noise is not None
        with torch.no_grad():
            return R.sample_actions(self.weights, torch.stack(images, 1), torch.stack(img_masks, 1), lang_tokens,
                                    lang_masks, state, noise)


@pytest.fixture
def fake_lerobot(monkeypatch):
    FakeSmolVLAPolicy.built = []

    def build(config, state, dtype="bfloat16", device="cuda", tiny=False):
        assert device == "cpu" and tiny
        return FakeSmolVLAPolicy(config, state, dtype), {"dtype": dtype, "missing_keys": [], "unexpected_keys": [],
                                                         "param_dtypes": ["float32"], "build_s": 0.0}
    monkeypatch.setattr(B, "build_lerobot_smolvla", build)
    return FakeSmolVLAPolicy


def run_tiny(tmp_path, *extra):
    lines = []
    doc = B.main(TINY_ARGS + ["--out-dir", str(tmp_path)] + list(extra), log=lines.append)
    return doc, lines


def test_the_tiny_run_times_every_system_checks_parity_and_prints_the_table_last(tmp_path, fake_lerobot):
    doc, lines = run_tiny(tmp_path)
    assert doc["phases_done"] == ["flashrt", "reference_fp32", "lerobot", "lerobot_fp32"] and "errors" not in doc
    assert B.exit_code(doc) == 0
    assert list(doc["results"]) == SYSTEMS
    for name in SYSTEMS[:5]:
        r = doc["results"][name]
        assert r["p50_ms"] > 0 and r["iters"] == 2 and r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"], name
    assert "skipped" in doc["results"]["lerobot-compile"]
    assert doc["engine"]["options"] == {"backend": "torch", "graphs": False, "gemm": "torch"}
    assert list(doc["results"]["flashrt"]["phases_p50_ms"]) == ["set_observation", "decision"]
    p = doc["parity"]
    gated = ["flashrt_vs_reference_fp32", "flashrt_vs_lerobot", "reference_fp32_vs_lerobot",
             "flashrt_vs_lerobot_fp32", "reference_fp32_vs_lerobot_fp32"]
    for name in gated:  # bf16 engine against fp32 (the stand-in is the reference): the bf16 targets
        assert p[name]["pass"] and p[name]["cosine"] > 0.999, (name, p[name])
    for name in gated[1:]:  # beside each comparison with LeRobot: its model part, reported, not a gate
        assert p[name + "_model_part"]["gate"] is False and "rel_l2" in p[name + "_model_part"]
    assert p["reference_fp32_vs_lerobot"]["rel_l2"] < 1e-6  # (the stand-in computes the reference itself)
    assert 0 < p["model_share_reference_fp32"]["value"] < 1
    assert fake_lerobot.built == ["bfloat16", "float32"]
    t = doc["targets"]
    assert (t["decision_p50_ms_max"], t["act_only_p50_ms_max"], t["speedup_vs_compile_min"]) == (5.0, 3.5, 4.0)
    assert t["met"]["parity_vs_lerobot"] is True and t["met"]["speedup_vs_compile"] is None
    assert t["decision_p50_ms"] == doc["results"]["flashrt"]["p50_ms"]
    assert doc["results"]["lerobot-eager"]["flashrt_speedup"] == pytest.approx(
        doc["results"]["lerobot-eager"]["p50_ms"] / doc["results"]["flashrt"]["p50_ms"])
    # the file: what main returned, GPU, commit, date, workload
    saved = json.loads((tmp_path / "smolvla_tiny_cpu.json").read_text())
    assert saved["gpu"] == "cpu" and saved["commit"] and saved["date"] and saved["gpu_short"] == "cpu"
    assert saved["workload"]["valid_prompt_tokens"] == 14 and saved["workload"]["tiny"] is True
    assert saved["results"]["flashrt"]["p50_ms"] == doc["results"]["flashrt"]["p50_ms"]
    assert set(saved["roofline"]["floors"]) == {"thor", "orin", "h100", "h200"}
    # the table is printed last: systems, parity, then the targets line
    assert lines[-1].startswith("target whole decision p50 <= 5.0 ms")
    assert any(x.startswith("flashrt ") for x in lines) and any("Jetson AGX Thor" in x for x in lines)
    assert sum(x.startswith("parity ") and x.endswith("PASS") for x in lines) == len(gated)


def test_the_json_is_rewritten_after_every_phase_and_a_failed_phase_is_reported(tmp_path, fake_lerobot, monkeypatch):
    seen = []
    write = B.write

    def recording_write(doc, args):
        path = write(doc, args)
        seen.append(json.loads(path.read_text()))
        return path
    monkeypatch.setattr(B, "write", recording_write)

    def no_fp32(*args, **kwargs):
        raise RuntimeError("no float32 LeRobot here")
    monkeypatch.setattr(B, "run_lerobot_fp32", no_fp32)
    doc, lines = run_tiny(tmp_path)
    assert [s["phases_done"] for s in seen] == [["flashrt"], ["flashrt", "reference_fp32"],
                                                ["flashrt", "reference_fp32", "lerobot"],
                                                ["flashrt", "reference_fp32", "lerobot"]]
    assert "lerobot-eager" not in seen[0]["results"] and "p50_ms" in seen[0]["results"]["flashrt"]
    assert doc["errors"] == {"lerobot_fp32": "RuntimeError: no float32 LeRobot here"}
    assert B.exit_code(doc) == 1 and "p50_ms" in doc["results"]["lerobot-eager"]
    assert any("lerobot_fp32 failed" in x for x in lines)


def test_a_failed_lerobot_build_leaves_the_flashrt_numbers(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("LeRobot SmolVLA state dict mismatch: 1 missing ['x']")
    monkeypatch.setattr(B, "build_lerobot_smolvla", broken)
    doc, _ = run_tiny(tmp_path)
    assert doc["phases_done"] == ["flashrt", "reference_fp32"] and "lerobot" in doc["errors"]
    assert "mismatch" in doc["results"]["lerobot-eager"]["error"]
    assert doc["results"]["flashrt"]["p50_ms"] > 0 and doc["parity"]["flashrt_vs_reference_fp32"]["pass"]


def test_skip_lerobot_runs_flashrt_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "build_lerobot_smolvla", None)  # (never called)
    doc, _ = run_tiny(tmp_path, "--skip-lerobot")
    assert doc["phases_done"] == ["flashrt", "reference_fp32"] and B.exit_code(doc) == 0
    assert list(doc["results"]) == SYSTEMS[:4]


def test_the_compile_phase_says_it_began_before_compiling(tmp_path, monkeypatch):
    """A timeout kills the process while inductor compiles: the file written before then says so."""
    written = []
    monkeypatch.setattr(B, "write", lambda doc, args: written.append(json.loads(json.dumps(doc, default=str))))
    calls = []

    def fake_compiled(policy, inputs, mode, warmup, iters, log):
        calls.append((policy, mode, warmup, iters))
        return {"p50_ms": 40.0, "p90_ms": 41.0, "p99_ms": 42.0, "compile_s": 100.0, "compile_mode": mode}
    monkeypatch.setattr(B, "bench_compiled", fake_compiled)
    args = B.parse_args(TINY_ARGS + ["--out-dir", str(tmp_path)])
    doc = {"results": {"flashrt": {"p50_ms": 4.0}}, "notes": [], "parity": {}}
    B.run_compile(doc, {}, args, lambda *a: None, {"lerobot": "policy"})
    assert "not finished" in written[0]["results"]["lerobot-compile"]["error"]
    assert calls == [("policy", "default", 1, 2)] and doc["results"]["lerobot-compile"]["p50_ms"] == 40.0
    B.speedups_and_targets(doc)
    assert doc["results"]["lerobot-compile"]["flashrt_speedup"] == 10.0
    assert doc["targets"]["met"]["speedup_vs_compile"] is True and doc["targets"]["met"]["act_only"] is None


# ---- the LeRobot builder's checks (LeRobot's policy replaced) -------------------------------------------------
class FakePolicy(torch.nn.Module):
    def __init__(self, missing=(), unexpected=()):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.vlm_with_expert = torch.nn.Linear(2, 2)
        self.model.state_proj = torch.nn.Linear(2, 2)
        self.result = (list(missing), list(unexpected))
        self.loaded = None

    def load_state_dict(self, state, strict=True):
        self.loaded = (state, strict)
        return self.result


@pytest.mark.parametrize("missing,unexpected,ok", [
    ((), (), True), (tuple(UNUSED), (), True), (("model.state_proj.weight",), (), False), ((), ("extra",), False)])
def test_build_lerobot_copies_by_name_and_fails_on_keys_that_matter(monkeypatch, missing, unexpected, ok):
    policy = FakePolicy(missing, unexpected)
    monkeypatch.setattr(B, "make_lerobot_policy", lambda config, device, tiny=False: (policy, {"sizes": {}}))
    state = {"k": torch.zeros(1)}
    if not ok:
        with pytest.raises(RuntimeError, match="state dict mismatch"):
            B.build_lerobot_smolvla(B.TINY, state, "bfloat16", "cpu", True)
        return
    built, info = B.build_lerobot_smolvla(B.TINY, state, "bfloat16", "cpu", True)
    assert built is policy and policy.loaded == (state, False) and info["missing_keys"] == list(missing)
    # bf16: the VLM and the expert in bf16, the projections stay fp32 (as LeRobot builds it over a bf16 VLM)
    assert policy.model.vlm_with_expert.weight.dtype == torch.bfloat16
    assert policy.model.state_proj.weight.dtype == torch.float32
    assert info["param_dtypes"] == ["bfloat16", "float32"]
    with pytest.raises(ValueError):
        B.build_lerobot_smolvla(B.TINY, state, "float16", "cpu", True)
