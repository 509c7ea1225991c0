"""The fused pi0.5 engine against LeRobot 0.6.1's golden outputs and the project's fp32 eager reference.

Three paths run the same engine code: the CPU path (the kernels' torch references, backend="torch"), the
Triton kernels in the CPU interpreter (TRITON_INTERPRET=1, set below before any kernel import) on a micro
model small enough for the interpreter, and (marked gpu, with TRITON_INTERPRET=0) compiled Triton with
CUDA graphs.
"""
import os
import inspect

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first kernel-module import

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_core.errors import InputError  # noqa: E402
from flashrt_core.kernels._common import interpreting  # noqa: E402
from flashrt_core.models import pi05  # noqa: E402
from lerobot_cases import PI05_CASES, load_cases, model_inputs  # noqa: E402
from flashrt_core.models.pi05 import reference as R  # noqa: E402
from flashrt_core.models.pi05.config import GemmaConfig, Pi05Config, VisionConfig  # noqa: E402
from flashrt_core.models.pi05.engine import Pi05Engine  # noqa: E402
from flashrt_core.kernels import reference as KR  # noqa: E402
from flashrt_core.models.pi05.engine_gemm import (NO_FUSION, Fusion, GatedResidual, LinearPicker,  # noqa: E402
                                                  QkvRope, RowNorm, RowStats, skinny_linear)
from kernel_testing import dev  # noqa: E402,F401  (the kernel device fixture: interpreter or CUDA)

TOL = {
    "fp32_vs_lerobot": 1e-4,  # absolute: fp32 engine (torch path) vs LeRobot golden actions
    "fp32_vs_reference": 1e-4,  # absolute: fp32 engine (Triton interpreter) vs the fp32 eager reference
    "bf16_cosine": 0.999,  # bf16 engine vs fp32 reference: action cosine similarity at least
    "bf16_rel_l2": 2e-2,  # ... and relative L2 error at most
    "masked_change": 1e-6,  # absolute: content of masked prompt tokens / camera slots must not matter
    "gemm_fp32": 1e-5,  # skinny GEMM vs F.linear, fp32 (relative to the output's max)
    "fused_gemm_fp32": 2e-5,  # skinny GEMM with a fused AdaRMS / gated residual / row stats vs separate ops, fp32
    "fused_gemm_bf16": 3e-2,  # ... bf16 (the scaled input is rounded before the product, not the norm)
    # QKV GEMM with split / RoPE / K/V write in its epilogue vs F.linear + the rotation reference, relative to
    # the output's max: fp32; bf16 (the epilogue rotates the fp32 product, the reference the bf16-rounded one)
    "qkv_rope_fp32": 2e-5,
    "qkv_rope_bf16": 2e-2,
    # relative L2: the graphed engine (GEMMs picked per shape: Triton skinny GEMM or cuBLAS) vs the eager one
    # with cuBLAS only; bf16 outputs of two accumulation orders (measured 1.02e-3 on an H200, 2026-12-02)
    "graph_vs_eager": 3e-3,
    # absolute, fp32: a stage run with hooks vs the staged API: the same kernels on the same data (the
    # attention picker may time its candidates again for the new graph)
    "hooks_vs_staged": 1e-5,
    # relative L2: two engines with the same launch choices (the second from the tuning cache); only cuBLAS's
    # own algorithm choice may differ between them
    "restart": 1e-3,
    # relative to the actions' max: fused_euler vs the separate update, fp32 (x + dt v in one fused multiply-add
    # or two roundings, then ten steps through the tiny model)
    "fused_euler_fp32": 1e-5,
    # the same in bf16: the velocity is rounded to bf16 in both forms and the state stays fp32, so only the
    # update's fp32 rounding differs; where that flips a bf16 rounding of the next step's input (one ulp,
    # 2^-8 relative) the difference grows through the remaining steps
    "fused_euler_bf16": 2e-3,
}
CASES = PI05_CASES


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cosine(a, b):
    return F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


@pytest.fixture(scope="module")
def fixture_weights(fixtures_dir):
    config, state = pi05.load_checkpoint(fixtures_dir / "lerobot_pi05_tiny")
    return pi05.convert(config, state)


@pytest.fixture(scope="module")
def cases(fixtures_dir):
    return load_cases(fixtures_dir)


_inputs = model_inputs


# ---- CPU path (torch references) ------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_cpu_engine_matches_lerobot(fixture_weights, cases, name):
    c = cases[name]
    engine = Pi05Engine(fixture_weights, backend="torch")
    actions = engine.sample_actions(*_inputs(c), c["noise"])
    err = (actions - c["actions"]).abs().max().item()
    assert err < TOL["fp32_vs_lerobot"], f"{name}: max abs error {err:.3g}"


