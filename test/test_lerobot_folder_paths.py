"""One reading of a LeRobot checkpoint folder on every path: the policy API (`predict_chunk`), the contract
runtime (which the node, `flashrt run`, replay and make-bag all build through `Runtime.from_config`) and the
dry-run plan take the prompt length from the checkpoint's own tokenizer step, not from the packaged contract
(issue 47: with `max_length: 24` the runtime used the contract's 48 and accepted prompts LeRobot would cut)."""
import json
import pathlib

import numpy as np
import pytest

from flashrt_core import Runtime
from flashrt_core.errors import InputError
from flashrt_core.models import pi05
from lerobot_checkpoint import checkpoint_copy, hub_cache

REPO = pathlib.Path(__file__).resolve().parents[1]
LONG_TASK = "pick up the red cube and put it in the blue bowl next to the green one"


def short_prompt_checkpoint(tmp_path, max_length=24):
    ck = checkpoint_copy(tmp_path)
    pre = ck / "policy_preprocessor.json"
    doc = json.loads(pre.read_text())
    for step in doc["steps"]:
        if step["registry_name"] == "tokenizer_processor":
            step["config"]["max_length"] = max_length
    pre.write_text(json.dumps(doc))
    return ck


def test_the_checkpoints_prompt_length_holds_on_every_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path / "hub")))
    ck = short_prompt_checkpoint(tmp_path)
    policy = pi05.load(ck)
    assert policy.config.tokenizer_max_length == 24
    frames = [np.full((224, 224, 3), 7, np.uint8), None]
    state = np.linspace(-0.5, 0.5, policy.processors.state_dim).astype(np.float32)
    with pytest.raises(InputError, match="more than prompt_len = 24"):
        policy.predict_chunk(frames, state, LONG_TASK)
    rt = Runtime.from_config(REPO / "config" / "pi05.yaml", checkpoint=str(ck), dtype="float32")  # (says 48)
    assert rt.contract.dims["prompt_len"] == 24
    with pytest.raises(InputError, match="prompt_len"):
        rt.set_prompt(LONG_TASK)
    # a contract may pad less than the checkpoint (the same actions: pads are masked), never more
    short = Runtime.from_config(REPO / "config" / "pi05.yaml", checkpoint=str(ck), dtype="float32",
                                options={"prompt_len": 20})
    assert short.contract.dims["prompt_len"] == 20


def test_the_dry_run_says_the_checkpoints_prompt_length(tmp_path, monkeypatch):
    from flashrt_core.contract.plan import describe_run, format_run

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path / "hub")))
    ck = short_prompt_checkpoint(tmp_path)
    text = format_run(describe_run(REPO / "config" / "pi05.yaml", device="cpu", checkpoint=str(ck)))
    assert "prompt 24 tokens" in text


def test_a_config_flag_that_contradicts_the_saved_processor_step_is_said(tmp_path, monkeypatch):
    """config.json `use_relative_actions: false` beside an enabled relative_actions_processor: LeRobot runs the
    saved step, so FlashRT does too, and the plan (the dry run, doctor) and the node's set-up warnings say so."""
    from flashrt_core.lerobot.processors import read_processors
    from flashrt_core.contract.plan import describe_run, format_run

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path / "hub")))
    ck = checkpoint_copy(tmp_path)
    assert read_processors(ck).relative and not read_processors(ck).notes
    cfg = json.loads((ck / "config.json").read_text())
    cfg["use_relative_actions"] = False
    (ck / "config.json").write_text(json.dumps(cfg))
    procs = read_processors(ck)
    assert procs.relative and len(procs.notes) == 1
    assert "use_relative_actions is False" in procs.notes[0] and "the processor step decides" in procs.notes[0]
    text = format_run(describe_run(REPO / "config" / "pi05.yaml", device="cpu", checkpoint=str(ck)))
    assert "the processor step decides" in text
