"""The eager pi0.5 reference against LeRobot 0.6.1's own outputs, and the staged API's invariants."""
import importlib.util
import math

import pytest
import torch

from flashrt_core.errors import InputError
from flashrt_core.models import pi05
from lerobot_cases import PI05_CASES, load_cases, model_inputs
from flashrt_core.models.pi05 import reference as R
from flashrt_core.models.pi05.weights import step_times, time_condition

# Tolerances (absolute unless stated).
TOL = {
    "actions_vs_lerobot": 1e-4,  # fp32 re-implementation vs LeRobot 0.6.1 golden actions
    "batched_vs_single": 1e-5,  # a case computed inside a batch of two vs alone (BLAS blocking differs)
    "masked_input_change": 1e-6,  # changing padded prompt tokens / a masked camera must not move actions
    "time_condition": 1e-5,  # precomputed time condition vs an independent float64 formula
    "bf16_cosine": 0.999,  # bf16 weights vs fp32: cosine similarity at least this
}
CASES = PI05_CASES


@pytest.fixture(scope="module")
def fixture_model(fixtures_dir):
    folder = fixtures_dir / "lerobot_pi05_tiny"
    config, state = pi05.load_checkpoint(folder)
    return folder, pi05.convert(config, state)


@pytest.fixture(scope="module")
def cases(fixtures_dir):
    return load_cases(fixtures_dir)


_inputs = model_inputs


@pytest.mark.parametrize("name", CASES)
def test_actions_match_lerobot(fixture_model, cases, name):
    _, w = fixture_model
    c = cases[name]
    with torch.no_grad():
        actions = R.sample_actions(w, *_inputs(c), c["noise"])
    assert actions.shape == c["actions"].shape == (1, 50, 32)
    err = (actions - c["actions"]).abs().max().item()
    assert err < TOL["actions_vs_lerobot"], f"{name}: max abs error {err:.3g}"