def test_patch_embed_is_the_strided_convolution():
    """SigLIP's patch embedding as one GEMM over gathered patches (patch_gemm) equals conv2d + flatten on
    odd shapes (4 channels, 5x5 patches, a 15x10 image: 3x2 patches), fp32, relative to the output's max."""
    from flashrt_core.kernels._common import KernelInputError
    from flashrt_core.models.pi05.engine_blas import patch_embed, patch_matrix
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(3, 4, 15, 10, generator=g)
    w = torch.randn(7, 4, 5, 5, generator=g) * 0.2
    b = torch.randn(7, generator=g)
    want = F.conv2d(pixels, w, b, stride=5).flatten(2).transpose(1, 2)
    got = patch_embed(pixels, w, b)
    assert got.shape == want.shape == (3, 6, 7)
    assert (got - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()
    with pytest.raises(KernelInputError, match="do not tile"):
        patch_embed(pixels[..., :8], w, b)
    # The GEMM's weight matrix: rows padded with zeros from K = 100 to 104 values (16-byte bf16 rows); the
    # same result when given, and refused when it is not this weight's.
    mat = patch_matrix(w)
    assert mat.shape == (7, 104) and not mat[:, 100:].any() and torch.equal(mat[:, :100], w.reshape(7, 100))
    assert torch.equal(patch_embed(pixels, w, b, mat), got)
    with pytest.raises(KernelInputError, match="is not patch_matrix"):
        patch_embed(pixels, w, b, mat[:, :96])


def test_linear_bias_gelu_tanh_on_cpu_is_linear_then_bias_gelu():
    from flashrt_core.models.pi05.engine_blas import linear_bias_gelu_tanh
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(2, 9, 24, generator=g), torch.randn(40, 24, generator=g) * 0.3, torch.randn(40, generator=g)
    want = KR.bias_gelu_ref(F.linear(x, w), b)
    got = linear_bias_gelu_tanh(x, w, b)
    assert got.shape == (2, 9, 40) and (got - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()


@pytest.mark.gpu
def test_linear_bias_gelu_tanh_on_cuda_is_the_tanh_gelu():
    """The cuBLASLt bias + GELU epilogue computes SigLIP's tanh GELU (not the erf form): fp32, where the two
    forms differ by up to ~5e-4 and the GEMM's own error is ~1e-6."""
    from flashrt_core.models.pi05.engine_blas import linear_bias_gelu_tanh
    if interpreting():
        pytest.skip("needs CUDA (TRITON_INTERPRET=0)")
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(512, 96, generator=g), torch.randn(200, 96, generator=g) * 0.2, torch.randn(200, generator=g)
    x, w, b = x.cuda(), w.cuda(), b.cuda()
    pre = torch.matmul(x.double(), w.double().t()) + b.double()
    got = linear_bias_gelu_tanh(x, w, b).double()
    tanh_err = (got - F.gelu(pre, approximate="tanh")).abs().max().item()
    erf_err = (got - F.gelu(pre)).abs().max().item()
    assert tanh_err <= 2e-5 * pre.abs().max().item() and erf_err > 10 * tanh_err
    got16 = linear_bias_gelu_tanh(x.bfloat16(), w.bfloat16(), b.bfloat16()).double()
    assert rel_l2(got16, F.gelu(pre, approximate="tanh")) <= 1e-2


def test_cpu_engine_patch_gemm_and_gelu_epilogue_match_the_plain_forms(fixture_weights, cases):
    """patch_gemm / gelu_epilogue off (conv2d; GEMM + bias_gelu kernel) give the default engine's actions (fp32,
    absolute: only the patch products' summation order differs)."""
    c = cases["two_views_padded_prompt"]
    a = Pi05Engine(fixture_weights, backend="torch").sample_actions(*_inputs(c), c["noise"])
    b = Pi05Engine(fixture_weights, backend="torch", patch_gemm=False, gelu_epilogue=False).sample_actions(
        *_inputs(c), c["noise"])
    assert (a - b).abs().max().item() <= TOL["fp32_vs_reference"]


def test_cpu_bf16_engine_vs_fp32_reference(fixture_weights, cases):
    c = cases["two_views_padded_prompt"]
    engine = Pi05Engine(fixture_weights, dtype=torch.bfloat16, backend="torch")
    assert engine.buffers.prefix_k.dtype == torch.bfloat16
    actions = engine.sample_actions(*_inputs(c), c["noise"])
    assert cosine(actions, c["actions"]) >= TOL["bf16_cosine"]
    assert rel_l2(actions, c["actions"]) <= TOL["bf16_rel_l2"]


def test_staged_api_static_buffers_and_prompt_lengths(fixture_weights, cases):
    c = cases["two_views_padded_prompt"]
    engine = Pi05Engine(fixture_weights, backend="torch")
    k_addr = engine.buffers.prefix_k.data_ptr()
    prefix = engine.encode_prefix(*_inputs(c))
    assert prefix.k.data_ptr() == k_addr  # the cache is the static buffer, not a copy
    first = engine.denoise(prefix, c["noise"])
    other = torch.randn(c["noise"].shape, generator=torch.Generator().manual_seed(7))
    second = engine.denoise(prefix, other)  # prefix reused by a second decision
    assert torch.equal(first, engine.denoise(prefix, c["noise"]))
    assert (first - second).abs().max() > 0.1
    # A shorter prompt (only its 12 valid tokens) lands in the same buffers, padded and masked.
    n = int(c["lang_mask"].sum())
    short = engine.sample_actions(c["images"], c["image_masks"], c["lang_tokens"][:, :n], c["lang_mask"][:, :n],
                                  c["noise"])
    assert (short - c["actions"]).abs().max() < TOL["fp32_vs_lerobot"]
    assert engine.buffers.prefix_k.data_ptr() == k_addr
    # Junk in masked prompt positions and in a masked camera slot changes nothing.
    tokens, images = c["lang_tokens"].clone(), c["images"].clone()
    tokens[~c["lang_mask"]] = 999
    images[:, 2] = torch.rand(images[:, 2].shape, generator=torch.Generator().manual_seed(1))
    junk = engine.sample_actions(images, c["image_masks"], tokens, c["lang_mask"], c["noise"])
    assert (junk - first).abs().max() < TOL["masked_change"]


def test_the_decision_hooks_mark_each_prefix_layer_before_its_first_read(fixture_weights, cases):
    """overlap_decision's graph orders the act stream after the observe stream by these hooks alone: the observe
    body must announce prefix layer i only once its K/V are final, and the act body must wait for layer i
    before it first reads that layer's prefix K/V (and for the valid count before anything), in the first flow
    step only (later steps come after the whole first one)."""
    c = cases["two_views_padded_prompt"]
    engine = Pi05Engine(fixture_weights, backend="torch")
    engine.set_observation(*_inputs(c))
    buf, depth = engine.buffers, fixture_weights.config.vlm.depth
    announced, snapshots = [], {}

    def done(i):
        announced.append(i)
        snapshots[i] = (buf.n_valid.clone(), buf.pad_mask.clone()) if i < 0 else \
            (buf.prefix_k[i].clone(), buf.prefix_v[i].clone())
    with torch.no_grad():
        engine._observe_body(prefix_done=done)
    assert announced == [-1, *range(depth)]
    for i, (k, v) in snapshots.items():
        want = (buf.n_valid, buf.pad_mask) if i < 0 else (buf.prefix_k[i], buf.prefix_v[i])
        assert torch.equal(k, want[0]) and torch.equal(v, want[1]), f"prefix layer {i} announced unfinished"
    events, attend = [], engine.attend
    layer_of = {buf.prefix_k[i].data_ptr(): i for i in range(depth)}

    def recording_attend(q, k, v, **kw):
        events.append(("read", layer_of[k.data_ptr()]))
        return attend(q, k, v, **kw)
    engine.attend = recording_attend
    engine.buffers.noise.copy_(c["noise"])
    with torch.no_grad():
        engine._act_body(prefix_wait=lambda i: events.append(("wait", i)))
    steps = fixture_weights.config.num_steps
    assert events[0] == ("wait", -1)
    assert [e for e in events if e[0] == "wait"] == [("wait", i) for i in range(-1, depth)]
    for i in range(depth):  # the wait for layer i comes before the first read of it
        assert events.index(("wait", i)) < events.index(("read", i))
    assert sum(e[0] == "read" for e in events) == steps * depth
    assert (buf.actions - c["actions"]).abs().max() < TOL["fp32_vs_lerobot"]  # the hooks change nothing


def test_sample_actions_checks_the_noise_before_writing_anything(fixture_weights, cases):
    a, b = cases["two_views_padded_prompt"], cases["one_view_240x320_two_missing"]
    engine = Pi05Engine(fixture_weights, backend="torch", overlap_decision=True)
    first = engine.sample_actions(*_inputs(a), a["noise"])
    assert (first - a["actions"]).abs().max() < TOL["fp32_vs_lerobot"]
    kept = {name: getattr(engine.buffers, name).clone() for name in ("images", "lang_tokens", "noise", "prefix_k")}
    with pytest.raises(InputError, match="noise"):
        engine.sample_actions(*_inputs(b), b["noise"][:, :-1])
    for name, t in kept.items():
        assert torch.equal(getattr(engine.buffers, name), t), f"{name} changed by a refused call"


def test_denoise_accepts_a_foreign_prefix_and_batches(fixture_weights, cases):
    a, b = cases["two_views_padded_prompt"], cases["one_view_240x320_two_missing"]
    engine = Pi05Engine(fixture_weights, backend="torch")
    with torch.no_grad():
        ref_prefix = R.encode_prefix(fixture_weights, *_inputs(a))
    out = engine.denoise(ref_prefix, a["noise"])  # e.g. a runtime's own persistent prefix buffers
    assert (out - a["actions"]).abs().max() < TOL["fp32_vs_lerobot"]
    batched = [torch.cat([x, y]) for x, y in zip(_inputs(a), _inputs(b))]
    out = engine.sample_actions(*batched, torch.cat([a["noise"], b["noise"]]))
    assert engine.batch == 2
    for i, c in enumerate((a, b)):
        assert (out[i] - c["actions"][0]).abs().max() < TOL["fp32_vs_lerobot"]


def test_input_errors_name_the_field(fixture_weights, cases):
    c = cases["three_views_full_prompt"]
    engine = Pi05Engine(dataclasses.replace(fixture_weights, config=dataclasses.replace(
        fixture_weights.config, num_image_slots=2, tokenizer_max_length=16)), backend="torch")
    with pytest.raises(InputError, match="images: 3 camera slots"):
        engine.encode_prefix(*_inputs(c))
    two = (c["images"][:, :2], c["image_masks"][:, :2])
    with pytest.raises(InputError, match="lang_tokens: 17 tokens"):
        engine.encode_prefix(*two, torch.zeros(1, 17, dtype=torch.long), torch.ones(1, 17, dtype=torch.bool))
    with pytest.raises(InputError, match="image_masks"):
        engine.encode_prefix(two[0], two[1][:, :1], c["lang_tokens"], c["lang_mask"])
    prefix = engine.encode_prefix(*two, c["lang_tokens"], c["lang_mask"])
    with pytest.raises(InputError, match="noise"):
        engine.denoise(prefix, torch.zeros(1, 49, 32))


def test_policy_load_fused_engine(fixtures_dir, cases):
    policy = pi05.load(fixtures_dir / "lerobot_pi05_tiny", engine="fused")
    assert policy.engine.name == "fused"
    c = cases["three_views_full_prompt"]
    policy.engine.backend = "torch"
    actions = policy.sample_actions(*_inputs(c), noise=c["noise"])
    assert (actions - c["actions"]).abs().max() < TOL["fp32_vs_lerobot"]
    # Without noise the policy draws it from its seeded generator, as the reference engine's policy does
    # (the fused engine takes its one-call decision path, the reference engine its two stages).
    fused = pi05.load(fixtures_dir / "lerobot_pi05_tiny", engine="fused", seed=3)
    fused.engine.backend = "torch"
    reference = pi05.load(fixtures_dir / "lerobot_pi05_tiny", engine="reference", seed=3)
    a, b = fused.sample_actions(*_inputs(c)), reference.sample_actions(*_inputs(c))
    assert (a - b).abs().max() < TOL["fp32_vs_lerobot"] and (a - actions).abs().max() > 0.1
    with pytest.raises(InputError, match="images"):
        fused.sample_actions(c["images"][:, :, :, :5], *_inputs(c)[1:])


# ---- Triton kernels (interpreter on CPU, compiled on CUDA) ------------------------------------------------
def micro_config() -> Pi05Config:
    """Odd, interpreter-sized shapes: 4 patches per view (28 px), 9-token prompt, 6-action chunk, 3 steps."""
    return Pi05Config(
        vision=VisionConfig(hidden=24, mlp=40, layers=2, heads=3, image_size=28, patch=14),
        vlm=GemmaConfig(width=40, depth=2, mlp=56, heads=4, kv_heads=1, head_dim=10),
        expert=GemmaConfig(width=24, depth=2, mlp=40, heads=4, kv_heads=1, head_dim=10),
        vocab_size=300, chunk_size=6, action_dim=7, num_steps=3, tokenizer_max_length=9, num_image_slots=2)


def micro_inputs(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    size, slots, n = config.vision.image_size, config.num_image_slots, config.tokenizer_max_length
    images = torch.rand(1, slots, 3, size, size, generator=g) * 2 - 1
    masks = torch.tensor([[True, False]])
    tokens = torch.randint(0, config.vocab_size, (1, n), generator=g)
    lang_mask = torch.arange(n)[None] < 6
    noise = torch.randn(1, config.chunk_size, config.action_dim, generator=g)
    return images, masks, tokens, lang_mask, noise


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_engine_matches_reference(dev, dtype):
    config, state = pi05.build_tiny(3, micro_config())
    weights = pi05.convert(config, state)
    images, masks, tokens, lang_mask, noise = micro_inputs(config)
    with torch.no_grad():
        want = R.sample_actions(weights, images, masks, tokens, lang_mask, noise)
    # The expert's norms inside its GEMMs (skinny kernel, and the torch route of the same algebra) or as
    # kernels between them.
    for backend, gemm, norm_in_gemm in (("triton", "triton", True), ("triton", "triton", False),
                                        ("torch", "torch", True)):
        engine = Pi05Engine(weights, device=dev, dtype=dtype, backend=backend, gemm=gemm, graphs=False,
                            norm_in_gemm=norm_in_gemm)
        got = engine.sample_actions(*(t.to(dev) for t in (images, masks, tokens, lang_mask, noise))).cpu()
        if dtype == torch.float32:
            assert (got - want).abs().max() < TOL["fp32_vs_reference"]
        else:
            assert cosine(got, want) >= TOL["bf16_cosine"] and rel_l2(got, want) <= TOL["bf16_rel_l2"]


@pytest.mark.interpret
@pytest.mark.parametrize("flags", [{"rope_in_attention": True}, {"rope_in_gemm": True},
                                   {"rope_in_gemm": True, "norm_in_gemm": True}], ids=lambda f: "+".join(f))
def test_rope_elsewhere_gives_the_split_kernel_path(dev, flags):
    """The rotation done elsewhere than the split/rotate kernel gives the actions of the path with it (same
    math; fp32): by the expert's attention on load (q/k/v read straight from the QKV GEMM output), or by
    the QKV GEMM's epilogue (with or without the AdaRMS fused into it); the torch route gives them too."""
    config, state = pi05.build_tiny(5, micro_config())
    weights = pi05.convert(config, state)
    inputs = [t.to(dev) for t in micro_inputs(config, seed=2)]
    split = Pi05Engine(weights, device=dev, backend="triton", gemm="triton", graphs=False)
    fused = Pi05Engine(weights, device=dev, backend="triton", gemm="triton", graphs=False, **flags)
    torch_path = Pi05Engine(weights, device=dev, backend="torch", graphs=False, **flags)
    with torch.no_grad():
        want = split.sample_actions(*inputs).cpu()
        assert (fused.sample_actions(*inputs).cpu() - want).abs().max() < TOL["fp32_vs_reference"]
        assert (torch_path.sample_actions(*inputs).cpu() - want).abs().max() < TOL["fp32_vs_reference"]


@pytest.mark.interpret
def test_early_modulation_gives_the_same_actions(dev):
    """early_modulation only moves the AdaRMS kernels' reads of the modulation table before their PDL wait:
    bit-for-bit the same actions as without (fp32, Triton kernels), and the flag reaches the engine."""
    config, state = pi05.build_tiny(5, micro_config())
    weights = pi05.convert(config, state)
    inputs = [t.to(dev) for t in micro_inputs(config, seed=3)]
    plain = Pi05Engine(weights, device=dev, backend="triton", gemm="triton", graphs=False, early_modulation=False)
    early = Pi05Engine(weights, device=dev, backend="triton", gemm="triton", graphs=False)  # the default: on
    assert early.early_modulation and not plain.early_modulation
    with torch.no_grad():
        assert torch.equal(early.sample_actions(*inputs), plain.sample_actions(*inputs))


@pytest.mark.interpret
def test_early_positions_gives_the_same_actions(dev):
    """early_positions only moves the split/rotate kernel's position and cos / sin reads before its PDL wait:
    bit-for-bit the same actions as without (fp32, Triton kernels)."""
    config, state = pi05.build_tiny(5, micro_config())
    weights = pi05.convert(config, state)
    inputs = [t.to(dev) for t in micro_inputs(config, seed=4)]
    kw = dict(device=dev, backend="triton", gemm="triton", graphs=False)
    plain, early = Pi05Engine(weights, early_positions=False, **kw), Pi05Engine(weights, early_positions=True, **kw)
    assert early.early_positions and not plain.early_positions
    with torch.no_grad():
        assert torch.equal(early.sample_actions(*inputs), plain.sample_actions(*inputs))


@pytest.mark.interpret
@pytest.mark.parametrize("norm_in_gemm", [False, True])
def test_fused_euler_gives_the_same_actions(dev, norm_in_gemm):
    """fused_euler: x_t += dt * velocity in the action-out GEMM's epilogue and the fp32 state read by the
    action-in GEMM; the same actions as the two torch ops per step (fp32: up to the rounding of a fused
    multiply-add), with the Triton GEMMs and on the torch route, alone and with the norms in the GEMMs."""
    config, state = pi05.build_tiny(5, micro_config())
    weights = pi05.convert(config, state)
    inputs = [t.to(dev) for t in micro_inputs(config, seed=6)]
    # fp32 with the Triton GEMMs and on the torch route; bf16 on the torch route (the fp32 state as a residual
    # of a bf16 GEMM: torch ops in fp32 around cuBLAS, `engine_gemm._cublas`)
    for backend, gemm, dtype in (("triton", "triton", None), ("torch", "torch", None),
                                 ("torch", "torch", torch.bfloat16)):
        kw = dict(device=dev, backend=backend, gemm=gemm, graphs=False, norm_in_gemm=norm_in_gemm, dtype=dtype)
        plain, fused = Pi05Engine(weights, fused_euler=False, **kw), Pi05Engine(weights, fused_euler=True, **kw)
        assert fused.fused_euler and not plain.fused_euler
        with torch.no_grad():
            want, got = plain.sample_actions(*inputs), fused.sample_actions(*inputs)
        tol = TOL["fused_euler_bf16"] if dtype == torch.bfloat16 else TOL["fused_euler_fp32"]
        assert want.abs().max() > 0
        assert (got - want).abs().max() <= tol * want.abs().max(), (backend, dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("one_step", [False, True])
def test_skinny_linear_takes_fp32_rows_and_an_fp32_residual_under_a_bf16_weight(dev, one_step):
    """The flow step's two GEMMs in a bf16 engine: fp32 rows into a bf16 GEMM are rounded to bf16 on load
    (action in; vs F.linear of the rounded rows), and an fp32 residual stream gets x += gate * bf16(x w^T + b)
    (action out with the Euler update: the velocity exactly as the plain call stores it); an fp32 stream
    cannot take row stats, and bf16 rows under an fp32 weight are refused."""
    g = torch.Generator().manual_seed(12)
    m, k, n = 7, 48, 24
    x = (torch.randn(m, k, generator=g) + 0.3).to(dev)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, torch.bfloat16)
    b = torch.randn(n, generator=g).to(dev, torch.bfloat16)
    kw = dict(block_n=16, block_k=16, split_k=0 if one_step else 2)
    y = skinny_linear(x, w, b, **kw)
    want = F.linear(x.to(torch.bfloat16).float(), w.float(), b.float())
    assert y.dtype == torch.bfloat16
    assert (y.float() - want).abs().max() <= TOL["fused_gemm_bf16"] * want.abs().max()
    state = torch.randn(m, n, generator=g).to(dev)
    dt = torch.full((n,), -0.1, device=dev)
    # the update adds the velocity as this kernel stores it in bf16 (y above), in fp32 (one FMA's rounding)
    expected = state + dt * y.float()
    got = skinny_linear(x, w, b, residual=GatedResidual(state, dt), **kw)
    assert got is state and got.dtype == torch.float32
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()
    from flashrt_core.kernels._common import KernelInputError
    with pytest.raises(KernelInputError, match="row stats"):
        skinny_linear(x, w, b, residual=GatedResidual(state, dt),
                      emit=RowStats(dt, torch.empty(m, n, device=dev, dtype=torch.bfloat16),
                                    torch.empty(2, m, device=dev)), **kw)
    with pytest.raises(KernelInputError, match="rounded on load"):
        skinny_linear(x.to(torch.bfloat16), w.float(), **kw)


@pytest.mark.gpu
@pytest.mark.skipif(interpreting(), reason="the interpreter truncates fp32 -> bf16 instead of rounding")
def test_fp32_rows_are_rounded_on_load_like_the_bf16_rows_on_cuda():
    """The compiled kernel's rounding of fp32 rows under a bf16 weight is the cast's (round to nearest even):
    every candidate gives bit for bit the result of the same call on x.bfloat16(), at the flow step's two
    shapes (action in: K = 32, N = 1024; action out: K = 1024, N = 32, with the fp32 state as residual). A
    candidate whose fp32 row tiles do not fit in shared memory is refused at launch (the tuning skips it)."""
    from triton.runtime.errors import OutOfResources

    from flashrt_core.models.pi05.engine_gemm import CONFIGS, TMA_CONFIGS, _kwargs

    g = torch.Generator().manual_seed(21)
    for k, n in ((32, 1024), (1024, 32)):
        x = (torch.randn(50, k, generator=g) + 0.3).cuda()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
        b = torch.randn(n, generator=g).to("cuda", torch.bfloat16)
        dt = torch.full((n,), -0.1, device="cuda")
        state = torch.randn(50, n, generator=g).cuda()
        truncated = (x.view(torch.int32) & -65536).view(torch.float32)  # what a truncating cast would give
        assert (truncated != x.bfloat16().float()).float().mean() > 0.3
        ran = 0
        for config in CONFIGS + TMA_CONFIGS:
            kw = _kwargs(config)
            try:  # (the bf16 form, whose row tiles are staged in shared memory, may be the one refused)
                got, want = skinny_linear(x, w, b, **kw), skinny_linear(x.bfloat16(), w, b, **kw)
                got_r = skinny_linear(x, w, b, residual=GatedResidual(state.clone(), dt), **kw)
                want_r = skinny_linear(x.bfloat16(), w, b, residual=GatedResidual(state.clone(), dt), **kw)
            except OutOfResources:
                continue
            ran += 1
            assert torch.equal(got, want) and torch.equal(got_r, want_r), config
        assert ran >= len(CONFIGS + TMA_CONFIGS) // 2, (k, n, ran)


def test_an_fp32_residual_under_a_bf16_gemm_is_tuned_as_its_own_shape():
    """The tuning key tells the fp32 flow state's residual from a residual stream in the GEMM's dtype (another
    kernel specialization), and says nothing more where they agree."""
    state, dt = torch.zeros(3, 8), torch.full((8,), -0.1)
    fp32_state = Fusion(residual=GatedResidual(state, dt))
    assert fp32_state.tags(torch.bfloat16) == ("residual", "residual:torch.float32")
    assert fp32_state.tags(torch.float32) == ("residual",)
    same = Fusion(residual=GatedResidual(state.bfloat16(), dt.bfloat16()))
    assert same.tags(torch.bfloat16) == ("residual",)
    assert NO_FUSION.tags(torch.bfloat16) == ()


def test_attention_merge_apart_flag_reaches_the_picker():
    config, state = pi05.build_tiny(5, micro_config())
    weights = pi05.convert(config, state)
    on = Pi05Engine(weights, device="cpu", graphs=False, attention_merge_apart=True)
    off = Pi05Engine(weights, device="cpu", graphs=False)  # the default: in-kernel merges only
    assert any(len(c) == 6 and c[5] for c in on.attend.candidates)
    assert not any(len(c) == 6 and c[5] for c in off.attend.candidates)
    assert (on.attend.cache_name, off.attend.cache_name) == ("attention_merge_apart", "attention")


@pytest.mark.interpret
def test_l2_prefetch_packs_the_expert_and_gives_the_same_actions(dev):
    """l2_prefetch: each expert layer's GEMM weights are adjacent views of one block in the order they run
    (equal to the originals), every planned prefetch range is exactly the weights / prefix K/V that the
    next kernels read, and the actions are those of the engine without it (the prefetch never changes a
    result; under the interpreter it is off, on the GPU the variant test below runs it)."""
    from flashrt_core.models.pi05.engine import _expert_prefetch

    config, state = pi05.build_tiny(6, micro_config())
    weights = pi05.convert(config, state)
    inputs = [t.to(dev) for t in micro_inputs(config, seed=3)]
    plain = Pi05Engine(weights, device=dev, backend="triton", gemm="triton", graphs=False)
    warm = Pi05Engine(weights, device=dev, backend="triton", gemm="triton", graphs=False, l2_prefetch=True)
    names = ("qkv_w", "o_w", "gate_up_w", "down_w")
    tensors = [getattr(L, n) for L in warm.weights.expert_layers for n in names]
    base = tensors[0].data_ptr()
    assert all(t.untyped_storage().data_ptr() == tensors[0].untyped_storage().data_ptr() for t in tensors)
    offsets = [t.data_ptr() - base for t in tensors]
    assert offsets == [sum(u.numel() * u.element_size() for u in tensors[:i]) for i in range(len(tensors))]
    for L, P in zip(plain.weights.expert_layers, warm.weights.expert_layers):
        assert all(torch.equal(getattr(L, n), getattr(P, n)) for n in names)
    layers, buf = warm.weights.expert_layers, warm.buffers
    plan = _expert_prefetch(layers, buf)
    n = len(layers)
    for i, L in enumerate(layers):
        (span,) = plan["rotate"][i]
        assert span.data_ptr() == L.o_w.data_ptr()
        assert span.numel() == L.o_w.numel() + L.gate_up_w.numel() + L.down_w.numel()
        qkv, k = plan["attn_norm"][i]
        assert qkv is layers[(i + 1) % n].qkv_w and k.data_ptr() == buf.prefix_k[(i + 1) % n].data_ptr()
        assert plan["mlp_norm"][i][0].data_ptr() == buf.prefix_v[(i + 1) % n].data_ptr()
    with torch.no_grad():
        assert torch.equal(warm.sample_actions(*inputs), plain.sample_actions(*inputs))
    for other in ("rope_in_attention", "norm_in_gemm", "rope_in_gemm"):
        with pytest.raises(ValueError, match="l2_prefetch"):
            Pi05Engine(weights, device=dev, graphs=False, l2_prefetch=True, **{other: True})
    with pytest.raises(ValueError, match="one place or the other"):
        Pi05Engine(weights, device=dev, graphs=False, rope_in_attention=True, rope_in_gemm=True)


@pytest.mark.interpret
def test_run_stage_hooks_give_the_staged_results(dev):
    """run_stage records pre / post with the stage (one CUDA graph on a GPU, eager on the CPU) and gives the
    staged API's results, at capture and at replay. On a GPU a hook that cannot be captured (it reads a
    value on the host) runs eagerly around the stage's own graph instead, and the reason is kept."""
    config, state = pi05.build_tiny(4, micro_config())
    weights = pi05.convert(config, state)
    images, masks, tokens, lang_mask, noise = (t.to(dev) for t in micro_inputs(config))
    engine = Pi05Engine(weights, device=dev, backend="triton", gemm="triton")
    with torch.no_grad():
        want = engine.sample_actions(images, masks, tokens, lang_mask, noise).clone()
    src, out = noise.clone(), torch.zeros_like(want)
    engine.buffers.actions.zero_()
    for _ in range(2):  # the first call captures, the second replays
        engine.run_stage("observe", pre=lambda: engine.set_observation(images, masks, tokens, lang_mask))
        engine.run_stage("act", pre=lambda: engine.buffers.noise.copy_(src),
                         post=lambda: out.copy_(engine.buffers.actions))
        torch.testing.assert_close(out, want, rtol=0, atol=TOL["hooks_vs_staged"])
    assert engine.hook_capture_errors == {}
    if dev != "cuda":
        return
    got = torch.zeros_like(want)

    def host_read():  # .item() waits for the device: not capturable
        got.copy_(engine.buffers.actions * (1.0 if engine.buffers.noise.abs().max().item() >= 0 else 0.0))

    for _ in range(2):
        engine.run_stage("act", pre=lambda: engine.buffers.noise.copy_(src), post=host_read, key="host-read")
        torch.testing.assert_close(got, want, rtol=0, atol=TOL["hooks_vs_staged"])
    assert set(engine.hook_capture_errors) == {("act", "host-read")}
    assert engine.hook_capture_errors[("act", "host-read")].startswith("waits for the device")
    # A fresh engine (no plain stage graphs yet): the refused hook never reaches a capture, the fallback
    # captures the plain stage graph, and later captures in the same pool still work.
    fresh = Pi05Engine(weights, device=dev, backend="triton", gemm="triton")
    fresh.run_stage("observe", pre=lambda: fresh.set_observation(images, masks, tokens, lang_mask))
    got.zero_()
    fresh.run_stage("act", pre=lambda: fresh.buffers.noise.copy_(src), post=lambda: got.copy_(
        fresh.buffers.actions * (1.0 if fresh.buffers.noise.abs().max().item() >= 0 else 0.0)), key="host-read")
    torch.testing.assert_close(got, want, rtol=0, atol=TOL["hooks_vs_staged"])
    assert set(fresh.hook_capture_errors) == {("act", "host-read")} and "act" in fresh._graphs
    fresh.run_stage("act", pre=lambda: fresh.buffers.noise.copy_(src), post=lambda: out.copy_(fresh.buffers.actions))
    torch.testing.assert_close(out, want, rtol=0, atol=TOL["hooks_vs_staged"])
    assert ("act", "hooks") in fresh._graphs


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k,bias,geglu,split,preload", [
    (50, 40, 72, True, False, 1, 0), (7, 33, 129, False, False, 2, 0), (50, 24, 300, True, False, 4, 0),
    (13, 2 * 20, 40, False, True, 1, 0), (1, 16, 8, True, False, 1, 0), (130, 24, 100, True, False, 4, 0),
    (13, 2 * 20, 70, False, True, 2, 0), (50, 24, 96, True, False, 0, 0), (9, 2 * 16, 64, False, True, 0, 0),
    # preload: the first tiles before the PDL wait; more than a split holds (300 / 4 -> 96 = 3 steps < 4),
    # a ragged last split (129 = 2 x 96 - 63), all of a split (2 steps), GEGLU with a loop left after it
    (50, 24, 300, True, False, 4, 4), (7, 33, 129, False, False, 2, 2), (50, 40, 72, True, False, 1, 1),
    (13, 2 * 20, 200, False, True, 1, 2), (19, 24, 128, False, False, 2, 2), (1, 16, 8, True, False, 1, 2)],
    ids=lambda v: str(v))
def test_skinny_linear_matches_f_linear(dev, m, n, k, bias, geglu, split, preload):
    g = torch.Generator().manual_seed(m * n + k + preload)
    x = torch.randn(m, k, generator=g).to(dev)
    w = torch.randn(n, k, generator=g).to(dev)
    b = torch.randn(n, generator=g).to(dev) if bias else None
    got = skinny_linear(x[None], w, b, geglu=geglu, block_n=16, block_k=32, split_k=split, preload=preload)
    want = F.linear(x, w, b)
    if geglu:
        gate, up = want.chunk(2, dim=-1)
        want = F.gelu(gate, approximate="tanh") * up
    assert got.shape == (1, *want.shape)
    assert (got[0] - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()


@pytest.mark.interpret
@pytest.mark.parametrize("geglu", [False, True], ids=["linear", "geglu"])
def test_every_gemm_candidate_computes_f_linear(dev, geglu):
    """Each launch configuration the GEMM picker may choose (looped K, split-K, one K slice per program, weight
    tiles requested before the PDL wait) gives
    F.linear (GeGLU after it) on a small odd shape: the picker checks a candidate against cuBLAS before
    timing it, this keeps unusable ones out of the list."""
    from flashrt_core.models.pi05.engine_gemm import CONFIGS, TMA_CONFIGS, _kwargs

    g = torch.Generator().manual_seed(7 + geglu)
    m, n, k = 11, 40, 1096  # k: more than one step of every BLOCK_K, with a ragged last step
    x = torch.randn(m, k, generator=g).to(dev)
    w = torch.randn((2 if geglu else 1) * n, k, generator=g).to(dev)
    b = None if geglu else torch.randn(n, generator=g).to(dev)
    want = F.linear(x, w, b)
    if geglu:
        gate, up = want.chunk(2, dim=-1)
        want = F.gelu(gate, approximate="tanh") * up
    for config in CONFIGS + TMA_CONFIGS:
        got = skinny_linear(x, w, b, geglu=geglu, **_kwargs(config))
        assert (got - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max(), config


@pytest.mark.interpret
def test_every_mid_gemm_candidate_computes_f_linear(dev):
    """The mid-size candidates (`MID_CONFIGS`, rows in programs of BLOCK_M, for SigLIP's 512-row GEMMs) on an
    odd shape: several row blocks with a ragged last one, a ragged K, a bias."""
    from flashrt_core.kernels._common import KernelInputError
    from flashrt_core.models.pi05.engine_gemm import MID_CONFIGS, _kwargs

    g = torch.Generator().manual_seed(11)
    m, n, k = 150, 72, 200
    x = torch.randn(m, k, generator=g).to(dev)
    w = torch.randn(n, k, generator=g).to(dev)
    b = torch.randn(n, generator=g).to(dev)
    want = F.linear(x, w, b)
    for config in MID_CONFIGS:
        got = skinny_linear(x, w, b, **_kwargs(config))
        assert (got - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max(), config
    with pytest.raises(KernelInputError, match="block_m"):
        skinny_linear(x, w, b, block_m=48)


@pytest.mark.interpret
def test_the_picker_routes_mid_rows_to_the_triton_gemm_only_with_mid_and_a_plain_product(dev, monkeypatch):
    """LinearPicker._run's rule: rows past SKINNY_MAX_M go to cuBLAS unless `mid` is on, and even then GeGLU and
    fused or deferred products stay with cuBLAS (their kernels are the skinny forms)."""
    from flashrt_core.models.pi05 import engine_gemm
    from flashrt_core.models.pi05.engine_gemm import MID_CONFIGS

    calls = []
    real = engine_gemm.skinny_linear
    monkeypatch.setattr(engine_gemm, "skinny_linear", lambda *a, **kw: calls.append(kw.get("block_m")) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(150, 40, generator=g).to(dev)
    w = torch.randn(24, 40, generator=g).to(dev)
    gu = torch.randn(48, 40, generator=g).to(dev)
    LinearPicker(dev, mode="triton")(x, w)
    assert calls == []  # mid off: cuBLAS
    got = LinearPicker(dev, mode="triton", mid=True)(x, w)
    assert calls == [MID_CONFIGS[0][7]]
    assert (got - F.linear(x, w)).abs().max() <= TOL["gemm_fp32"] * F.linear(x, w).abs().max()
    LinearPicker(dev, mode="triton", mid=True).geglu(x, gu)
    LinearPicker(dev, mode="triton", mid=True)(x, w, defer=True)
    assert calls == [MID_CONFIGS[0][7]]  # GeGLU, defer: cuBLAS still
    LinearPicker(dev, mode="triton", mid=True)(x[:50], w)
    assert calls == [MID_CONFIGS[0][7], None]  # skinny rows: the skinny form


def test_mid_gemm_candidates_are_offered_only_past_the_skinny_rows():
    from flashrt_core.models.pi05.engine_gemm import MID_CONFIGS, SKINNY_MAX_M

    picker = LinearPicker("cpu", mid=True)
    assert picker.candidates_for(NO_FUSION, 1024, m=SKINNY_MAX_M + 1) == MID_CONFIGS
    assert picker.candidates_for(NO_FUSION, 1024, m=50) == list(picker.candidates)
    assert all(c not in picker.candidates_for(NO_FUSION, 1024, m=50) for c in MID_CONFIGS)
    assert LinearPicker("cpu").mid is False


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k,bias,geglu,split,preload,fuse", [
    (50, 40, 72, True, False, 1, 0, ""), (7, 33, 136, False, False, 2, 1, ""), (13, 2 * 20, 200, False, True, 1, 1, ""),
    (50, 24, 96, True, False, 0, 0, ""), (9, 2 * 16, 64, False, True, 0, 0, ""), (19, 24, 128, False, False, 4, 0, ""),
    (13, 24, 64, False, False, 0, 0, "residual+emit"), (7, 33, 200, True, False, 2, 1, "residual"),
    (13, 2 * 20, 136, False, True, 2, 1, "norm")], ids=lambda v: str(v))
def test_skinny_linear_reads_its_weights_through_tma(dev, dtype, m, n, k, bias, geglu, split, preload, fuse):
    """tma=True: the weight tiles come through a tensor descriptor (rows and columns past the weight's end
    read as zeros; GEGLU's up half at a row offset; a ragged N of 33 and a last K step of 8 of 32) and the
    result is the pointer-loaded kernel's, with and without fusions, over the split modes."""
    g = torch.Generator().manual_seed(m * n + k + split)
    x, xs, w, *tail = fused_case(m, n // 2 if geglu else n, k, geglu, dtype, dev, seed=m + n + k)
    b = torch.randn(n, generator=g).to(dev, dtype) if bias else None
    normed = fuse == "norm"
    want, residual, emit = fused_want(x, w, b, geglu, fuse, tail, dev)
    got = skinny_linear(xs if normed else x, w, b, tma=True, geglu=geglu, block_n=16, block_k=32, split_k=split,
                        preload=preload, norm=tail[1] if normed else None, residual=residual, emit=emit)
    check_fused(got, want, emit, tail[-1], TOL["gemm_fp32" if dtype == torch.float32 and not fuse else
                                               "fused_gemm_fp32" if dtype == torch.float32 else "fused_gemm_bf16"])


def test_skinny_linear_refuses_what_tma_cannot_read(dev):
    """A TMA block is at most 256 per dim and needs 16-byte aligned rows; it preloads one tile at most and
    does not gather the rope epilogue's rows: each is a KernelInputError naming the reason."""
    from flashrt_core.kernels._common import KernelInputError
    x, w = torch.randn(5, 64, device=dev), torch.randn(32, 64, device=dev)
    with pytest.raises(KernelInputError, match="at most 256"):
        skinny_linear(x, w, tma=True, block_n=16, block_k=512)
    with pytest.raises(KernelInputError, match="preloads at most one"):
        skinny_linear(x, w, tma=True, block_n=16, block_k=32, preload=2)
    odd = torch.randn(5, 63, device=dev)
    with pytest.raises(KernelInputError, match="16-byte aligned"):
        skinny_linear(odd, torch.randn(32, 63, device=dev), tma=True, block_n=16, block_k=32)
    xr, wr, rope = qkv_rope_case(1, 5, 32, 2, 1, 8, torch.float32, dev, seed=4)
    with pytest.raises(KernelInputError, match="rope"):
        skinny_linear(xr, wr, tma=True, block_n=16, block_k=16, rope=rope)


def test_the_tma_candidates_join_the_tuning_only_when_asked():
    """LinearPicker(tma=True) offers TMA_CONFIGS besides CONFIGS and keeps its choices apart in the cache;
    the rope epilogue (gathered weight rows) is never offered a TMA candidate."""
    from flashrt_core.models.pi05.engine_gemm import CONFIGS, TMA_CONFIGS

    plain, tma = LinearPicker("cpu", preload=True), LinearPicker("cpu", preload=True, tma=True)
    assert plain.candidates == CONFIGS and tma.candidates == CONFIGS + TMA_CONFIGS
    assert (plain.cache_name, tma.cache_name) == ("linear_preload", "linear_preload_tma")
    assert LinearPicker("cpu", tma=True).cache_name == "linear_tma"
    without_preload = LinearPicker("cpu", tma=True).candidates
    assert [c for c in TMA_CONFIGS if not c[5]] == [c for c in without_preload if len(c) > 6]
    rope = Fusion(rope=QkvRope(*(torch.zeros(1),) * 6, 1, 1))
    assert not any(len(c) > 6 and c[6] for c in tma.candidates_for(rope))


def chunk_sums(v):
    """[ceil(N / 16), M] sums of squares over each 16 columns of v [..., N] (computed apart from the kernel)."""
    v = v.float().reshape(-1, v.shape[-1])
    return torch.stack([(v[:, j:j + 16] ** 2).sum(1) for j in range(0, v.shape[1], 16)])


def fused_case(m, n, k, geglu, dtype, dev, seed):
    """Random non-zero raw rows x, weights, AdaRMS scale / shift, residual, gate and the next norm's scale;
    `norm` is the RowNorm a producer would hand over (x scaled by 1 + scale, x's row sums, w @ shift)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, m, k, generator=g) * 3 + 0.5).to(dev, dtype)
    w = (torch.randn((2 if geglu else 1) * n, k, generator=g) / k ** 0.5).to(dev, dtype)
    scale, shift = (torch.randn(k, generator=g) * 0.5).to(dev, dtype), torch.randn(k, generator=g).to(dev, dtype)
    res = torch.randn(1, m, n, generator=g).to(dev, dtype)
    gate, following = torch.randn(n, generator=g).to(dev, dtype), (torch.randn(n, generator=g) * 0.5).to(dev, dtype)
    xs = (x.float() * (1 + scale.float())).to(dtype)
    norm = RowNorm(chunk_sums(x).to(dev), (shift.float() @ w.float().t()).contiguous(), 1e-6)
    return x, xs, w, (scale, shift), norm, res, gate, following


def fused_want(x, w, b, geglu, fuse, case_tail, dev):
    """What a skinny GEMM call with the fusions named in `fuse` ("norm", "residual", "emit") must give, from
    the separate reference ops: (want in fp32, the GatedResidual to pass, the RowStats to pass, its scale)."""
    (scale, shift), norm, res, gate, following = case_tail
    h = KR.ada_rms_norm_ref(x, scale, shift, 1e-6) if fuse.startswith("norm") else x
    want = F.linear(h.float(), w.float(), None if b is None else b.float())
    if geglu:
        gate_half, up = want.chunk(2, dim=-1)
        want = F.gelu(gate_half, approximate="tanh") * up
    residual = GatedResidual(res, gate) if "residual" in fuse else None
    if residual is not None:
        want = res.float() + want * gate.float()
    m, n = res.shape[-2:]
    emit = RowStats(following, torch.full_like(res, 7.0), torch.full((-(-n // 16), m), 7.0, device=dev)) \
        if "emit" in fuse else None
    return want, residual, emit


def check_fused(got, want, emit, following, tol):
    """The product within tol of its max; the row stats from the result as stored (rounded to its dtype)."""
    assert (got.float() - want).abs().max() <= tol * want.abs().max()
    if emit is not None:
        want_scaled = got.float() * (1 + following.float())
        assert (emit.scaled.float() - want_scaled).abs().max() <= tol * want_scaled.abs().max()
        want_sums = chunk_sums(got)
        assert (emit.sums - want_sums).abs().max() <= 1e-5 * want_sums.abs().max()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k,bias,geglu,split,fuse", [
    (50, 40, 72, True, False, 1, "norm"), (7, 33, 129, False, False, 2, "norm"), (13, 20, 70, False, True, 2, "norm"),
    (9, 16, 64, False, True, 0, "norm"), (50, 24, 96, True, False, 0, "norm"),
    (50, 40, 72, False, False, 1, "residual"), (7, 33, 100, True, False, 4, "residual"),
    (13, 24, 64, False, False, 0, "residual+emit"), (19, 40, 50, True, False, 2, "emit"),
    (50, 33, 40, False, False, 1, "residual+emit"), (13, 20, 130, False, True, 1, "norm+preload"),
    (7, 33, 200, True, False, 2, "residual+emit+preload")], ids=lambda v: str(v))
def test_skinny_linear_fuses_adarms_and_the_gated_residual(dev, dtype, m, n, k, bias, geglu, split, fuse):
    """norm=RowNorm: the GEMM of AdaRMS(x) from x * (1 + scale) and x's row sums (the product scaled per row,
    the shift as w @ shift); residual=GatedResidual: res += gate * result in place; emit=RowStats: also the
    next norm's scaled input and row sums of the result as stored. Against the separate reference ops,
    over every split mode (one program per K, split-K, one BLOCK_K slice per program, tiles preloaded)."""
    x, xs, w, *tail = fused_case(m, n, k, geglu, dtype, dev, seed=m + 7 * n + k)
    b = torch.randn(n).to(dev, dtype) if bias else None
    normed = fuse.startswith("norm")
    want, residual, emit = fused_want(x, w, b, geglu, fuse, tail, dev)
    got = skinny_linear(xs if normed else x, w, b, geglu=geglu, block_n=16, block_k=32, split_k=split,
                        preload=2 if "preload" in fuse else 0, norm=tail[1] if normed else None, residual=residual,
                        emit=emit)
    if residual is not None:
        assert got is tail[2]  # updated in place
    check_fused(got, want, emit, tail[-1], TOL["fused_gemm_fp32" if dtype == torch.float32 else "fused_gemm_bf16"])


def test_linear_picker_torch_route_gives_the_same_fusions():
    """On the CPU (cuBLAS route) norm=, residual= and emit= are done by torch ops around F.linear."""
    x, xs, w, (scale, shift), norm, res, gate, following = fused_case(11, 24, 40, False, torch.float32, "cpu", seed=3)
    picker = LinearPicker("cpu", mode="torch")
    want = F.linear(KR.ada_rms_norm_ref(x, scale, shift), w)
    torch.testing.assert_close(picker(xs, w, norm=norm), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    emit = RowStats(following, torch.zeros_like(res), torch.zeros(2, 11))
    want = res + F.linear(x, w) * gate
    got = picker(x, w, residual=GatedResidual(res, gate), emit=emit)
    assert got is res
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(emit.scaled, want * (1 + following), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(emit.sums, chunk_sums(want), rtol=1e-6, atol=1e-5)


def qkv_rope_case(bsz, t, k, hq, hkv, dh, dtype, dev, seed, cache_rows=None):
    """Random rows x [B, T, K], a fused QKV weight, positions (one outside the tables: left unrotated) and
    output buffers filled with a sentinel (k / v with spare rows that must stay untouched)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(bsz, t, k, generator=g) + 0.25).to(dev, dtype)
    w = (torch.randn((hq + 2 * hkv) * dh, k, generator=g) / k ** 0.5).to(dev, dtype)
    cos, sin = (v.to(dev) for v in KR.rope_cos_sin(3 * t, dh, 10000.0))
    positions = torch.randint(0, 3 * t, (bsz, t), generator=g)
    positions[-1, -1] = 3 * t + 4  # outside the tables
    rows = cache_rows or t + 2
    rope = QkvRope(positions.to(dev), cos, sin, torch.full((bsz, t, hq, dh), 7.0, device=dev, dtype=dtype),
                   torch.full((bsz, hkv, rows, dh), 7.0, device=dev, dtype=dtype),
                   torch.full((bsz, hkv, rows, dh), 7.0, device=dev, dtype=dtype), hq, hkv)
    return x, w, rope


def qkv_rope_want(x, w, rope, norm_input=None):
    """F.linear in fp32, then the rotation reference into fresh caches (the same spare rows)."""
    y = F.linear((norm_input if norm_input is not None else x).float(), w.float())
    k, v = torch.full_like(rope.k, 7.0, dtype=torch.float32), torch.full_like(rope.v, 7.0, dtype=torch.float32)
    q = KR.qkv_rope_cache_ref(y, rope.positions, rope.cos, rope.sin, k, v, 0, num_q_heads=rope.num_q_heads,
                              num_kv_heads=rope.num_kv_heads)
    return q, k, v


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bsz,t,k,hq,hkv,dh,block_n,split,normed", [
    (1, 7, 40, 2, 1, 16, 16, 1, False), (2, 5, 72, 3, 1, 16, 16, 2, False), (1, 9, 64, 4, 2, 8, 16, 0, False),
    (2, 3, 48, 2, 1, 32, 32, 0, True), (1, 6, 96, 2, 1, 16, 8, 3, True), (2, 5, 72, 3, 1, 16, 16, -2, False),
    (1, 6, 96, 2, 1, 16, 8, -1, True)], ids=lambda v: str(v))
