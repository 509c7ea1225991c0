"""The eager FastWAM reference (flashrt_core.models.fastwam.reference) against LeRobot 0.6.1's own outputs.

The golden fixture (test/fixtures/lerobot_fastwam_tiny/) holds a random tiny checkpoint saved by LeRobot and, per
case, the encoders' outputs given to the two DiTs (UMT5 embedding, first-frame VAE latents), the normalized state,
the action noise, the video K/V cache of every layer, every Euler step's velocity and infer_action's actions (fp32,
CPU); see `fastwam_cases.py`.
"""
import pytest
import torch

from fastwam_cases import case_names, model
from flashrt_core.errors import InputError
from flashrt_core.models.fastwam import reference as R

# What each comparison allows (max abs), and why.
TOL = {
    "actions": 1e-4,  # 10 Euler steps in fp32 vs LeRobot fp32 (measured ~5e-7)
    "context": 0.0,  # prompt embedding + proprio token: the same single Linear, bit for bit
    "video_kv": 1e-5,  # the cache the action DiT reads, every layer (measured ~1e-6)
    "velocity": 1e-5,  # each Euler step's velocity, given LeRobot's own x_t of that step (measured ~7e-7)
}


@pytest.mark.parametrize("case", case_names())
def test_actions_match_lerobot(case):
    _, w, _, cases = model()
    c = cases[case]
    actions = R.sample_actions(w, *c.inputs(), c.noise)
    err = (actions - c.actions).abs().max().item()
    assert err <= TOL["actions"], f"{case}: max abs {err:.2e} vs LeRobot"


@pytest.mark.parametrize("case", case_names())
def test_context_cache_and_velocities_match_lerobot(case):
    """Where a mismatch would start: the context, the video K/V of every layer, then every step's velocity
    (step i run on the x_t LeRobot had there, rebuilt from its noise and velocities)."""
    config, w, _, cases = model()
    c = cases[case]
    ctx, mask = R.build_context(w, c.text_emb, c.state)
    assert (ctx - c.tensors["context"]).abs().max().item() <= TOL["context"]
    assert mask.all() and ctx.shape[1] == config.context_tokens
    cache = R.prefill(w, *c.inputs())
    assert cache.k.shape[3] == config.video_tokens == c.tensors["video_k.0"].shape[1]
    for li in range(config.video.layers):
        for ours, name in ((cache.k[li], "video_k"), (cache.v[li], "video_v")):
            err = (R.merge(ours) - c.tensors[f"{name}.{li}"]).abs().max().item()
            assert err <= TOL["video_kv"], f"{name} layer {li}: {err:.2e}"
    assert torch.equal(w.timesteps, c.tensors["timesteps"])
    x = c.noise
    for i, theirs in enumerate(c.tensors["velocity"]):
        err = (R.velocity(w, cache, x, i) - theirs).abs().max().item()
        assert err <= TOL["velocity"], f"velocity of step {i}: {err:.2e}"
        x = x + theirs * w.deltas[i]
    assert (x - c.actions).abs().max().item() <= TOL["actions"]  # the schedule's deltas are LeRobot's


def test_attention_mask_is_lerobots():
    """The joint [video | action] mask LeRobot built, against ours (video rows: prefill; action rows: velocity)."""
    config, _, _, cases = model()
    c = next(iter(cases.values()))
    theirs = c.tensors["attention_mask"]
    n = config.video_tokens
    assert torch.equal(theirs[:n, :n], R.video_self_allowed(config.video_grid[1] * config.video_grid[2], n))
    assert theirs[n:, :].all()  # one observed frame: an action sees every video token and every action


def test_every_input_moves_the_actions():
    """Random, non-zero inputs: the latents, the prompt, the state and the noise each reach the actions. (Not the
    order of the context rows: cross-attention has no positions, so a rolled prompt embedding is the same context.)"""
    _, w, _, cases = model()
    c, other = list(cases.values())[:2]
    base = R.sample_actions(w, *c.inputs(), c.noise)
    lat, text, state = c.inputs()
    assert (R.sample_actions(w, lat, text.roll(1, 1), state, c.noise) - base).abs().max().item() <= TOL["velocity"]
    for changed in ((lat.flip(-1), text, state), (lat, other.text_emb, state), (lat, text, state + 0.5)):
        assert (R.sample_actions(w, *changed, c.noise) - base).abs().max().item() > 1e-3
    assert (R.sample_actions(w, *c.inputs(), c.noise.flip(1)) - base).abs().max().item() > 1e-3


def test_staged_api_batches_and_checks_inputs():
    """prefill + denoise is sample_actions; two cases batched give each its own actions; bad inputs are refused
    by name."""
    config, w, _, cases = model()
    a, b = list(cases.values())[:2]
    cache = R.prefill(w, *a.inputs())
    assert torch.equal(R.denoise(w, cache, a.noise), R.sample_actions(w, *a.inputs(), a.noise))
    both = R.sample_actions(w, *(torch.cat(p) for p in zip(a.inputs(), b.inputs())), torch.cat([a.noise, b.noise]))
    assert (both - torch.cat([a.actions, b.actions])).abs().max().item() <= TOL["actions"]
    lat, text, state = a.inputs()
    for bad, field in (((lat[:, :8], text, state), "video_latents"), ((lat, text[..., :5], state), "text_emb"),
                       ((lat, text, state[:, :3]), "state"), ((lat, text, None), "state")):
        with pytest.raises(InputError, match=field):
            R.prefill(w, *bad)
    with pytest.raises(InputError, match="noise"):
        R.denoise(w, cache, a.noise[..., :3])