def test_staged_equals_sample_actions_and_prefix_is_reusable(fixture_model, cases):
    _, w = fixture_model
    c = cases["two_views_padded_prompt"]
    other_noise = torch.randn(c["noise"].shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        prefix = R.encode_prefix(w, *_inputs(c))
        first = R.denoise(w, prefix, c["noise"])
        second = R.denoise(w, prefix, other_noise)  # the same cache, reused by a second decision
        assert torch.equal(first, R.sample_actions(w, *_inputs(c), c["noise"]))
        assert torch.equal(second, R.sample_actions(w, *_inputs(c), other_noise))
        assert torch.equal(first, R.denoise(w, prefix, c["noise"]))  # denoise did not modify the cache
    assert (first - second).abs().max() > 0.1
    g = w.config.vlm
    assert prefix.k.shape == (g.depth, 1, g.kv_heads, 3 * 256 + 16, g.head_dim)
    assert prefix.n_valid.tolist() == [2 * 256 + int(c["lang_mask"].sum())]


def test_masked_inputs_do_not_change_actions(fixture_model, cases):
    _, w = fixture_model
    c = cases["one_view_240x320_two_missing"]
    images, masks, tokens, lang_mask = (t.clone() for t in _inputs(c))
    assert not lang_mask.all() and not masks.all()
    g = torch.Generator().manual_seed(3)
    tokens[~lang_mask] = torch.randint(3, 1000, (int((~lang_mask).sum()),), generator=g)
    images[:, 1] = torch.rand(images[:, 1].shape, generator=g) * 2 - 1  # a missing camera with content
    with torch.no_grad():
        base = R.sample_actions(w, *_inputs(c), c["noise"])
        changed = R.sample_actions(w, images, masks, tokens, lang_mask, c["noise"])
        # ...while unmasking that camera must change the result.
        masks[:, 1] = True
        unmasked = R.sample_actions(w, images, masks, tokens, lang_mask, c["noise"])
    assert (base - changed).abs().max() < TOL["masked_input_change"]
    assert (base - unmasked).abs().max() > 1e-3


def test_batch_of_two_matches_single_cases(fixture_model, cases):
    _, w = fixture_model
    a, b = cases["two_views_padded_prompt"], cases["one_view_240x320_two_missing"]
    batched = [torch.cat([x, y]) for x, y in zip(_inputs(a), _inputs(b))]
    with torch.no_grad():
        out = R.sample_actions(w, *batched, torch.cat([a["noise"], b["noise"]]))
    for i, c in enumerate((a, b)):
        assert (out[i] - c["actions"][0]).abs().max() < TOL["actions_vs_lerobot"]
        with torch.no_grad():
            single = R.sample_actions(w, *_inputs(c), c["noise"])
        assert (out[i] - single[0]).abs().max() < TOL["batched_vs_single"]


def test_time_condition_tables(fixture_model):
    _, w = fixture_model
    cfg = w.config
    n, width = cfg.num_steps, cfg.expert.width
    assert torch.equal(step_times(n), torch.tensor([1.0 - k / n for k in range(n)], dtype=torch.float32))
    # Independent float64 sinusoid: periods geometric from min_period to max_period.
    t = w.step_times.double()
    half = width // 2
    periods = torch.tensor([cfg.min_period * (cfg.max_period / cfg.min_period) ** (i / (half - 1))
                            for i in range(half)], dtype=torch.float64)
    angle = t[:, None] * (2 * math.pi / periods)[None]
    emb = torch.cat([angle.sin(), angle.cos()], dim=1)
    silu = torch.nn.functional.silu
    h = silu(emb @ w.time_in_w.double().T + w.time_in_b.double())
    cond = silu(h @ w.time_out_w.double().T + w.time_out_b.double())
    assert (w.time_cond.double() - cond).abs().max() < TOL["time_condition"]
    assert torch.equal(time_condition(w, w.step_times), w.time_cond)
    layer = w.expert_layers[1]
    step = 4
    mod = (cond[step] @ layer.mlp_ada_w.double().T + layer.mlp_ada_b.double()).view(3, width)
    assert (w.ada_mlp[step, 1].double() - mod).abs().max() < TOL["time_condition"]
    assert w.ada_attn.shape == (n, cfg.expert.depth, 3, width) and w.ada_final.shape == (n, 2, width)


def test_policy_api_matches_lerobot_and_seeds_noise(model_ckpt, cases):
    folder = model_ckpt["pi05"]
    policy = pi05.load(folder, device="cpu", dtype="float32", engine="reference", seed=5)
    c = cases["three_views_full_prompt"]
    # LeRobot passes images and masks as lists of per-camera tensors.
    images = [c["images"][:, i] for i in range(3)]
    masks = [c["image_masks"][:, i] for i in range(3)]
    actions = policy.sample_actions(images, masks, c["lang_tokens"], c["lang_mask"], noise=c["noise"])
    assert (actions - c["actions"]).abs().max() < TOL["actions_vs_lerobot"]
    again = pi05.load(folder, seed=5)
    a1 = policy.sample_actions(*_inputs(c))
    a2 = again.sample_actions(*_inputs(c))
    assert torch.equal(a1, a2)
    assert not torch.equal(a1, policy.sample_actions(*_inputs(c)))  # the generator advanced
    with pytest.raises(InputError, match="noise"):
        policy.sample_actions(*_inputs(c), noise=torch.zeros(1, 49, 32))
    with pytest.raises(InputError, match="images"):
        policy.sample_actions(c["images"][:, :, :, :100], *_inputs(c)[1:])


def test_engine_selection():
    with pytest.raises(ValueError, match="engine"):
        pi05.load(None, engine="warp-drive")
    if importlib.util.find_spec("flashrt_core.models.pi05.engine") is None:
        with pytest.raises(ImportError, match="fused"):
            pi05.load(None, engine="fused")


def test_tiny_policy_bf16_close_to_fp32():
    fp32, bf16 = pi05.load(None), pi05.load(None, dtype="bfloat16")
    w = bf16.weights
    assert w.vlm_layers[0].qkv_w.dtype == torch.bfloat16 and w.expert_layers[0].down_w.dtype == torch.bfloat16
    assert w.vision_layers[0].qkv_w.dtype == torch.float32  # SigLIP stays fp32, as in LeRobot
    assert w.ada_attn.dtype == torch.float32 and w.vlm_layers[0].attn_norm.dtype == torch.float32
    g = torch.Generator().manual_seed(11)
    images = torch.rand(2, 3, 3, 224, 224, generator=g) * 2 - 1
    masks = torch.tensor([[True, True, False], [True, False, False]])
    tokens = torch.randint(3, 1000, (2, 21), generator=g)
    lang_mask = torch.ones(2, 21, dtype=torch.bool)
    lang_mask[1, 13:] = False
    noise = torch.randn(2, 50, 32, generator=g)
    a = fp32.sample_actions(images, masks, tokens, lang_mask, noise=noise)
    b = bf16.sample_actions(images, masks, tokens, lang_mask, noise=noise)
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert b.dtype == torch.float32 and cos > TOL["bf16_cosine"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_cuda_reference_matches_lerobot(fixture_model, cases, name):
    folder, _ = fixture_model
    c = {k: v.cuda() for k, v in cases[name].items()}
    policy = pi05.load(folder, device="cuda", dtype="float32", engine="reference")  # (auto: fused bf16 on CUDA)
    bf16 = pi05.load(folder, device="cuda", dtype="bfloat16", engine="reference")
    # cuDNN would run the patch convolution in TF32 by default; parity is judged in true fp32.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        prefix = policy.encode_prefix(*_inputs(c))
        actions = policy.denoise(prefix, c["noise"])
        low = bf16.sample_actions(*_inputs(c), noise=c["noise"])
    assert prefix.k.is_cuda and actions.is_cuda
    assert (actions - c["actions"]).abs().max().item() < TOL["actions_vs_lerobot"]
    cos = torch.nn.functional.cosine_similarity(low.flatten(), c["actions"].flatten(), dim=0)
    assert cos > TOL["bf16_cosine"]