def test_skinny_linear_fuses_the_qkv_split_rope_and_cache_write(dev, dtype, bsz, t, k, hq, hkv, dh, block_n, split,
                                                                  normed):
    """rope=QkvRope: the fused QKV GEMM writes q rotated [B, T, Hq, Dh] and k rotated / v copied into rows
    0..T-1 of their caches (spare rows untouched), as F.linear then the split/rotate reference; over tiles
    that span heads (block_n > Dh / 2), split-K, one K slice per program and the fused AdaRMS (norm=)."""
    x, w, rope = qkv_rope_case(bsz, t, k, hq, hkv, dh, dtype, dev, seed=bsz * 100 + t * 10 + k + dh)
    norm, h = None, None
    if normed:
        raw, xs, w, (scale, shift), norm, *_ = fused_case(bsz * t, w.shape[0], k, False, dtype, dev, seed=t + k)
        x, h = xs.view(bsz, t, k), KR.ada_rms_norm_ref(raw.view(bsz, t, k), scale, shift, 1e-6)
    q_want, k_want, v_want = qkv_rope_want(x, w, rope, h)
    preload = 2 if split < 0 else 0  # split -s: split-K s with the first two weight tiles before the PDL wait
    got = skinny_linear(x, w, block_n=block_n, block_k=16, split_k=abs(split), rope=rope, norm=norm,
                        preload=preload)
    assert got is rope.q
    tol = TOL["qkv_rope_fp32" if dtype == torch.float32 else "qkv_rope_bf16"]
    for name, out, want in (("q", rope.q, q_want), ("k", rope.k, k_want), ("v", rope.v, v_want)):
        assert (out.float() - want).abs().max() <= tol * want.abs().max(), name
    assert bool((rope.k[:, :, t:] == 7.0).all()) and bool((rope.v[:, :, t:] == 7.0).all())


