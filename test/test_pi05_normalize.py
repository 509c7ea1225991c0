"""LeRobot 0.6.1 state/action normalization (pi05.Normalizer): formulas, stats files, and the Runtime binding."""
import json
import re
import pathlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from flashrt_core.contract.runtime import Runtime
from flashrt_core.errors import CheckpointError
from flashrt_core.models import pi05
from flashrt_core.lerobot.normalize import FeatureNorm, Normalizer

# tolerance table (absolute)
TOL = {
    "hand_computed": 1e-6,  # fp32 formulas vs values worked out by hand
    "round_trip": 1e-5,  # normalize then un-normalize, stats of order 1..10
    "runtime_vs_formula": 0.0,  # same ops on the same tensors: bit-identical
}

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"
PRE = "policy_preprocessor_step_2_normalizer_processor.safetensors"
POST = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
T = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


@pytest.mark.parametrize("mode,lo,hi,x,expected", [
    ("MEAN_STD", T(1.0, -2.0, 0.5), T(2.0, 4.0, 0.25), T(3.0, 0.0, 0.0), [1.0, 0.5, -2.0]),
    ("MIN_MAX", T(0.0, -1.0, 2.0), T(4.0, 3.0, 2.0), T(1.0, 3.0, 2.0), [-0.5, 1.0, -1.0]),  # max == min: eps
    ("QUANTILES", T(-2.0, 10.0, 0.0), T(2.0, 20.0, 1.0), T(1.0, 25.0, -0.5), [0.5, 2.0, -2.0]),  # no clipping
    ("QUANTILE10", T(0.0, 1.0, -3.0), T(8.0, 3.0, 1.0), T(2.0, 1.5, -1.0), [-0.5, -0.5, 0.0]),
])
def test_formulas_against_hand_values(mode, lo, hi, x, expected):
    f = FeatureNorm(mode, lo, hi)
    np.testing.assert_allclose(f.forward(x).numpy(), expected, atol=TOL["hand_computed"], rtol=0)
    n = T(*expected)
    back = f.inverse(n).numpy()
    if mode == "MIN_MAX":  # the degenerate column maps back to min + (n + 1) / 2 * eps
        np.testing.assert_allclose(back[:2], x[:2].numpy(), atol=TOL["hand_computed"], rtol=0)
        assert abs(back[2] - 2.0) < 1e-7
    else:
        np.testing.assert_allclose(back, x.numpy(), atol=TOL["hand_computed"], rtol=0)


def test_mean_std_eps_only_on_the_forward_side():
    f = FeatureNorm("MEAN_STD", T(0.0), T(1e-7), eps=1e-7)
    assert f.forward(T(1e-7)).item() == pytest.approx(0.5, rel=1e-6)  # / (std + eps)
    assert f.inverse(T(2.0)).item() == pytest.approx(2e-7, rel=1e-6)  # * std, no eps (LeRobot)


@pytest.mark.parametrize("mode", ["MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"])
def test_round_trip_and_passthrough_columns(mode):
    g = torch.Generator().manual_seed(3)
    lo = torch.rand(7, generator=g) * 4 - 2
    hi = lo + 0.5 + torch.rand(7, generator=g) * 9
    norm = Normalizer(state=FeatureNorm(mode, lo, hi), action=FeatureNorm(mode, lo, hi))
    x = torch.randn(5, 7, generator=g) * 3
    np.testing.assert_allclose(norm.state.inverse(norm.normalize_state(x)).numpy(), x.numpy(),
                               atol=TOL["round_trip"], rtol=0)
    a = torch.randn(5, 11, generator=g)  # 7 robot columns + 4 padding columns
    out = norm.unnormalize_actions(a)
    assert out.shape == a.shape
    assert torch.equal(out[:, 7:], a[:, 7:])
    np.testing.assert_allclose(norm.normalize_state(out[:, :7]).numpy(), a[:, :7].numpy(),
                               atol=TOL["round_trip"], rtol=0)
    assert not torch.allclose(out[:, :7], a[:, :7])


