"""Contract validation: every malformed case raises ContractError naming the offending field."""
import copy
import pathlib

import pytest
import yaml

from flashrt_core.contract.spec import load_contract, validate
from flashrt_core.errors import ContractError

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config"


@pytest.fixture(scope="module")
def base():
    return yaml.safe_load((CONFIG / "pi05_tiny.yaml").read_text())


def test_shipped_contracts_are_valid():
    tiny = load_contract(CONFIG / "pi05_tiny.yaml")
    assert tiny.order == ("prompt", "observe", "act")
    assert tiny.buffers["actions"].shape == (50, 7) and tiny.buffers["actions"].declared_shape == ("chunk", "action_dim")
    assert tiny.buffers["prefix_k"].shape == (2, 1, 2 * 256 + 128, 16) and tiny.buffers["prefix_k"].persistent
    assert tiny.stages["observe"].trigger.rate_hz == 10 and tiny.stages["act"].trigger.rate_hz == 50
    assert tiny.limits.max_observation_age_ms == 250 and tiny.limits.late_observe == "reuse"
    from flashrt_core.contract.spec import configured_contract

    full = configured_contract(CONFIG / "pi05.yaml", device="cuda")  # dtype auto: bfloat16 on CUDA...
    assert full.buffers["prefix_k"].shape == (18, 1, 2 * 256 + 48, 256)
    assert full.buffers["prefix_k"].dtype == "bfloat16" and full.buffers["prev_chunk"].dtype == "float32"
    assert configured_contract(CONFIG / "pi05.yaml", device="cpu").buffers["prefix_k"].dtype == "float32"  # ...fp32


def edit(data, path, value):
    """Set (or with value=DELETE remove) a dotted path in a copy of the contract."""
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return data


DELETE = object()

