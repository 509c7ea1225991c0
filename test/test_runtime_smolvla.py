"""SmolVLA through the contract runtime (config/smolvla.yaml, as the node and replay run it) on a checkpoint folder
exactly as LeRobot 0.6.1 saves it: the same actions as the policy API (`predict_chunk`, itself checked against
LeRobot's whole pipeline in test_smolvla_policy.py) for the same frames, state, task and noise; the
checkpoint's processors decide the prompt length, the image padding convention and the widths."""
import pathlib

import numpy as np
import pytest
import torch

from flashrt_core import Runtime
from flashrt_core.contract.bindings import image_pad
from flashrt_core.errors import ContractError
from flashrt_core.models.smolvla import policy as smolvla_policy
from smolvla_cases import FIXTURES, model

REPO = pathlib.Path(__file__).resolve().parents[1]
FOLDER = FIXTURES / "lerobot_smolvla_three_cams"
PERIOD = 20_000_000  # ns: act at 50 Hz
TOL = 1e-4  # robot units (up to ~250): the same fp32 math in two orders of operations


def runtime(seed=0, deferred=None, **options):
    return Runtime.from_config(REPO / "config" / "smolvla.yaml", checkpoint=str(FOLDER / "checkpoint"), device="cpu",
                               seed=seed, deferred=deferred, options={"vlm": str(FOLDER / "hf_vlm"), "image_height": 96,
                                                   "image_width": 96, **options})


def test_the_runtime_makes_the_policy_apis_actions():
    rt = runtime(seed=5, deferred={"observe": False})  # (deferred, act reads the previous tick's prefix)
    policy = smolvla_policy.load(FOLDER / "checkpoint", vlm=FOLDER / "hf_vlm", engine="reference", dtype="float32")
    case = model("lerobot_smolvla_three_cams")[3]["three_96x96"]
    frames = [case.tensors[f"frame.{n}"].numpy() for n in ("top", "wrist", "side")]
    task = "pick up the red cube"
    assert rt.contract.dims["prompt_len"] == 24 == policy.config.tokenizer_max_length  # the checkpoint's
    assert rt.binding.engine_name == "reference" and image_pad(rt.contract.model) == "top_left"
    rt.set_prompt(task)
    noise = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(0)
    outs = []
    for k in range(3):
        state = case.tensors["state_raw"][0].numpy() + rng.normal(0, 0.1, 8).astype(np.float32) * k
        rt.set_observation(images=frames, state=state, stamp_ns=1 + k * 5 * PERIOD)
        r = rt.step(1 + k * 5 * PERIOD)
        assert "observe" in r.ran and "act" in r.ran
        draw = torch.randn(50, 32, generator=noise)[None]
        want = policy.predict_chunk(frames, state, task, noise=draw)
        np.testing.assert_allclose(r.actions, want, atol=TOL, rtol=0)
        outs.append(r.actions)
    assert np.abs(outs[1] - outs[2]).max() > 1e-3  # the state is read by observe: a new state, new actions


def test_the_contract_refuses_what_the_checkpoint_contradicts():
    with pytest.raises(ContractError, match="action_dim: 6 .* config.json says 7"):
        runtime(action_dim=6)
    with pytest.raises(ContractError, match="needs a checkpoint"):
        Runtime.from_config(REPO / "config" / "smolvla.yaml")
    with pytest.raises(ContractError, match="is a smolvla checkpoint"):
        Runtime.from_config(REPO / "config" / "pi05.yaml", checkpoint=str(FOLDER / "checkpoint"))


def test_capsules_snapshot_restore_and_fork_smolvla_state(tmp_path):
    """A SmolVLA runtime's persistent state (its prefix K/V of every expert layer, the masks, the previous
    chunk) is snapshotted, forked, exported and restored like pi0.5's: a restored or imported branch continues
    exactly like the undisturbed run from the same ticks."""
    case = model("lerobot_smolvla_three_cams")[3]["three_96x96"]
    frames = [case.tensors[f"frame.{n}"].numpy() for n in ("top", "wrist", "side")]
    rng = np.random.default_rng(3)
    states = [case.tensors["state_raw"][0].numpy() + rng.normal(0, 0.2, 8).astype(np.float32) for _ in range(6)]

    def ticks(rt, ks):
        out = []
        for k in ks:
            rt.set_observation(images=frames, state=states[k], stamp_ns=1 + k * PERIOD)
            out.append(rt.step(1 + k * PERIOD).actions)
        return out

    def fresh():
        rt = runtime(seed=2)
        rt.set_prompt("pick up the red cube")
        return rt

    reference = ticks(fresh(), range(6))
    rt = fresh()
    ticks(rt, range(3))
    cid = rt.snapshot("after_3", tier="device")
    branch = rt.fork(cid, name="branch")
    rt.export_capsule(branch, tmp_path / "branch")
    for name, t in rt.persistent_buffers().items():  # disturb every persistent buffer, the RNG and the clocks
        t.copy_(torch.full_like(t, 3) if not t.dtype.is_floating_point else torch.randn_like(t))
    rt.generator.manual_seed(11)
    rt.step(1 + 2 * PERIOD + PERIOD // 2)
    rt.restore(cid)
    for got, want in zip(ticks(rt, range(3, 6)), reference[3:]):
        assert np.array_equal(got, want)
    other = fresh()
    ticks(other, [0, 1, 2])
    other.restore(other.import_capsule(tmp_path / "branch", tier="device"))
    for got, want in zip(ticks(other, range(3, 6)), reference[3:]):
        assert np.array_equal(got, want)