class _NoHostValues(torch.overrides.TorchFunctionMode):
    """Records every tensor made from Python values (on a GPU: a blocking host-to-device copy)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.tensor, torch.as_tensor, torch.full, torch.scalar_tensor):
            self.made.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"])
def test_normalization_makes_no_tensors_from_host_values(mode):
    """The actions are un-normalized inside the act stage's CUDA graph: a tensor made from a Python value
    there would be a host-to-device copy that breaks the capture. Zero-width stats take the eps path."""
    lo = torch.tensor([-1.0, 0.0, 2.0])
    hi = torch.tensor([1.0, 0.0, 3.0])  # the middle column has hi == lo
    norm = Normalizer(state=FeatureNorm(mode, lo, hi), action=FeatureNorm(mode, lo, hi))
    a = torch.randn(4, 5, generator=torch.Generator().manual_seed(5))
    with _NoHostValues() as seen:
        out = norm.unnormalize_actions(a)
        norm.normalize_state(out[:, :3])
    assert seen.made == []
    assert torch.isfinite(out).all()


def test_identity_returns_inputs_untouched():
    n = Normalizer.identity()
    x = torch.randn(3, 8)
    assert n.normalize_state(x) is x and n.unnormalize_actions(x) is x
    assert n.source == "identity" and n.is_identity


def _all_stats(key, dim, seed):
    """Every stat LeRobot saves for a feature (it saves them all, whatever the mode)."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.rand(dim, generator=g) * 2 - 1.5
    out = {}
    for i, name in enumerate(["min", "q01", "q10", "mean", "q90", "q99", "max"]):
        out[f"{key}.{name}"] = lo + 0.4 * i + 0.1 * torch.rand(dim, generator=g)
    out[f"{key}.std"] = 0.2 + torch.rand(dim, generator=g)
    out[f"{key}.count"] = torch.tensor([1000])
    return out


def _pipeline_json(name, registry, state_file, norm_map, eps=1e-8):
    # LeRobot's pi0.5 pre-processor starts with a rename step; its post-processor has none
    first = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}}] \
        if name == "policy_preprocessor" else []
    return {"name": name, "steps": first + [
        {"registry_name": registry, "config": {"eps": eps, "features": {}, "norm_map": norm_map},
         "state_file": state_file}]}


