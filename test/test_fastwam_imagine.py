"""The imagined future (LeRobot 0.6.1 `FastWAM.infer_joint`'s video path) of the eager FastWAM reference:
`reference.imagine` (video latents) and `encoders.decode_frames` (the Wan VAE decoder, uint8 frames), against the
`joint.*` goldens of the fixture's one case that holds them (the video noise LeRobot drew, its denoised latents,
its decoded frames and its joint actions)."""
import pytest
import torch

from fastwam_cases import folder, model
from flashrt_core.errors import InputError
from flashrt_core.models.fastwam import reference as R

# What each comparison allows, and why.
TOL = {
    "latents": 1e-4,  # max abs: 10 Euler steps of the video DiT in fp32, same op order (measured 0.0)
    "frames_level": 1,  # max abs uint8 level: the decoder's fp32 output is truncated, so a value within ~1e-6 of
                        # an integer boundary may land one level off (measured 1, on 1 pixel, from LeRobot's
                        # own latents too)
    "frames_fraction": 1e-3,  # share of uint8 values that may differ at all (measured 1 of 122,880)
    "actions": 2e-6,  # max abs, infer_joint's actions vs denoise's (LeRobot's own gap is 3e-7; measured 4.8e-7)
}


def joint_case():
    _, w, _, cases = model()
    with_joint = [c for c in cases.values() if "joint.video_noise" in c.tensors]
    assert with_joint, "the fixture has no case with infer_joint's outputs (joint.*)"
    return w, with_joint[0]


def test_imagined_latents_match_lerobot():
    w, c = joint_case()
    noise, theirs = c.tensors["joint.video_noise"], c.tensors["joint.video_latents"]
    ours = R.imagine(w, *c.inputs(), noise)
    assert ours.shape == theirs.shape
    err = (ours - theirs).abs().max().item()
    assert err <= TOL["latents"], f"imagined latents: max abs {err:.2e} vs LeRobot"
    assert torch.equal(ours[:, :, :1], c.first_frame_latents)  # frame 0 is the observation's, exactly
    assert (ours[:, :, 1:] - noise[:, :, 1:]).abs().max().item() > 0.1  # the future was denoised, not copied
    # the schedule matters: another shift gives other latents
    assert (R.imagine(w, *c.inputs(), noise, shift=3.0) - theirs).abs().max().item() > 1e-3


def test_joint_actions_are_denoises():
    """The actions in infer_joint attend only to the clean first frame: they are `denoise`'s over the prefill."""
    w, c = joint_case()
    actions = R.denoise(w, R.prefill(w, *c.inputs()), c.noise)[0]
    err = (actions - c.tensors["joint.actions"]).abs().max().item()
    assert err <= TOL["actions"], f"joint actions: max abs {err:.2e} vs denoise"


def test_decoded_frames_match_lerobot():
    pytest.importorskip("diffusers")
    from flashrt_core.models.fastwam import encoders as E

    w, c = joint_case()
    vae = E.load_vae(folder() / "hf_wan_vae")
    theirs = c.tensors["joint.frames"].int()
    for name, latents in (("LeRobot's latents", c.tensors["joint.video_latents"]),
                          ("imagined latents", R.imagine(w, *c.inputs(), c.tensors["joint.video_noise"]))):
        frames = E.decode_frames(vae, latents)
        assert frames.dtype == torch.uint8 and tuple(frames.shape[1:]) == tuple(theirs.shape), name
        diff = (frames[0].int() - theirs).abs()
        assert diff.max().item() <= TOL["frames_level"], f"{name}: max {diff.max().item()} levels"
        frac = (diff > 0).float().mean().item()
        assert frac <= TOL["frames_fraction"], f"{name}: {frac:.2e} of the values differ"
    with pytest.raises(InputError, match="latents"):
        E.decode_frames(vae, c.tensors["joint.video_latents"][:, :8])


def test_imagine_checks_inputs():
    w, c = joint_case()
    noise = c.tensors["joint.video_noise"]
    lat, text, state = c.inputs()
    with pytest.raises(InputError, match="video_noise"):
        R.imagine(w, lat, text, state, noise[:, :8])
    with pytest.raises(InputError, match="first_frame_latents"):
        R.imagine(w, lat[..., :4], text, state, noise)
    with pytest.raises(InputError, match="state"):
        R.imagine(w, lat, text, None, noise)
