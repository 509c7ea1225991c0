"""The fused SmolVLA engine (flashrt_core.models.smolvla.engine) against LeRobot 0.6.1's outputs.

Two CPU paths run the same engine code: the kernels' torch references (backend="torch") on every golden case, and
the Triton kernels in the CPU interpreter (TRITON_INTERPRET=1, set in conftest before any kernel import) on the
smallest case: its observe stage against LeRobot's prefix K/V, and one Euler step against LeRobot's first velocity
(a whole 10-step act stage takes ~40 s in the interpreter).
"""
import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first kernel-module import

import pytest  # noqa: E402
import torch  # noqa: E402

from smolvla_cases import case_ids, model  # noqa: E402
from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.errors import InputError  # noqa: E402
from flashrt_core.models.smolvla import reference as R  # noqa: E402
from flashrt_core.models.smolvla.engine import SmolVLAEngine  # noqa: E402

# What each comparison allows (max abs), and why.
TOL = {
    "fp32_vs_lerobot": 1e-3,  # fused fp32 engine on the CPU vs LeRobot's actions (measured ~2e-6)
    "prefix_vs_lerobot": 1e-3,  # the observe stage's K/V (Triton interpreter) vs LeRobot's cache
    "velocity_vs_lerobot": 1e-3,  # one Euler step (Triton interpreter) vs LeRobot's first velocity
    "prefix_vs_reference": 1e-5,  # every expert layer's prefix K/V (cross layers projected) vs the reference
    "masked_change": 1e-5,  # what a masked slot / prompt tail holds changes nothing
}
_ENGINES: dict = {}


def engine(folder: str, backend="torch") -> SmolVLAEngine:
    """One fp32 CPU engine per fixture and backend (the GEMMs in torch: the skinny GEMM is a GPU matter)."""
    if (folder, backend) not in _ENGINES:
        _ENGINES[folder, backend] = SmolVLAEngine(model(folder)[1], torch.device("cpu"), torch.float32,
                                                  backend=backend, gemm="torch")
    return _ENGINES[folder, backend]


@pytest.mark.parametrize("folder,case", case_ids(), ids=lambda v: v)
def test_cpu_engine_matches_lerobot(folder, case):
    c = model(folder)[3][case]
    actions = engine(folder).sample_actions(*c.inputs(), c.noise)
    err = (actions - c.actions).abs().max().item()
    assert err <= TOL["fp32_vs_lerobot"], f"{folder}/{case}: max abs {err:.2e} vs LeRobot"


@pytest.mark.parametrize("folder", ["lerobot_smolvla_three_cams", "lerobot_smolvla_empty_cam"])
def test_staged_prefix_is_the_references_and_denoise_is_the_decision(folder):
    _, w, _, cases = model(folder)
    c = next(iter(cases.values()))
    eng = engine(folder)
    decision = eng.sample_actions(*c.inputs(), c.noise)
    prefix = eng.encode_prefix(*c.inputs())
    ref = R.encode_prefix(w, *c.inputs())
    assert torch.equal(prefix.pad_mask, ref.pad_mask) and torch.equal(prefix.n_valid, ref.n_valid)
    real = ref.pad_mask[0]  # (padded rows hold junk nothing reads, as LeRobot's do)
    for ours, want in ((prefix.k, ref.k), (prefix.v, ref.v)):
        assert (ours[:, :, :, real] - want[:, :, :, real]).abs().max().item() <= TOL["prefix_vs_reference"]
    kept = R.PrefixCache(prefix.k.clone(), prefix.v.clone(), prefix.pad_mask.clone(), prefix.n_valid.clone())
    assert torch.equal(eng.denoise(kept, c.noise), decision)