# (case id, dotted path edited, new value, text the message must contain)
CASES = [
    ("deferred-output", "stages.act.deferred", True, "stages.act.deferred: the stage writing the output"),
    ("deferred-not-bool", "stages.observe.deferred", "yes", "stages.observe.deferred: must be true or false"),
    ("rate-zero", "stages.act.trigger.rate_hz", 0, "stages.act.trigger.rate_hz: must be a positive number"),
    ("rate-negative", "stages.observe.trigger.rate_hz", -5, "stages.observe.trigger.rate_hz"),
    ("rate-string", "stages.act.trigger.rate_hz", "fast", "stages.act.trigger.rate_hz"),
    ("rate-inf", "stages.act.trigger.rate_hz", float("inf"), "stages.act.trigger.rate_hz"),
    ("rate-bool", "stages.act.trigger.rate_hz", True, "stages.act.trigger.rate_hz"),
    ("trigger-missing", "stages.act.trigger", DELETE, "stages.act.trigger: missing"),
    ("trigger-empty", "stages.act.trigger", {}, "stages.act.trigger: needs one of rate_hz, on_change, after"),
    ("trigger-unknown-key", "stages.act.trigger", {"rate": 50}, "stages.act.trigger.rate: unknown key"),
    ("after-unknown", "stages.act.trigger", {"after": "plan"}, "stages.act.trigger.after: unknown stage 'plan'"),
    ("after-self", "stages.act.trigger", {"after": "act"}, "stages.act.trigger.after: a stage cannot run after itself"),
    ("after-combined", "stages.act.trigger", {"after": "observe", "rate_hz": 5}, "stages.act.trigger.after: cannot"),
    ("on-change-not-read", "stages.act.trigger", {"on_change": "images"}, "stages.act.trigger.on_change"),
    ("unknown-read", "stages.act.reads", ["prefix_k", "prefix_q"], "stages.act.reads[1]: unknown buffer 'prefix_q'"),
    ("unknown-write", "stages.act.writes", ["noise", "prev_chunk", "actionz"], "stages.act.writes[2]: unknown buffer"),
    ("two-producers", "stages.act.writes", ["noise", "prev_chunk", "actions", "lang_mask"],
     "stages.act.writes: buffer 'lang_mask' is already written by stage 'observe'"),
    ("writes-input", "stages.prompt.writes", ["task", "state"], "stages.prompt.writes: 'state' is an input"),
    ("never-produced-read", "stages.observe.writes", ["lang_tokens", "lang_mask", "state_offset", "prefix_k",
                                                      "prefix_v", "prefix_mask", "action_offset"],
     "stages.act.reads: buffer 'prefix_valid' is never produced"),
    ("unknown-top-key", "stagez", {}, "stagez: unknown key"),
    ("unknown-stage-key", "stages.act.rate_hz", 50, "stages.act.rate_hz: unknown key"),
    ("unknown-buffer-key", "buffers.noise.persistent", True, "buffers.noise.persistent: unknown key"),
    ("unknown-limit-key", "limits.max_age_ms", 5, "limits.max_age_ms: unknown key"),
    ("bad-late-policy", "limits.late_observe", "skip", "limits.late_observe: must be reuse or wait"),
    ("bad-max-age", "limits.max_observation_age_ms", 0, "limits.max_observation_age_ms"),
    ("unknown-dim", "buffers.actions.shape", ["chunk", "action_dims"], "buffers.actions.shape[1]: unknown dim 'action_dims'"),
    ("shape-mismatch", "buffers.actions.shape", ["chunk", 6],
     "buffers.actions.shape: [50, 6] (from ['chunk', 6]) but model pi05 stage act writes [50, 7]"),
    ("dtype-mismatch", "buffers.prev_chunk.dtype", "float16",
     "buffers.prev_chunk.dtype: float16 but model pi05 stage act writes float32"),
    ("bad-dtype", "buffers.noise.dtype", "float8", "buffers.noise.dtype: must be one of"),
    ("bad-lifetime", "buffers.noise.lifetime", "forever", "buffers.noise.lifetime"),
    ("bad-place", "buffers.noise.place", "disk", "buffers.noise.place"),
    ("shape-not-list", "buffers.noise.shape", "chunk", "buffers.noise.shape: missing or not a list"),
    ("unknown-stage", "stages.plan", {"reads": ["actions"], "writes": ["noise"], "trigger": {"rate_hz": 1}},
     "stages.plan.writes: buffer 'noise' is already written by stage 'act'"),
    ("model-missing-stage-write", "stages.act.writes", ["noise", "rtc_weights", "rtc_shift", "rtc_clock", "actions"],
     "buffers.prev_chunk: never produced"),
    ("model-unknown", "model.name", "gpt5", "model.name: unknown model 'gpt5'"),
    ("model-option", "model.options.cameras", 3, "model.options.cameras: unknown option"),
    ("model-dtype", "model.dtype", "int8", "model.dtype"),
    ("output-missing", "output", DELETE, "output: missing"),
    ("output-unknown", "output", "chunk", "output: unknown buffer 'chunk'"),
    ("output-input", "output", "state", "output: buffer 'state' is not written by any stage"),
    ("read-own-write", "stages.act.reads", ["prefix_k", "prefix_v", "prefix_mask", "prefix_valid", "action_offset",
                                            "prev_chunk"],
     "stages.act.writes: 'prev_chunk' is also in reads"),
    ("stage-not-in-model", "stages.act", DELETE, "buffers.noise: never produced"),
    ("buffers-missing", "buffers", DELETE, "buffers: missing"),
    ("graphs-mode", "graphs", "always", "graphs: must be one of stage, plan, off"),
    ("state-dim-over-model", "model.options.state_dim", 33, "model.options.state_dim: 33 exceeds the model's max_state_dim 32"),
    ("version-other", "version", 2, "version: this flashrt reads contract version 1, got 2"),
    ("version-string", "version", "1", "version: this flashrt reads contract version 1"),
    ("rate-too-high", "stages.act.trigger.rate_hz", 1e300, "stages.act.trigger.rate_hz: must be between"),
    ("rate-too-low", "stages.observe.trigger.rate_hz", 1e-300, "stages.observe.trigger.rate_hz: must be between"),
    ("after-list", "stages.act.trigger", {"after": ["observe"]}, "stages.act.trigger.after: expected a stage name"),
    ("read-nested-list", "stages.act.reads", ["prefix_k", ["prefix_v"]],
     "stages.act.reads[1]: expected a buffer name, got ['prefix_v']"),
    ("input-never-read", "buffers.wrist_depth", {"shape": ["views"], "dtype": "uint8", "lifetime": "input"},
     "buffers.wrist_depth: an input that no stage reads"),
]


@pytest.mark.parametrize("case,path,value,message", CASES, ids=[c[0] for c in CASES])
def test_malformed_contract_names_the_field(base, case, path, value, message):
    with pytest.raises(ContractError) as e:
        validate(edit(base, path, value))
    assert message in str(e.value), str(e.value)


def test_stage_the_model_lacks(base):
    data = edit(base, "buffers.extra", {"shape": [1], "dtype": "float32", "lifetime": "transient"})
    data["stages"]["smooth"] = {"reads": ["actions"], "writes": ["extra"], "trigger": {"after": "act"}}
    with pytest.raises(ContractError, match=r"^stages.smooth: model pi05 has no stage 'smooth'"):
        validate(data)