def test_linear_picker_torch_route_fuses_the_qkv_rope():
    """On the CPU (cuBLAS route) qkv_rope is F.linear and the split/rotate reference, into the given buffers."""
    x, w, rope = qkv_rope_case(2, 5, 24, 2, 1, 8, torch.float32, "cpu", seed=4)
    q_want, k_want, v_want = qkv_rope_want(x, w, rope)
    got = LinearPicker("cpu", mode="torch").qkv_rope(x, w, rope)
    assert got is rope.q
    for out, want in ((rope.q, q_want), (rope.k, k_want), (rope.v, v_want)):
        torch.testing.assert_close(out, want, rtol=0, atol=TOL["qkv_rope_fp32"] * float(want.abs().max()))


def test_qkv_rope_tuning_offers_the_fused_twin_of_each_plain_tiling():
    """The rope epilogue's BLOCK_N counts rotate-half pairs (2 x BLOCK_N weight rows per program), so its
    candidates are the plain ones plus each at half the BLOCK_N; other calls get the plain list unchanged."""
    from flashrt_core.models.pi05.engine_gemm import NO_FUSION, Fusion

    _, _, rope = qkv_rope_case(1, 5, 32, 2, 1, 8, torch.float32, "cpu", seed=2)
    for preload in (False, True):
        picker = LinearPicker("cpu", preload=preload)
        plain, fused = picker.candidates_for(NO_FUSION), picker.candidates_for(Fusion(rope=rope))
        assert plain == picker.candidates
        assert fused[:len(plain)] == plain and len(set(fused)) == len(fused)
        twins = [(c[0] // 2, *c[1:]) for c in plain if c[0] >= 32]
        assert set(fused) == set(plain) | set(twins) and all(c[0] >= 16 for c in fused)
    assert (16, 128, 1, 4, 4, 2) in LinearPicker("cpu", preload=True).candidates_for(Fusion(rope=rope))
    assert (16, 128, 1, 4, 4, 2) not in LinearPicker("cpu", preload=True).candidates


@pytest.mark.interpret
def test_skinny_linear_rejects_a_mismatched_qkv_rope(dev):
    from flashrt_core.kernels._common import KernelInputError

    x, w, rope = qkv_rope_case(1, 5, 32, 2, 1, 8, torch.float32, dev, seed=2)
    with pytest.raises(KernelInputError, match="no bias"):
        skinny_linear(x, w, torch.ones(w.shape[0], device=dev), rope=rope)
    with pytest.raises(KernelInputError, match="head dim rows"):
        skinny_linear(x, w[:-4], rope=rope)  # head dim 7
    with pytest.raises(KernelInputError, match="positions"):
        skinny_linear(x, w, rope=dataclasses.replace(rope, positions=rope.positions[:, :-1].contiguous()))
    with pytest.raises(KernelInputError, match="rope k"):
        skinny_linear(x, w, rope=dataclasses.replace(rope, k=rope.k[:, :, :3]))
    with pytest.raises(KernelInputError, match="rope q"):
        skinny_linear(x, w, rope=dataclasses.replace(rope, q=rope.q.double()))
    with pytest.raises(KernelInputError, match="rope cos"):
        skinny_linear(x, w, rope=dataclasses.replace(rope, cos=rope.cos[:, :-1].contiguous()))


@pytest.mark.interpret
def test_skinny_linear_rejects_mismatched_fusion_inputs(dev):
    from flashrt_core.kernels._common import KernelInputError

    x, xs, w, _, norm, res, gate, following = fused_case(5, 16, 32, False, torch.float32, dev, seed=1)
    with pytest.raises(KernelInputError, match="shift_w"):
        skinny_linear(xs, w, norm=RowNorm(norm.sums, norm.shift_w[:-1], 1e-6))
    with pytest.raises(KernelInputError, match="norm sums"):
        skinny_linear(xs, w, norm=RowNorm(norm.sums[:, :-1], norm.shift_w, 1e-6))
    with pytest.raises(KernelInputError, match="residual must be"):
        skinny_linear(x, w, residual=GatedResidual(res[:, :-1], gate))
    with pytest.raises(KernelInputError, match="gate"):
        skinny_linear(x, w, residual=GatedResidual(res, gate[:-1]))
    with pytest.raises(KernelInputError, match="sums"):
        skinny_linear(x, w, emit=RowStats(following, torch.empty_like(res), torch.empty(2, 5, device=dev)))
    with pytest.raises(KernelInputError, match="multiple of 16"):
        skinny_linear(x, w, block_n=24, emit=RowStats(following, torch.empty_like(res), torch.empty(1, 5, device=dev)))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k,split", [(50, 40, 72, 1), (7, 48, 129, 2), (13, 24, 300, 4), (5, 16, 96, 0),
                                         (19, 40, 200, 3)], ids=str)
