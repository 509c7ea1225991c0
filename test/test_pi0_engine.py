"""The fused pi0 engine (`flashrt_core.models.pi0.engine.Pi0Engine`) against LeRobot 0.6.1's golden outputs and
the project's fp32 eager pi0 reference.

As for pi0.5 (test_pi05_engine.py), three paths run the same engine code: the kernels' torch references on
the CPU (backend="torch") on the tiny LeRobot fixture, the Triton kernels in the CPU interpreter on a micro
model, and (marked gpu) compiled Triton with CUDA graphs.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first kernel-module import

import pytest  # noqa: E402
import torch  # noqa: E402

from flashrt_core.errors import InputError  # noqa: E402
from flashrt_core.kernels._common import interpreting  # noqa: E402
from flashrt_core.models import pi0, pi05  # noqa: E402
from flashrt_core.models.pi0 import reference as R  # noqa: E402
from flashrt_core.models.pi0.engine import Pi0Engine  # noqa: E402
import kernel_testing  # noqa: E402
from kernel_testing import dev  # noqa: E402,F401  (the kernel device fixture: interpreter or CUDA)
from lerobot_cases import PI05_CASES, cosine, model_inputs, rel_l2  # noqa: E402

TOL = {
    "fp32_vs_lerobot": 1e-4,  # absolute: fp32 engine (torch path) vs LeRobot golden actions
    "fp32_vs_reference": 1e-3,  # absolute: fp32 engine (Triton interpreter) vs the fp32 eager reference
    "bf16_cosine": 0.999,  # bf16 engine vs the fp32 reference: action cosine at least
    "bf16_rel_l2": 2e-2,  # ... and relative L2 error at most
    # relative L2: the graphed bf16 engine (GEMMs picked per shape) vs the eager one with cuBLAS only
    "graph_vs_eager": 3e-3,
}




# ---- CPU path (the kernels' torch references) --------------------------------------------------------------
@pytest.mark.parametrize("name", PI05_CASES)
def test_cpu_engine_matches_lerobot(pi0_weights, pi0_cases, name):
    c = pi0_cases[name]
    engine = Pi0Engine(pi0_weights, backend="torch")
    actions = engine.sample_actions(*model_inputs(c), c["state_padded"], c["noise"])
    err = (actions - c["actions"]).abs().max().item()
    assert err < TOL["fp32_vs_lerobot"], f"{name}: max abs error {err:.3g}"


def test_staged_api_reads_a_fresh_state_over_the_cached_prefix(pi0_weights, pi0_cases):
    """encode_prefix once, then denoise with several states: each equals the whole decision with that state;
    a state of fewer values than max_state_dim is zero padded (as LeRobot pads it)."""
    c = pi0_cases["two_views_padded_prompt"]
    engine = Pi0Engine(pi0_weights, backend="torch")
    prefix = engine.encode_prefix(*model_inputs(c))
    assert prefix.k.data_ptr() == engine.buffers.prefix_k.data_ptr()
    first = engine.denoise(prefix, c["state_padded"], c["noise"])
    assert (first - c["actions"]).abs().max() < TOL["fp32_vs_lerobot"]
    moved = c["state_padded"].clone()
    moved[0, :3] += torch.tensor([0.4, -0.3, 0.2])
    with torch.no_grad():
        want = R.sample_actions(pi0_weights, *model_inputs(c), moved, c["noise"])
    got = engine.denoise(prefix, moved, c["noise"])
    assert (got - want).abs().max() < TOL["fp32_vs_lerobot"] and (got - first).abs().max() > 1e-3
    short = engine.denoise(prefix, c["state_raw"], c["noise"])
    assert (short - first).abs().max() < 1e-6


def test_bad_inputs_are_refused_before_anything_is_written(pi0_weights, pi0_cases):
    c = pi0_cases["two_views_padded_prompt"]
    engine = Pi0Engine(pi0_weights, backend="torch")
    engine.sample_actions(*model_inputs(c), c["state_padded"], c["noise"])
    kept = {n: getattr(engine.buffers, n).clone() for n in ("images", "state", "noise", "prefix_k")}
    bad_states = {"at most 32": torch.zeros(1, 33), "batch": torch.zeros(2, 8), "floats": torch.zeros(1, 8).long(),
                  "NaN": torch.full((1, 8), float("nan")), "shape": torch.zeros(8)}
    for match, state in bad_states.items():
        with pytest.raises(InputError, match=match):
            engine.sample_actions(*model_inputs(c), state, c["noise"])
    with pytest.raises(InputError, match="noise"):
        engine.sample_actions(*model_inputs(c), c["state_padded"], c["noise"][:, :-1])
    for name, t in kept.items():
        assert torch.equal(getattr(engine.buffers, name), t), f"{name} changed by a refused call"
    with pytest.raises(ValueError, match="Pi05Engine"):
        Pi0Engine(pi05.convert(*pi05.build_tiny(0)), backend="torch")


def test_policy_load_takes_the_fused_engine_when_asked(fixtures_dir, pi0_cases, model_ckpt):
    """engine "auto" is the reference on a CPU (fused on CUDA); "fused" is the fused engine anywhere."""
    assert pi0.load(model_ckpt["pi0"]).engine.name == "reference"
    assert pi0.policy.resolve_engine("auto", "cuda") == "fused"
    policy = pi0.load(model_ckpt["pi0"], engine="fused")
    assert isinstance(policy.engine, Pi0Engine)
    policy.engine.backend = "torch"
    c = pi0_cases["one_view_240x320_two_missing"]
    images, masks, tokens, lang_mask = model_inputs(c)
    out = policy.sample_actions(list(images.unbind(1)), list(masks.unbind(1)), tokens, lang_mask,
                                c["state_padded"], noise=c["noise"])
    assert (out - c["actions"]).abs().max().item() < TOL["fp32_vs_lerobot"]
    with pytest.raises(ValueError, match="not available for pi0"):
        pi0.load(model_ckpt["pi0"], engine="turbo")


# ---- Triton kernels (interpreter on CPU, compiled on CUDA) ------------------------------------------------
def micro_config():
    return kernel_testing.micro_config("pi0")


def micro_inputs(config, seed=0):
    return kernel_testing.micro_inputs(config, seed)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_engine_matches_reference(dev, dtype):
    config, state = pi05.build_tiny(5, micro_config())
    weights = pi0.convert(config, state)
    inputs = micro_inputs(config)
    with torch.no_grad():
        want = R.sample_actions(weights, *inputs)
    engine = Pi0Engine(weights, device=dev, dtype=dtype, backend="triton", gemm="triton", graphs=False)
    got = engine.sample_actions(*(t.to(dev) for t in inputs)).cpu()
    if dtype == torch.float32:
        assert (got - want).abs().max() < TOL["fp32_vs_reference"]
    else:
        assert cosine(got, want) >= TOL["bf16_cosine"] and rel_l2(got, want) <= TOL["bf16_rel_l2"]
    # the staged path: the prefix once, then act with another state
    other = inputs[4] * -0.5
    with torch.no_grad():
        want = R.sample_actions(weights, *inputs[:4], other, inputs[5])
    prefix = engine.encode_prefix(*(t.to(dev) for t in inputs[:4]))
    got = engine.denoise(prefix, other.to(dev), inputs[5].to(dev)).cpu()
    if dtype == torch.float32:
        assert (got - want).abs().max() < TOL["fp32_vs_reference"]
    else:
        assert cosine(got, want) >= TOL["bf16_cosine"] and rel_l2(got, want) <= TOL["bf16_rel_l2"]


# ---- CUDA: graphs ---------------------------------------------------------------------------------------
def cuda_case(pi0_cases):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if interpreting():
        pytest.skip("CUDA graphs need compiled kernels (run with TRITON_INTERPRET=0)")
    return {k: v.cuda() for k, v in pi0_cases["two_views_padded_prompt"].items()}


@pytest.mark.gpu
def test_cuda_graphs_match_eager_and_the_reference(pi0_weights, pi0_cases, tmp_path):
    """bf16 with CUDA graphs: the whole decision graph (act beside observe), then the stage graphs with a fresh
    state each act (the runtime's way), against the eager engine with cuBLAS only and the fp32 reference."""
    c = cuda_case(pi0_cases)
    w = pi0_weights.to("cuda")
    graphed = Pi0Engine(w, dtype=torch.bfloat16, tuning_cache=tmp_path)
    eager = Pi0Engine(w, dtype=torch.bfloat16, graphs=False, gemm="torch")
    a = graphed.sample_actions(*model_inputs(c), c["state_padded"], c["noise"])
    assert graphed._graphs.keys() == ["decision"]
    b = eager.sample_actions(*model_inputs(c), c["state_padded"], c["noise"])
    assert rel_l2(a, b) <= TOL["graph_vs_eager"]
    assert cosine(a, c["actions"]) >= TOL["bf16_cosine"] and rel_l2(a, c["actions"]) <= TOL["bf16_rel_l2"]
    prefix = graphed.encode_prefix(*model_inputs(c))
    for k in range(3):
        state = c["state_padded"] + 0.3 * k
        got = graphed.denoise(prefix, state, c["noise"])
        with torch.no_grad():
            want = R.sample_actions(w, *model_inputs(c), state, c["noise"])
        assert cosine(got, want) >= TOL["bf16_cosine"] and rel_l2(got, want) <= TOL["bf16_rel_l2"], k
    assert {"decision", "observe", "act"} == set(graphed._graphs.keys())
