"""pi0 through the contract runtime (config/pi0.yaml) on the tiny LeRobot pi0 checkpoint: act reads the
state every tick over the cached prefix, and every chunk equals the reference model's for the same inputs."""
import pathlib

import numpy as np
import pytest
import torch

from flashrt_core import Runtime
from flashrt_core.errors import ContractError
from flashrt_core.models import pi0

REPO = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-5  # the same fp32 model on the same inputs (the runtime's buffers vs the policy API)
PERIOD = 20_000_000  # 50 Hz act; observe at 10 Hz runs every 5th tick (deferred)


@pytest.fixture
def pi0_ckpt(model_ckpt):
    return model_ckpt["pi0"]


def _runtime_and_policy(ckpt, seed: int, rng):
    """config/pi0.yaml's runtime (prompt set) and the policy API on the same checkpoint, two camera frames, the
    policy's prefix over them, and a generator drawing the runtime's noise (one draw per act tick)."""
    rt = Runtime.from_config(REPO / "config" / "pi0.yaml", checkpoint=str(ckpt), device="cpu", num_cameras=2,
                             seed=seed)
    policy = pi0.load(ckpt)
    frames = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    rt.set_prompt("stack the cups")
    images, masks = policy.preprocess_images(frames + [None])
    tokens, mask = policy.tokenize("stack the cups")
    prefix = policy.encode_prefix(images, masks, tokens, mask)
    return rt, policy, frames, prefix, torch.Generator().manual_seed(seed)


def test_act_reads_fresh_state_over_the_cached_prefix(pi0_ckpt):
    rng = np.random.default_rng(1)
    rt, policy, frames, prefix, noise = _runtime_and_policy(pi0_ckpt, 3, rng)
    assert rt.binding.engine_name == "reference" and rt.contract.buffers["act_state"].shape == (32,)
    outs = []
    for k in range(4):
        state = rng.uniform(-1, 1, 8).astype(np.float32)
        rt.set_observation(images=frames, state=state, stamp_ns=1 + k * PERIOD)
        r = rt.step(1 + k * PERIOD)
        assert r.ran == (["prompt", "observe", "act"] if k == 0 else ["act"])
        draw = torch.randn(50, 32, generator=noise)[None]
        want = policy.denoise(prefix, torch.from_numpy(state)[None], draw)[0, :, :7].numpy()
        np.testing.assert_allclose(r.actions, want, atol=TOL, rtol=0)
        outs.append(r.actions)
    assert np.abs(outs[1] - outs[2]).max() > 1e-3  # another state (and noise) at every act tick


def test_act_runs_every_period_over_the_last_state_of_a_slower_driver(pi0_ckpt):
    """A joint driver at a third of the act rate: act still makes a chunk every period (new noise, the state it
    last got, as long as the observation is young enough), not only when a new state came."""
    rng = np.random.default_rng(2)
    rt, policy, frames, prefix, noise = _runtime_and_policy(pi0_ckpt, 4, rng)
    outs = []
    for k in range(7):
        if k % 3 == 0:
            state = rng.uniform(-1, 1, 8).astype(np.float32)
            rt.set_observation(images=frames, state=state, stamp_ns=1 + k * PERIOD)
        r = rt.step(1 + k * PERIOD)
        assert r.actions is not None and "act" in r.ran, (k, r.reason, r.skipped)
        draw = torch.randn(50, 32, generator=noise)[None]
        want = policy.denoise(prefix, torch.from_numpy(state)[None], draw)[0, :, :7].numpy()
        np.testing.assert_allclose(r.actions, want, atol=TOL, rtol=0)
        outs.append(r.actions)
    assert np.abs(outs[1] - outs[2]).max() > 1e-3  # the same state, another noise draw


def test_pi0_contract_needs_a_pi0_checkpoint(fixtures_dir, pi0_ckpt):
    with pytest.raises(ContractError, match="needs a checkpoint"):
        Runtime.from_config(REPO / "config" / "pi0.yaml")
    with pytest.raises(ContractError, match="is a pi0 checkpoint"):
        Runtime.from_config(REPO / "config" / "pi05.yaml", checkpoint=str(pi0_ckpt), dtype="float32")
    with pytest.raises(ContractError, match="not available for pi0"):
        Runtime.from_config(REPO / "config" / "pi0.yaml", checkpoint=str(pi0_ckpt), options={"engine": "turbo"})


def drive(rt, seed: int, ticks: int, period: int = PERIOD):
    """Two cameras and a new state every tick (act reads it), observe every 5th tick: the StepResults."""
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    rt.set_prompt("stack the cups")
    out = []
    for k in range(ticks):
        if k % 5 == 0:
            frames = [np.roll(f, 7, axis=1) for f in frames]
        rt.set_observation(images=frames, state=rng.uniform(-1, 1, 8).astype(np.float32), stamp_ns=1 + k * period)
        out.append(rt.step(1 + k * period))
    return out


def test_the_fused_engine_through_the_contract_matches_the_reference_engine(pi0_ckpt):
    """engine: fused (pi0.5's stage hooks with pi0's act inputs: the state and the noise into the engine's
    buffers) gives the reference engine's chunks tick for tick, the state read at every act tick."""
    out = {}
    for engine in ("reference", "fused"):
        rt = Runtime.from_config(REPO / "config" / "pi0.yaml", checkpoint=str(pi0_ckpt), device="cpu",
                                 num_cameras=2, seed=4, options={"engine": engine})
        assert rt.binding.engine_name == engine
        out[engine] = drive(rt, seed=2, ticks=7)
    assert [r.ran for r in out["fused"]] == [r.ran for r in out["reference"]]
    assert all(r.actions is not None for r in out["fused"])
    for ref, fused in zip(out["reference"], out["fused"]):
        np.testing.assert_allclose(fused.actions, ref.actions, atol=TOL, rtol=0)
    assert np.abs(out["fused"][1].actions - out["fused"][2].actions).max() > 1e-3


@pytest.mark.gpu
def test_fused_pi0_on_cuda_with_deferred_observe_matches_the_reference_engine(pi0_ckpt):
    """config/pi0.yaml as shipped on CUDA (engine auto: fused, graphs per stage with their hooks, observe
    deferred behind act) in float32 against the reference engine inline: equal from the tick after each
    observe (a deferred observe's prefix counts from the next tick)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = {}
    for engine, deferred in (("reference", False), ("auto", True)):
        rt = Runtime.from_config(REPO / "config" / "pi0.yaml", checkpoint=str(pi0_ckpt), device="cuda",
                                 dtype="float32", num_cameras=2, seed=4, options={"engine": engine},
                                 deferred={"observe": deferred}, max_observation_age_ms=1000.0)
        rt.warmup(freeze_gc=False)
        out[engine] = drive(rt, seed=2, ticks=12)
        if engine == "auto":
            assert rt.binding.engine_name == "fused" and rt.binding.policy.engine.hook_capture_errors == {}
    for k, (ref, fused) in enumerate(zip(out["reference"], out["auto"])):
        if k % 5 == 0 and k > 0:
            continue  # (the deferred observe tick acts on the previous prefix)
        np.testing.assert_allclose(fused.actions, ref.actions, atol=2e-3, rtol=0, err_msg=f"tick {k}")


def test_the_node_loader_picks_the_contract_from_the_checkpoint_type(pi0_ckpt):
    from flashrt_ros.runtime_loader import checkpoint_contract

    assert checkpoint_contract(str(pi0_ckpt)) == "pi0.yaml"
    assert checkpoint_contract(str(REPO / "test" / "fixtures" / "lerobot_pi05_tiny")) == "pi05.yaml"