def test_deferred_partials_add_up_to_the_reduced_gemm_bit_for_bit(dev, dtype, m, n, k, split):
    """skinny_linear(defer=True) leaves its split-K partials; summed by the gated residual + AdaRMS kernel (and
    by its torch reference) they give exactly what the GEMM's own in-kernel reduction stores, and the
    norm's outputs are then bit-identical to those after the reduced GEMM."""
    from flashrt_core import kernels as K
    from flashrt_core.models.pi05.engine_gemm import splits

    g = torch.Generator().manual_seed(m + n + k + split)
    x = torch.randn(2, m, k, generator=g).to(dev, dtype)
    w = (0.2 * torch.randn(n, k, generator=g)).to(dev, dtype)
    res = torch.randn(2, m, n, generator=g).to(dev, dtype)
    gate, scale, shift = (torch.randn(n, generator=g).to(dev, dtype) for _ in range(3))
    kw = dict(block_n=16, block_k=32, split_k=split)
    parts = skinny_linear(x, w, defer=True, **kw)
    reduced = skinny_linear(x, w, **kw)
    assert isinstance(parts, K.Partials) and parts.splits == splits((16, 32, split), k)
    assert parts.splits == (-(-k // 32) if split == 0 else split) or k % 32  # (a ragged K may need fewer)
    assert parts.data.abs().min(0).values.max() > 0  # every split contributed
    # The Triton kernels round fp32 -> bf16 alike (the interpreter truncates, the GPU rounds to nearest;
    # torch rounds to nearest): bit for bit between the two kernel paths, in fp32 with torch too.
    exact = dtype == torch.float32 or not interpreting()
    tol = TOL["gemm_fp32"] if dtype == torch.float32 else 2e-2
    total = parts.total()
    assert torch.equal(total, reduced) if exact else (total.float() - reduced.float()).abs().max() <= \
        2 ** -7 * reduced.float().abs().max()
    want = F.linear(x.float(), w.float())
    assert (total.float() - want).abs().max() <= tol * want.abs().max()
    for backend in ("triton", "torch"):
        got = K.gated_residual_ada_rms_norm(res, parts, gate, scale, shift, 1e-6, backend=backend)
        ref = K.gated_residual_ada_rms_norm(res, reduced, gate, scale, shift, 1e-6, backend=backend)
        if backend == "triton" or exact:
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), backend
        else:
            for a, b in zip(got, ref):
                assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
    assert torch.equal(K.gated_residual(res, parts, gate, backend="triton"),
                       K.gated_residual(res, reduced, gate, backend="triton"))


@pytest.mark.interpret
def test_deferred_partials_refuse_what_they_cannot_carry(dev):
    """defer= is for a plain product (a bias or a fusion would need the sum first), and a reader refuses
    partials that do not fit its rows, with a KernelInputError naming the problem."""
    from flashrt_core import kernels as K
    from flashrt_core.kernels import KernelInputError

    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(6, 64, generator=g).to(dev), torch.randn(32, 64, generator=g).to(dev), \
        torch.randn(32, generator=g).to(dev)
    with pytest.raises(KernelInputError, match="defer"):
        skinny_linear(x, w, b, defer=True)
    with pytest.raises(KernelInputError, match="defer"):
        skinny_linear(x, w.repeat(2, 1), geglu=True, defer=True)
    with pytest.raises(KernelInputError, match="defer"):
        LinearPicker(dev)(x, w, b, defer=True)
    parts = skinny_linear(x, w, defer=True, block_n=16, block_k=16, split_k=2)
    res, vec = torch.randn(6, 32, generator=g).to(dev), torch.randn(32, generator=g).to(dev)
    for wrong in (torch.randn(7, 32).to(dev), res.half(), torch.randn(6, 16).to(dev)):
        with pytest.raises(KernelInputError, match="partials"):
            K.gated_residual_ada_rms_norm(wrong, parts, vec, vec, vec, backend="triton")
    bad = K.Partials(parts.data.to(torch.bfloat16), parts.dtype, parts.shape)
    with pytest.raises(KernelInputError, match="partials"):
        K.gated_residual_ada_rms_norm(res, bad, vec, vec, vec, backend="triton")


def test_deferred_tuning_offers_only_short_reductions():
    """With defer the picker offers the candidates of at most DEFER_MAX_SPLITS splits at the call's K (its
    reader loads every partial); `splits` counts them as skinny_linear lays them out."""
    from flashrt_core.models.pi05.engine_gemm import CONFIGS, DEFER_MAX_SPLITS, splits

    picker = LinearPicker("cpu", preload=True)
    assert splits((32, 128, 0, 4, 1), 4096) == 32 and splits((32, 512, 0, 4, 1), 4096) == 8
    assert splits((16, 256, 4, 4, 3), 1024) == 4 and splits((16, 32, 3), 200) == 3 and splits((16, 32, 4), 40) == 2
    for k in (1024, 2048, 4096):
        offered = picker.candidates_for(Fusion(defer=True), k)
        assert offered and all(splits(c, k) <= DEFER_MAX_SPLITS for c in offered)
        assert set(offered) == {c for c in CONFIGS if splits(c, k) <= DEFER_MAX_SPLITS}
    assert picker.candidates_for(Fusion(defer=True)) == picker.candidates_for(NO_FUSION)
    assert Fusion(defer=True).tags(torch.bfloat16) == ("defer",)


@pytest.mark.interpret
def test_deferred_reductions_give_the_same_actions(dev):
    """reduce_in_norm / reduce_in_rotate (the o / down GEMMs leave their partials to the norm kernel after
    them, the QKV GEMM to the split/rotate kernel): bit-for-bit the actions of the engine without them, with
    the Triton kernels and on the torch route; off where their readers are not used."""
    config, state = pi05.build_tiny(5, micro_config())
    weights = pi05.convert(config, state)
    inputs = [t.to(dev) for t in micro_inputs(config, seed=8)]
    for backend, gemm in (("triton", "triton"), ("torch", "torch")):
        kw = dict(device=dev, backend=backend, gemm=gemm, graphs=False)
        plain = Pi05Engine(weights, reduce_in_norm=False, reduce_in_rotate=False, **kw)
        deferred = Pi05Engine(weights, **kw)  # (both on: the default)
        assert deferred.reduce_in_norm and deferred.reduce_in_rotate
        assert not (plain.reduce_in_norm or plain.reduce_in_rotate)
        with torch.no_grad():
            want = plain.sample_actions(*inputs)
            assert want.abs().max() > 0
            assert torch.equal(deferred.sample_actions(*inputs), want), backend
    for other in ("norm_in_gemm", "rope_in_gemm", "rope_in_attention"):
        engine = Pi05Engine(weights, device=dev, graphs=False, reduce_in_rotate=True, **{other: True})
        assert not engine.reduce_in_rotate and engine.reduce_in_norm == (other != "norm_in_gemm")


@pytest.mark.interpret
def test_split_k_tickets_are_reset_so_a_workspace_serves_call_after_call(dev):
    """The last program of each tile reduces the split partials and resets its ticket: a shared workspace
    is all zero again after every call, and repeated calls give bit-identical results."""
    from flashrt_core.kernels._common import new_semaphore_workspace, semaphore_workspace

    g = torch.Generator().manual_seed(7)
    x, w, b = (torch.randn(*s, generator=g).to(dev) for s in ((37, 96), (40, 96), (40,)))
    tickets = new_semaphore_workspace(dev, 64)
    with semaphore_workspace(tickets):
        first = skinny_linear(x, w, b, block_n=16, block_k=16, split_k=3)
        assert int(tickets.abs().sum()) == 0
        second = skinny_linear(x, w, b, block_n=16, block_k=16, split_k=3)
    assert int(tickets.abs().sum()) == 0
    assert torch.equal(first, second)
    want = F.linear(x, w, b)
    assert (first - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()


def test_linear_picker_modes_route_to_cublas_on_cpu():
    picker = LinearPicker("cpu", mode="torch")
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(picker(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="gemm"):
        LinearPicker("cpu", mode="fast")


# ---- CUDA graphs --------------------------------------------------------------------------------------------
def cuda_case(cases):
    """The two-view padded-prompt case on the GPU (compiled kernels only: graphs and tuning need them)."""
    if interpreting():
        pytest.skip("CUDA graphs and tuning need compiled kernels (run with TRITON_INTERPRET=0)")
    return {k: v.cuda() for k, v in cases["two_views_padded_prompt"].items()}


def decision_graphs(engine) -> int:
    """Graphs a whole decision (sample_actions) captures: one (overlap_decision), else observe and act."""
    return 1 if engine.overlap_decision else 2


@pytest.mark.gpu
def test_cuda_graphs_match_eager_and_never_recapture(fixture_weights, cases):
    c = cuda_case(cases)
    graphed = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16)
    eager = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16, graphs=False, gemm="torch")
    a = graphed.sample_actions(*_inputs(c), c["noise"])
    assert graphed.captures == decision_graphs(graphed)
    b = eager.sample_actions(*_inputs(c), c["noise"])
    assert rel_l2(a, b) <= TOL["graph_vs_eager"]
    assert cosine(a, c["actions"]) >= TOL["bf16_cosine"] and rel_l2(a, c["actions"]) <= TOL["bf16_rel_l2"]
    # A new, shorter prompt and new noise replay the same graphs.
    n = 5
    again = graphed.sample_actions(c["images"], c["image_masks"], c["lang_tokens"][:, :n], c["lang_mask"][:, :n],
                                   c["noise"] * 0.5)
    want = R.sample_actions(fixture_weights.to("cuda"), c["images"], c["image_masks"], c["lang_tokens"][:, :n],
                            c["lang_mask"][:, :n], c["noise"] * 0.5)
    assert graphed.captures == decision_graphs(graphed)
    assert cosine(again, want) >= TOL["bf16_cosine"] and rel_l2(again, want) <= TOL["bf16_rel_l2"]


@pytest.mark.gpu
def test_the_overlapped_decision_graph_matches_the_two_stage_graphs(fixture_weights, cases, tmp_path):
    """overlap_decision: one graph with the act stage on a second stream, ordered after each prefix layer by
    events. Same launch choices (shared tuning cache) -> the same actions as observe + act; a second
    observation must reach the first flow step (a missing event would let it read the previous prefix)."""
    c = cuda_case(cases)
    staged = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16, tuning_cache=tmp_path,
                        overlap_decision=False)
    overlapped = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16, tuning_cache=tmp_path,
                            overlap_decision=True)
    n = 5
    second = (c["images"].flip(-1), c["image_masks"], c["lang_tokens"][:, :n], c["lang_mask"][:, :n])
    for n_call, (inputs, noise) in enumerate(((_inputs(c), c["noise"]), (second, c["noise"] * 0.5),
                                              (_inputs(c), c["noise"]))):
        want = staged.sample_actions(*inputs, noise)
        got = overlapped.sample_actions(*inputs, noise)
        if n_call == 0:
            assert overlapped.captures == 1 and list(overlapped._graphs) == ["decision"]
        prefix_k = overlapped.buffers.prefix_k.clone()
        overlapped.observe()  # the same engine's own two stage graphs on the same buffers
        overlapped.act()
        own = overlapped.buffers.actions.clone()
        print(f"overlapped vs staged {rel_l2(got, want):.3g}, vs its own stage graphs {rel_l2(got, own):.3g} "
              f"(max abs {(got - own).abs().max().item():.3g}); prefix K equal: "
              f"{torch.equal(prefix_k, staged.buffers.prefix_k)}, {torch.equal(prefix_k, overlapped.buffers.prefix_k)}")
        assert torch.equal(prefix_k, overlapped.buffers.prefix_k)
        # the same kernels with the same choices: bit for bit (a missing event would read a stale or
        # half-written prefix layer)
        assert torch.equal(got, own) and rel_l2(got, want) <= TOL["graph_vs_eager"]
    assert overlapped.captures == 3 and {"decision", "observe", "act"} <= set(overlapped._graphs)
    with torch.no_grad():
        ref = R.sample_actions(fixture_weights.to("cuda"), *second, c["noise"] * 0.5)
    got = overlapped.sample_actions(*second, c["noise"] * 0.5)
    assert cosine(got, ref) >= TOL["bf16_cosine"] and rel_l2(got, ref) <= TOL["bf16_rel_l2"]