def test_masked_slots_and_prompt_tails_change_nothing_and_inputs_are_checked():
    _, _, _, cases = model("lerobot_smolvla_three_cams")
    c = cases["side_missing"]  # two cameras: slot 2 is a masked slot
    eng = engine("lerobot_smolvla_three_cams")
    base = eng.sample_actions(*c.inputs(), c.noise)
    images, masks, tokens, mask, state = c.inputs()
    eng.buffers.images.fill_(float("nan"))  # stale junk in the buffers must not reach the actions
    eng.buffers.lang_tokens.fill_(5)
    again = eng.sample_actions(*c.inputs(), c.noise)
    assert (again - base).abs().max().item() <= TOL["masked_change"]
    with pytest.raises(InputError, match="state"):
        eng.sample_actions(images, masks, tokens, mask, torch.zeros(1, 40), c.noise)
    with pytest.raises(InputError, match="noise"):
        eng.sample_actions(images, masks, tokens, mask, state, c.noise[:, :7])
    assert torch.equal(eng.sample_actions(*c.inputs(), c.noise), again)  # a refused call changed nothing


@pytest.mark.interpret
def test_triton_observe_and_first_step_match_lerobot():
    """The Triton kernels (interpreter) on the smallest case: the prefix K/V LeRobot caches for the VLM layers the
    self-attention expert layers read, then one Euler step (t = 1) against LeRobot's first velocity."""
    if not K.available("cpu"):
        pytest.skip("needs TRITON_INTERPRET=1 before the kernels are imported")
    config, w, meta, cases = model("lerobot_smolvla_three_cams")
    c = cases[meta["debug_case"]["name"]]
    one = dataclasses.replace(config, num_steps=1)  # step 0's tables (t = 1) are the same for 1 or 10 steps
    w1 = dataclasses.replace(w, config=one, time_emb=w.time_emb[:1], time_bias=w.time_bias[:1])
    eng = SmolVLAEngine(w1, torch.device("cpu"), torch.float32, backend="triton", gemm="torch")
    prefix = eng.encode_prefix(*c.inputs())
    real, lr_real = prefix.pad_mask[0], c.tensors["debug.prefix_pad_masks"][0].bool()
    for j in range(config.expert.depth):
        if not config.is_cross(j * config.expert_stride):
            i = j * config.expert_stride
            err = (prefix.k[j][:, :, real] - c.tensors[f"debug.prefix_k.{i}"][:, :, lr_real]).abs().max().item()
            assert err <= TOL["prefix_vs_lerobot"], f"prefix K of layer {i}: {err:.2e}"
    actions = eng.denoise(prefix, c.noise)  # x_1 = noise + (-1) * v(noise, t=1)
    err = ((c.noise - actions) - c.tensors["debug.velocity"][0]).abs().max().item()
    assert err <= TOL["velocity_vs_lerobot"], f"first velocity: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("folder", ["lerobot_smolvla_three_cams", "lerobot_smolvla_empty_cam"])
def test_cuda_engine_with_graphs_matches_lerobot(folder):
    """On a GPU: the compiled Triton kernels, the GEMM picker and the stage graphs (observe, act, the whole
    decision) in fp32 against LeRobot's actions, and in bf16 against them by cosine / relative L2 (the parity
    targets of the project's bf16 paths)."""
    from lerobot_cases import cosine, rel_l2

    dev = torch.device("cuda")
    w = model(folder)[1]
    for dtype, check in ((torch.float32, "abs"), (torch.bfloat16, "cos")):
        eng = SmolVLAEngine(w.to(device=dev, dtype=dtype), dev, dtype)
        for name, c in model(folder)[3].items():
            inputs = [t.to(dev) for t in c.inputs()]
            whole = eng.sample_actions(*inputs, c.noise.to(dev)).float().cpu()
            staged = eng.denoise(eng.encode_prefix(*inputs), c.noise.to(dev)).float().cpu()
            if check == "abs":
                assert (whole - c.actions).abs().max().item() <= TOL["fp32_vs_lerobot"], (folder, name)
                assert (staged - c.actions).abs().max().item() <= TOL["fp32_vs_lerobot"], (folder, name)
            else:
                assert cosine(whole, c.actions) >= 0.999 and rel_l2(whole, c.actions) <= 2e-2, (folder, name)
        assert eng.captures >= 3  # observe, act and the decision ran as CUDA graphs
