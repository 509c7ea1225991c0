"""The engine's tuning cache: choices survive a restart, a bad file or a stale choice costs a new tuning,
never a wrong result. The pickers' cached path runs here in the Triton interpreter (their timing path needs
CUDA and is replaced by a recording stub)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first kernel-module import

import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_core.kernels.reference import attention_ref  # noqa: E402
from flashrt_core.engine import tuning as T  # noqa: E402
from flashrt_core.engine.attention import CANDIDATES, AttentionPicker  # noqa: E402
from flashrt_core.engine.gemm import CONFIGS, LinearPicker  # noqa: E402
from kernel_testing import dev  # noqa: E402,F401

TOL = {
    "gemm_fp32": 1e-5,  # a cached skinny GEMM choice vs F.linear, fp32, relative to the output's max
    "attention_fp32": 1e-4,  # a cached attention launch choice vs attention_ref, fp32, absolute
}
CONTEXT = {"gpu": "Test GPU", "capability": "9.0", "sms": 132, "torch": "t", "triton": "tr", "cuda": "c",
           "kernels": "abc"}
KEY = (50, (40, 72), True, False, torch.float32)


def test_choices_survive_a_restart_and_are_tied_to_their_context(tmp_path):
    path = tmp_path / "ctx.json"
    cache = T.TuningCache(path, CONTEXT)
    cache.put("linear", KEY, (32, 128, 2, 4, 4), {"cublas": 0.005, "(32, 128, 2, 4, 4)": 0.004})
    cache.put("attention", ((1, 50, 8, 256),), None, {"heuristic": 0.013})
    assert cache.save() and not cache.save()  # nothing changed since: no second write
    again = T.TuningCache(path, CONTEXT)
    assert again.loaded_from_disk == 2
    assert again.get("linear", KEY) == (True, (32, 128, 2, 4, 4), {"cublas": 0.005, "(32, 128, 2, 4, 4)": 0.004})
    assert again.get("attention", ((1, 50, 8, 256),)) == (True, None, {"heuristic": 0.013})
    assert again.get("linear", (51, *KEY[1:]))[0] is False
    other = T.TuningCache(path, {**CONTEXT, "triton": "other"})  # another Triton: nothing is reused
    assert other.loaded_from_disk == 0 and other.get("linear", KEY)[0] is False


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 99}), json.dumps([1, 2]),
                                     json.dumps({"format": 1, "context": CONTEXT, "choices": {"linear": {"k": 3}}}),
                                     json.dumps({"format": 1, "context": CONTEXT,
                                                 "choices": {"linear": {"k": {"choice": [1, "x"]}}}})],
                         ids=["truncated", "format", "not-a-mapping", "entry", "choice"])
def test_a_bad_file_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, content):
    path = tmp_path / "ctx.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger=T.__name__):
        cache = T.TuningCache(path, CONTEXT)
    assert cache.loaded_from_disk == 0 and "ignored" in caplog.text
    cache.put("linear", KEY, None)
    assert cache.save()
    assert T.TuningCache(path, CONTEXT).get("linear", KEY) == (True, None, {})


def test_an_unwritable_directory_is_reported_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = T.TuningCache(blocker / "sub" / "ctx.json", CONTEXT)  # its parent is a file
    cache.put("linear", KEY, None)
    with caplog.at_level(logging.WARNING, logger=T.__name__):
        assert cache.save() is False
    assert "cannot write" in caplog.text


def test_default_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(T.ENV, str(tmp_path / "t"))
    assert T.default_directory() == tmp_path / "t"
    monkeypatch.setenv(T.ENV, "off")
    assert T.default_directory() is None
    monkeypatch.delenv(T.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert T.default_directory() == tmp_path / "xdg" / "flashrt" / "tuning"
    assert T.TuningCache.for_device("cpu") is None  # only CUDA engines tune
    assert T.TuningCache.for_device("cuda", None) is None and T.TuningCache.for_device("cuda", False) is None


def test_sources_hash_changes_with_the_kernel_sources(tmp_path, monkeypatch):
    assert len(T.sources_hash()) == 16 and T.sources_hash() == T.sources_hash()
    monkeypatch.setattr(T, "__file__", str(tmp_path / "flashrt_core" / "engine" / "tuning.py"))
    kernel = tmp_path / "k.py"
    kernel.write_text("BLOCK = 16\n")
    before = T.sources_hash(("k.py",))
    kernel.write_text("BLOCK = 32\n")
    assert T.sources_hash(("k.py",)) != before


def test_the_key_hashes_no_benchmark_code():
    """Editing a benchmark (the LeRobot comparison in flashrt_bench/harness.py, benchmarks/) must not make every
    robot tune again: the context hashes kernel and picker sources only, and each of them exists."""
    root = Path(T.__file__).resolve().parents[2]
    assert T._SOURCES and not [s for s in T._SOURCES if "bench" in s]
    assert all((root / s).is_file() for s in T._SOURCES)


def test_engines_sharing_a_file_keep_each_others_choices(tmp_path):
    path = tmp_path / "ctx.json"
    one, two = T.TuningCache(path, CONTEXT), T.TuningCache(path, CONTEXT)  # both read an empty cache
    one.put("linear", KEY, (32, 128, 2, 4, 4))
    assert one.save()
    two.put("linear", (1, *KEY[1:]), None)
    two.put("attention", ("a",), (16, 32, 8, 4))
    assert two.save()
    merged = T.TuningCache(path, CONTEXT)
    assert merged.get("linear", KEY)[:2] == (True, (32, 128, 2, 4, 4))
    assert merged.get("linear", (1, *KEY[1:]))[:2] == (True, None)
    assert merged.get("attention", ("a",))[:2] == (True, (16, 32, 8, 4))
    assert not list(tmp_path.glob(".tuning-*"))  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o644


def _recording_tune(picker, chosen):
    calls = []

    def tune(key, *args):
        calls.append(key)
        picker.timings[key] = {"cublas": 0.01, str(chosen): 0.005}
        return chosen
    picker._tune = tune
    return calls


@pytest.mark.interpret
def test_linear_picker_uses_a_checked_cached_choice_and_retunes_a_stale_one(dev, tmp_path):
    g = torch.Generator().manual_seed(11)
    x, w, b = (torch.randn(*s, generator=g).to(dev) + 0.1 for s in ((50, 72), (40, 72), (40,)))
    key = (50, (40, 72), True, False, x.dtype)
    cache = T.TuningCache(tmp_path / "c.json", CONTEXT)
    picker = LinearPicker(dev, cache=cache)
    calls = _recording_tune(picker, CONFIGS[4])
    assert picker._cached(key, x, w, b, False, None) == CONFIGS[4] and calls == [key]  # tuned, then kept
    assert cache.save()
    # A new process: the choice comes from the file, is checked against cuBLAS, and nothing is timed.
    fresh = LinearPicker(dev, cache=T.TuningCache(tmp_path / "c.json", CONTEXT))
    calls = _recording_tune(fresh, CONFIGS[0])
    assert fresh._cached(key, x, w, b, False, None) == CONFIGS[4] and calls == []
    assert fresh.timings[key]["from_cache"] is True
    fresh.choices[key] = CONFIGS[4]  # what the engine's warm-up does with the result
    want = F.linear(x, w, b)
    got = fresh(x, w, b)  # the skinny GEMM with the cached launch choice
    assert (got - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()
    # A choice that is not a known configuration any more (the kernels changed) is tuned again.
    stale = T.TuningCache(tmp_path / "c.json", CONTEXT)
    stale.put("linear", key, (7, 7, 7, 7, 7))
    third = LinearPicker(dev, cache=stale)
    calls = _recording_tune(third, CONFIGS[1])
    assert third._cached(key, x, w, b, False, None) == CONFIGS[1] and calls == [key]
    assert stale.get("linear", key)[1] == CONFIGS[1]


@pytest.mark.interpret
def test_linear_picker_retunes_a_cached_choice_that_computes_wrong(dev, tmp_path, monkeypatch):
    from flashrt_core.engine import gemm as engine_gemm

    g = torch.Generator().manual_seed(12)
    x, w = (torch.randn(*s, generator=g).to(dev) + 0.1 for s in ((50, 72), (40, 72)))
    key = (50, (40, 72), False, False, x.dtype)
    cache = T.TuningCache(None, CONTEXT)
    cache.put("linear", key, CONFIGS[2])
    real = engine_gemm.skinny_linear
    monkeypatch.setattr(engine_gemm, "skinny_linear", lambda *a, **k: real(*a, **k) * 1.5)  # a broken kernel
    picker = LinearPicker(dev, cache=cache)
    calls = _recording_tune(picker, None)
    assert picker._cached(key, x, w, None, False, None) is None and calls == [key]
    assert cache.get("linear", key)[:2] == (True, None)


@pytest.mark.interpret
def test_attention_picker_uses_a_checked_cached_choice(dev, tmp_path):
    g = torch.Generator().manual_seed(13)
    q = (torch.randn(1, 5, 4, 16, generator=g) + 0.1).to(dev)
    k, v = ((torch.randn(1, 2, 21, 16, generator=g) + 0.1).to(dev) for _ in range(2))
    mask = (torch.rand(1, 21, generator=g) > 0.3).to(dev)
    mask[0, 0] = True
    key = (tuple(q.shape), tuple(k.shape), True, None, q.dtype)
    cache = T.TuningCache(tmp_path / "a.json", CONTEXT)
    choice = CANDIDATES[0]
    cache.put("attention", key, choice, {"heuristic": 0.02, str(choice): 0.01})
    picker = AttentionPicker(dev, cache=cache)
    calls = _recording_tune(picker, CANDIDATES[1])
    from flashrt_core.kernels.flash_attention import attention
    assert picker._cached(key, attention, q, k, v, mask, None, None) == choice and calls == []
    got = attention(q, k, v, mask, config=choice)
    torch.testing.assert_close(got, attention_ref(q, k, v, mask), atol=TOL["attention_fp32"], rtol=0)
    # An entry that no longer names a candidate is tuned again and replaced.
    cache.put("attention", key, (1, 2, 3, 4))
    calls = _recording_tune(picker, CANDIDATES[1])
    assert picker._cached(key, attention, q, k, v, mask, None, None) == CANDIDATES[1] and calls == [key]


@pytest.mark.interpret
def test_linear_picker_tunes_and_reuses_a_preloading_candidate(dev):
    """The picker offers every CONFIGS entry, those that request weight tiles before the PDL wait in their K
    loop included; a restarted picker reuses such a choice after checking it against cuBLAS."""
    g = torch.Generator().manual_seed(16)
    x, w = (torch.randn(*s, generator=g).to(dev) + 0.1 for s in ((50, 72), (40, 72)))
    key = (50, (40, 72), False, False, x.dtype)
    early = next(c for c in CONFIGS if len(c) == 6 and c[5])
    cache = T.TuningCache(None, CONTEXT)
    picker = LinearPicker(dev, cache=cache)
    assert picker.candidates == CONFIGS
    calls = _recording_tune(picker, early)
    assert picker._cached(key, x, w, None, False, None) == early and calls == [key]  # tuned, runs (checked)
    assert cache.get("linear", key)[:2] == (True, early)
    again = LinearPicker(dev, cache=cache)
    calls = _recording_tune(again, CONFIGS[0])
    assert again._cached(key, x, w, None, False, None) == early and calls == []


@pytest.mark.interpret
def test_attention_picker_retunes_a_cached_choice_that_computes_wrong(dev, monkeypatch):
    from flashrt_core.kernels import flash_attention

    g = torch.Generator().manual_seed(14)
    q = (torch.randn(1, 3, 2, 16, generator=g) + 0.1).to(dev)
    k, v = ((torch.randn(1, 1, 9, 16, generator=g) + 0.1).to(dev) for _ in range(2))
    key = (tuple(q.shape), tuple(k.shape), False, None, q.dtype)
    cache = T.TuningCache(None, CONTEXT)
    cache.put("attention", key, CANDIDATES[2])
    real = flash_attention.attention

    def broken(*args, config=None, **kwargs):  # the cached launch choice computes something else
        out = real(*args, config=config, **kwargs)
        return out * 1.5 if config is not None else out
    monkeypatch.setattr(flash_attention, "attention", broken)
    picker = AttentionPicker(dev, cache=cache)
    calls = _recording_tune(picker, None)
    assert picker._cached(key, flash_attention.attention, q, k, v, None, None, None) is None and calls == [key]
    assert cache.get("attention", key)[:2] == (True, None)


@pytest.mark.interpret
def test_tuning_a_gemm_that_adds_into_the_residual_stream_leaves_the_stream_alone(dev, tmp_path):
    """The picker's trial calls of a fused residual GEMM (cache check, and on a GPU the timing of every
    candidate) add into a copy: the engine's residual stream is only changed by the real call."""
    from flashrt_core.engine.gemm import Fusion, GatedResidual

    g = torch.Generator().manual_seed(14)
    x, w, res, gate = (torch.randn(*s, generator=g).to(dev) + 0.1 for s in ((50, 72), (40, 72), (50, 40), (40,)))
    before = res.clone()
    residual = GatedResidual(res, gate)
    key = (50, (40, 72), False, False, x.dtype, "residual")
    cache = T.TuningCache(None, CONTEXT)
    cache.put("linear", key, CONFIGS[2])
    picker = LinearPicker(dev, cache=cache)
    assert picker._cached(key, x, w, None, False, None, Fusion(residual=residual)) == CONFIGS[2]
    assert torch.equal(res, before)
    if torch.device(dev).type == "cuda":  # the candidates are timed in CUDA graphs
        picker._tune(key, x, w, None, False, None, Fusion(residual=residual))
        assert torch.equal(res, before)
    picker.choices[key] = CONFIGS[2]
    got = picker(x, w, residual=residual)
    want = before + F.linear(x, w) * gate
    assert got is res and (got - want).abs().max() <= TOL["gemm_fp32"] * want.abs().max()


def test_precompile_is_a_no_op_under_the_interpreter():
    """The interpreter has nothing to compile: precompile neither calls the launches nor changes the mode
    (compiled-mode behaviour: test_kernels_ptx.py)."""
    from flashrt_core.kernels import _common

    calls = []
    _common.precompile([lambda: calls.append(1)])
    assert calls == [] and _common._COMPILE_ONLY.get() is False