@pytest.mark.gpu
def test_run_decision_with_a_hook_that_waits_for_the_device_falls_back_to_the_stage_graphs(fixture_weights, cases):
    """A decision hook that reads a value on the host cannot be captured: run_decision says so once and from
    then on runs the hooks around the stage graphs, with the same results (and nothing left running on the
    act stream from the refused warm-up)."""
    from flashrt_core.models.pi05.engine import DecisionHooks

    c = cuda_case(cases)
    engine = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16)
    want = engine.sample_actions(*_inputs(c), c["noise"]).clone()
    out, seen = torch.zeros_like(want), []

    def act_post():
        seen.append(float(engine.buffers.actions.abs().max()))  # a host read: a sync
        out.copy_(engine.buffers.actions)
    for _ in range(2):
        out.zero_()
        engine.set_observation(*_inputs(c))
        engine.buffers.noise.copy_(c["noise"])
        engine.run_decision(DecisionHooks(act_post=act_post), key="host-read")
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert ("decision", "host-read") in engine.hook_capture_errors and ("decision", "host-read") not in engine._graphs
    assert seen and all(v > 0 for v in seen)


@pytest.mark.gpu
def test_a_restarted_engine_reuses_the_tuned_choices(fixture_weights, cases, tmp_path):
    c = cuda_case(cases)
    first = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16, tuning_cache=tmp_path)
    a = first.sample_actions(*_inputs(c), c["noise"])
    assert first.linear.choices and first.attend.choices and list(tmp_path.glob("*.json"))
    second = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16, tuning_cache=tmp_path)
    # (the act-graph ranking of the deferred GEMMs is cached too: the second engine times none of them)
    assert first.rerank_timings and all(len(t) >= 2 for t in first.rerank_timings.values())
    assert second.tuning_cache.loaded_from_disk == (len(first.linear.choices) + len(first.attend.choices)
                                                    + len(first.rerank_timings))
    b = second.sample_actions(*_inputs(c), c["noise"])
    assert second.rerank_timings == {}
    assert second.linear.choices == first.linear.choices and second.attend.choices == first.attend.choices
    assert all(t.get("from_cache") for t in [*second.linear.timings.values(), *second.attend.timings.values()])
    assert rel_l2(b, a) <= TOL["restart"]