def test_model_stage_signature_must_be_complete(base):
    # the contract's act reads less than the model's act does
    data = edit(base, "stages.act.reads", ["prefix_k", "prefix_v", "prefix_mask"])
    data = edit(data, "stages.act.trigger", {"rate_hz": 50})
    data["buffers"].pop("prefix_valid")
    data["stages"]["observe"]["writes"].remove("prefix_valid")
    with pytest.raises(ContractError) as e:
        validate(data)
    assert "stages.observe.writes: missing 'prefix_valid'" in str(e.value)


def test_cycle_names_its_stages():
    """A cycle through buffers (toy binding: signatures declared by the test itself)."""
    from flashrt_core.contract.spec import StageSignature

    class Loop:
        @staticmethod
        def dims(model):
            return {"n": 3}

        @staticmethod
        def signatures(dims, model):
            f = ((3,), "float32")
            return {"a": StageSignature({"y": f}, {"x": f}), "b": StageSignature({"x": f}, {"z": f}),
                    "c": StageSignature({"z": f}, {"y": f})}

    buf = {"shape": ["n"], "dtype": "float32", "lifetime": "transient"}
    data = {"model": {"name": "loop"}, "output": "x", "buffers": {"x": buf, "y": buf, "z": buf},
            "stages": {"a": {"reads": ["y"], "writes": ["x"], "trigger": {"rate_hz": 10}},
                       "b": {"reads": ["x"], "writes": ["z"], "trigger": {"after": "a"}},
                       "c": {"reads": ["z"], "writes": ["y"], "trigger": {"after": "b"}}}}
    with pytest.raises(ContractError, match=r"stages: cycle a -> b -> c -> a"):
        validate(data, binding=Loop)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ContractError, match="nope.yaml: cannot read"):
        load_contract(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [unclosed\n")
    with pytest.raises(ContractError, match="bad.yaml: not valid YAML"):
        load_contract(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ContractError, match="contract: expected a mapping"):
        load_contract(top)


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    """Plain YAML keeps the last of two equal keys: a second `act` stage or `limits` block would silently
    replace the first."""
    text = (CONFIG / "pi05_tiny.yaml").read_text()
    assert text.count("\nlimits:") == 1
    doubled = tmp_path / "twice.yaml"
    doubled.write_text(text + "\nlimits:\n  max_observation_age_ms: 5000\n")
    with pytest.raises(ContractError) as e:
        load_contract(doubled)
    first = text[: text.index("\nlimits:")].count("\n") + 2
    assert "twice.yaml: not valid YAML" in str(e.value) and f"key 'limits' given twice (first on line {first})" in str(e.value)
    stage = tmp_path / "stage.yaml"
    stage.write_text(text.replace("\n  act:\n", "\n  act:\n    trigger: {rate_hz: 5}\n  act:\n", 1))
    with pytest.raises(ContractError, match="key 'act' given twice"):
        load_contract(stage)
    line = tmp_path / "line.yaml"  # twice within one flow mapping, on one line
    line.write_text(text.replace("rate_hz: 50", "rate_hz: 50, rate_hz: 5", 1))
    assert "rate_hz: 50, rate_hz: 5" in line.read_text()
    with pytest.raises(ContractError, match="key 'rate_hz' given twice"):
        load_contract(line)
    load_contract(CONFIG / "pi05_tiny.yaml")  # the shipped file, unchanged, still loads


def test_a_contract_that_is_not_utf8_names_the_file(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes((CONFIG / "pi05_tiny.yaml").read_text().replace("pi0.5 tiny", "pi0.5 tin\u00e9").encode("latin-1"))
    with pytest.raises(ContractError, match=r"latin1.yaml: not UTF-8 text \(byte \d+"):
        load_contract(bad)


def test_overrides_revalidate(base):
    c = validate(base)
    c2 = c.with_overrides(rates={"act": 30}, limits={"late_observe": "wait"}, dtype="bfloat16")
    assert c2.stages["act"].trigger.rate_hz == 30 and c2.limits.late_observe == "wait"
    assert c2.buffers["prefix_k"].dtype == "bfloat16" and c.buffers["prefix_k"].dtype == "float32"
    with pytest.raises(ContractError, match="stages.act.trigger.rate_hz"):
        c.with_overrides(rates={"act": 0})
    with pytest.raises(ContractError, match="stages.plan: unknown stage in rate override"):
        c.with_overrides(rates={"plan": 3})


def test_output_stage_after_a_deferred_stage_is_refused(base):
    data = copy.deepcopy(base)
    data["stages"]["observe"]["deferred"] = True
    data["stages"]["act"]["trigger"] = {"after": "observe"}
    with pytest.raises(ContractError, match=r"^stages.act.trigger.after: the stage writing the output \(actions\) "
                                            r"cannot run after the deferred stage observe"):
        validate(data)