def write_stats(folder, state_dim=8, action_dim=7, norm_map=None, json_files=True, state_stats=None):
    folder = pathlib.Path(folder)
    norm_map = norm_map or {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
    pre = {**_all_stats("observation.state", state_dim, 1), **_all_stats("action", action_dim, 2)}
    pre.update(state_stats or {})
    save_file(pre, str(folder / PRE))
    save_file(_all_stats("action", action_dim, 2), str(folder / POST))
    if json_files:
        (folder / "policy_preprocessor.json").write_text(
            json.dumps(_pipeline_json("policy_preprocessor", "normalizer_processor", PRE, norm_map)))
        (folder / "policy_postprocessor.json").write_text(
            json.dumps(_pipeline_json("policy_postprocessor", "unnormalizer_processor", POST, norm_map)))
    return folder


def test_from_checkpoint_reads_lerobot_files(tmp_path):
    write_stats(tmp_path, norm_map={"STATE": "MEAN_STD", "ACTION": "QUANTILE10"})
    n = Normalizer.from_checkpoint(tmp_path / "model.safetensors", state_dim=8, action_dim=7)
    s, a = _all_stats("observation.state", 8, 1), _all_stats("action", 7, 2)
    assert n.state.mode == "MEAN_STD" and n.action.mode == "QUANTILE10"
    assert torch.equal(n.state.lo, s["observation.state.mean"]) and torch.equal(n.state.hi, s["observation.state.std"])
    assert torch.equal(n.action.lo, a["action.q10"]) and torch.equal(n.action.hi, a["action.q90"])
    assert PRE in n.source and POST in n.source


def test_from_checkpoint_defaults_to_pi05_quantiles_without_json(tmp_path):
    write_stats(tmp_path, json_files=False)
    n = Normalizer.from_checkpoint(tmp_path)
    assert n.state.mode == "QUANTILES" and n.action.mode == "QUANTILES" and n.action.dim == 7


def test_from_checkpoint_without_stats_is_identity(tmp_path):
    n = Normalizer.from_checkpoint(tmp_path, state_dim=8, action_dim=7)
    assert n.source == "identity" and n.is_identity
    # a config.json that normalizes nothing needs no statistics either
    (tmp_path / "config.json").write_text(json.dumps(
        {"type": "pi05", "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "IDENTITY", "ACTION": "IDENTITY"}}))
    assert Normalizer.from_checkpoint(tmp_path, state_dim=8, action_dim=7).is_identity


@pytest.mark.parametrize("missing,feature", [("policy_*", "STATE"), ("policy_postprocessor*", "ACTION")])
def test_a_folder_copied_without_the_statistics_its_config_asks_for_refuses_robot_units(tmp_path, missing, feature):
    """config.json (as save_pretrained writes it) normalizes the state and actions: a folder without the
    processor files would run un-normalized, its actions off by the dataset's scale (LeRobot refuses it too).
    It loads (normalized-space use needs no statistics), and the feature refuses robot units by name."""
    write_stats(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"type": "pi05", "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "MEAN_STD"}}))
    assert Normalizer.from_checkpoint(tmp_path).state.mode == "QUANTILES"
    for f in tmp_path.glob(missing):
        f.unlink()
    norm = Normalizer.from_checkpoint(tmp_path)
    message = f"normalization_mapping.{feature} is .* but .* holds no .*statistics, so robot units cannot be had"
    assert norm.missing is not None and re.search(message, norm.missing)
    x = torch.randn(8) + 0.5
    with pytest.raises(CheckpointError, match=message):
        if feature == "STATE":
            norm.normalize_state(x)
        else:
            norm.unnormalize_actions(x[None])


@pytest.mark.parametrize("case,message", [
    ("missing", "observation.state.q99 missing"),
    ("length", "length 6, expected 8"),
    ("nonfinite", "observation.state.q01 has non-finite"),
    ("mode", "norm_map mode 'FOO'"),
    ("config string", "config and its norm_map must be JSON objects"),
    ("norm_map string", "config and its norm_map must be JSON objects"),
    ("negative eps", "eps must be a number >= 0"),
])
def test_from_checkpoint_malformed(tmp_path, case, message):
    if case == "missing":
        write_stats(tmp_path)
        pre = {k: v for k, v in _all_stats("observation.state", 8, 1).items() if not k.endswith("q99")}
        save_file(pre, str(tmp_path / PRE))
    elif case == "length":
        write_stats(tmp_path, state_dim=6)
    elif case == "nonfinite":
        bad = _all_stats("observation.state", 8, 1)["observation.state.q01"].clone()
        bad[3] = float("nan")
        write_stats(tmp_path, state_stats={"observation.state.q01": bad})
    elif case == "mode":
        write_stats(tmp_path, norm_map={"STATE": "FOO", "ACTION": "QUANTILES"})
    else:  # the processor JSON's normalizer entry itself is malformed
        write_stats(tmp_path)
        doc = _pipeline_json("policy_preprocessor", "normalizer_processor", PRE, {"STATE": "QUANTILES"},
                             eps=-1.0 if case == "negative eps" else 1e-8)
        entry = doc["steps"][1]
        if case == "config string":
            entry["config"] = "QUANTILES"
        elif case == "norm_map string":
            entry["config"]["norm_map"] = "QUANTILES"
        (tmp_path / "policy_preprocessor.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=message) as e:
        Normalizer.from_checkpoint(tmp_path, state_dim=8, action_dim=7)
    assert "policy_preprocessor" in str(e.value)


def _run(checkpoint, state, seed=0):
    rt = Runtime.from_config(CONFIG, device="cpu", seed=0, checkpoint=str(checkpoint))
    rng = np.random.default_rng(seed)
    imgs = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    rt.set_prompt("pick up the red cube")
    rt.set_observation(images=imgs, state=state, stamp_ns=0)
    return rt, rt.step(0).actions


def test_runtime_normalizes_state_and_unnormalizes_actions(tmp_path):
    plain = pi05.tiny_checkpoint(tmp_path / "plain")
    stats = write_stats(pi05.tiny_checkpoint(tmp_path / "stats"))
    norm = Normalizer.from_checkpoint(stats, state_dim=8, action_dim=7)
    raw = (np.random.default_rng(5).uniform(-2, 2, 8)).astype(np.float32)  # robot units
    normalized = norm.normalize_state(torch.from_numpy(raw)).numpy()
    # the state really moves bins, so a binding that skipped normalization would tokenize differently
    assert pi05.format_prompt("t", raw) != pi05.format_prompt("t", normalized)

    rt_id, ident = _run(plain, normalized)  # identity checkpoint fed the already-normalized state
    rt_st, out = _run(stats, raw)
    assert rt_id.binding.normalizer.source == "identity" and PRE in rt_st.binding.normalizer.source
    expected = norm.unnormalize_actions(torch.from_numpy(ident)).numpy()
    np.testing.assert_allclose(out, expected, atol=TOL["runtime_vs_formula"], rtol=0)
    assert not np.allclose(out, ident, atol=1e-3)