@pytest.mark.gpu
@pytest.mark.parametrize("flag", ["rope_in_attention", "norm_in_gemm", "l2_prefetch", "rope_in_gemm", "gemm_preload",
                                  "early_modulation", "early_positions", "fused_euler", "gemm_tma",
                                  "reduce_in_norm", "reduce_in_rotate", "overlap_decision", "gemm_mid",
                                  "patch_gemm", "gelu_epilogue", "rerank_in_graph"])
def test_engine_variants_graphs_match_the_default_graphs(fixture_weights, cases, flag):
    """An engine flag that changes the expert's kernels (rope on attention load; AdaRMS norms and gated
    residuals inside the GEMMs, tuned and captured; L2 prefetches in the glue kernels; split / rope / K/V
    write in the QKV GEMM's epilogue; GEMM candidates that load weights before the PDL wait; the norms'
    modulation read before it) gives the default engine's actions, and LeRobot's within the bf16 targets."""
    c = cuda_case(cases)
    default = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16)
    flipped = {flag: not inspect.signature(Pi05Engine).parameters[flag].default}
    variant = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16, **flipped)
    a = default.sample_actions(*_inputs(c), c["noise"])
    b = variant.sample_actions(*_inputs(c), c["noise"])
    assert variant.captures == decision_graphs(variant) and rel_l2(b, a) <= TOL["graph_vs_eager"]
    assert cosine(b, c["actions"]) >= TOL["bf16_cosine"] and rel_l2(b, c["actions"]) <= TOL["bf16_rel_l2"]
    if flag == "rope_in_gemm":  # the QKV GEMM with its epilogue was tuned (the picker may keep cuBLAS +
        # rotate), and the fused epilogue itself runs captured: gemm="triton" takes a skinny configuration
        assert any("rope" in key for key in variant.linear.choices)
        forced = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16, gemm="triton", rope_in_gemm=True)
        f = forced.sample_actions(*_inputs(c), c["noise"])
        assert forced.captures == decision_graphs(forced) and rel_l2(f, a) <= TOL["graph_vs_eager"]
        assert cosine(f, c["actions"]) >= TOL["bf16_cosine"] and rel_l2(f, c["actions"]) <= TOL["bf16_rel_l2"]
    if flag == "gemm_mid":  # the picker may keep cuBLAS for every mid shape: force the mid kernels once
        forced = Pi05Engine(fixture_weights, device="cuda", dtype=torch.bfloat16, gemm="triton", gemm_mid=True)
        f = forced.sample_actions(*_inputs(c), c["noise"])
        assert rel_l2(f, a) <= TOL["graph_vs_eager"]
        assert cosine(f, c["actions"]) >= TOL["bf16_cosine"] and rel_l2(f, c["actions"]) <= TOL["bf16_rel_l2"]
    if flag in ("reduce_in_norm", "reduce_in_rotate"):  # (on by default) the flipped engine tuned fewer GEMMs
        # as deferred reductions: the o / down ones, or the QKV one, are plain products there
        assert sum("defer" in key for key in variant.linear.choices) < \
            sum("defer" in key for key in default.linear.choices)
    if flag == "norm_in_gemm":  # the fused GEMM variants were tuned (not only the plain shapes)
        assert any("emit" in key for key in variant.linear.choices)
        assert any("norm" in key for key in variant.linear.choices)
