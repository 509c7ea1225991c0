"""The Runtime with the pi0.5 binding and the built-in tiny model (config/pi05_tiny.yaml), against the model's
own whole-decision path (`preprocess_images` + `tokenize` + `sample_actions`)."""
import pathlib

import numpy as np
import pytest
import torch

from flashrt_core.contract.runtime import Runtime
from flashrt_core.errors import ContractError, InputError
from flashrt_core.models import pi05

# tolerance table (absolute, on actions in normalized space)
TOL = {
    "cpu_fp32_vs_whole_decision": 0.0,  # same ops in the same order on the same device: bit-identical
    "cuda_graph_vs_eager": 0.0,  # a graph replays the eager kernels
    # two fused runtimes time their GEMM candidates separately and may pick cuBLAS in one and Triton in the
    # other for a shape: fp32 rounding-level differences in actions of magnitude ~1
    "deferred_vs_inline": 1e-4,
    # fused engine (kernel references or the Triton interpreter) vs the eager reference engine, fp32 CPU
    "fused_vs_reference_cpu": 1e-4,
}

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"
MS = 1_000_000
PROMPT = "pick up the red cube"


@pytest.fixture(scope="module")
def policy():
    return pi05.load(None, device="cpu", dtype="float32", seed=0)


def frames(rng, shape=(224, 224, 3), missing=()):
    return [None if i in missing else rng.integers(0, 256, shape, dtype=np.uint8) for i in range(2)]


def state_vec(rng):
    return rng.uniform(-1, 1, 8).astype(np.float32)


def whole_decision(policy, imgs, state, prompt, noise):
    """Reference: one full decision through the model's own public path."""
    images, masks = policy.preprocess_images(imgs, num_slots=2)
    tokens, mask = pi05.tokenize_prompt(pi05.TinyTokenizer(), pi05.format_prompt(prompt, state), 128)
    return policy.sample_actions(images, masks, tokens, mask, noise=noise[None])[0, :, :7].numpy()


def drive(rt, seed, ticks):
    """Steps every 20 ms with a fresh observation every 5th tick; returns the StepResults."""
    rng = np.random.default_rng(seed)
    rt.set_prompt(PROMPT)
    out = []
    for k in range(ticks):
        if k % 5 == 0:
            rt.set_observation(images=frames(rng), state=state_vec(rng), stamp_ns=k * 20 * MS)
        out.append(rt.step(k * 20 * MS))
    return out


def noises(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(50, 32, generator=g) for _ in range(n)]


def test_act_reuses_prefix_exactly_and_new_prompt_reencodes(policy):
    rt = Runtime.from_config(CONFIG, device="cpu", seed=0)
    rng = np.random.default_rng(0)
    imgs, st = frames(rng), state_vec(rng)
    rt.set_prompt(PROMPT)
    rt.set_observation(images=imgs, state=st, stamp_ns=0)
    noise = noises()
    r = rt.step(0)
    assert r.ran == ["prompt", "observe", "act"] and r.decision_id == 1 and r.prefix_id == 1
    assert r.actions.shape == (50, 7) and r.actions.dtype == np.float32
    tol = TOL["cpu_fp32_vs_whole_decision"]
    np.testing.assert_allclose(r.actions, whole_decision(policy, imgs, st, PROMPT, noise[0]), atol=tol, rtol=0)
    # act-only ticks: the cached prefix + fresh noise == a whole decision on the same observation and noise
    for k in (1, 2):
        r = rt.step(k * 20 * MS)
        assert r.ran == ["act"] and r.prefix_id == 1 and r.observation_age_ms == pytest.approx(20.0 * k)
        np.testing.assert_allclose(r.actions, whole_decision(policy, imgs, st, PROMPT, noise[k]), atol=tol, rtol=0)
    np.testing.assert_array_equal(rt.persistent_buffers()["prev_chunk"][:, :7].numpy(), r.actions)
    # a new prompt re-encodes at the next tick, with the same observation
    rt.set_prompt("open the top drawer")
    r = rt.step(60 * MS)
    assert r.ran == ["prompt", "observe", "act"] and r.prefix_id == 2
    assert r.observation_age_ms == pytest.approx(60.0)
    ref_new = whole_decision(policy, imgs, st, "open the top drawer", noise[3])
    np.testing.assert_allclose(r.actions, ref_new, atol=tol, rtol=0)
    assert np.abs(ref_new - whole_decision(policy, imgs, st, PROMPT, noise[3])).max() > 1e-3
    # the state is part of the pi0.5 prompt: a new observation changes the tokens
    st2 = state_vec(rng)
    rt.set_observation(images=imgs, state=st2, stamp_ns=90 * MS)
    r = rt.step(100 * MS)
    assert r.ran == ["observe", "act"] and r.observation_age_ms == pytest.approx(10.0)
    np.testing.assert_allclose(r.actions, whole_decision(policy, imgs, st2, "open the top drawer", noise[4]),
                               atol=tol, rtol=0)


def test_missing_camera_and_other_resolution(policy):
    rt = Runtime.from_config(CONFIG, seed=0, options={"image_height": 120, "image_width": 160},
                             rates={"act": 25.0}, max_observation_age_ms=1000)
    assert rt.stage_rates() == {"observe": 10.0, "act": 25.0}
    rng = np.random.default_rng(1)
    imgs, st = frames(rng, shape=(120, 160, 3), missing=(0,)), state_vec(rng)
    rt.set_prompt("wipe the table")
    rt.set_observation(images=imgs, state=st, stamp_ns=5 * MS)
    r = rt.step(7 * MS)
    assert r.observation_age_ms == pytest.approx(2.0)
    np.testing.assert_allclose(r.actions, whole_decision(policy, imgs, st, "wipe the table", noises()[0]),
                               atol=TOL["cpu_fp32_vs_whole_decision"], rtol=0)


def test_input_errors_leave_the_runtime_untouched():
    rt = Runtime.from_config(CONFIG, seed=0)
    rng = np.random.default_rng(2)
    rt.set_observation(images=frames(rng), state=state_vec(rng), stamp_ns=100)
    versions = {n: m.version for n, m in rt.buffers.ledger.buffers.items()}
    good = frames(rng)
    cases = [
        (dict(images=good[:1], state=state_vec(rng), stamp_ns=200), "images: expected 2 cameras, got 1"),
        (dict(images=[good[0], good[1][:, :100]], state=state_vec(rng), stamp_ns=200), "images[1]: shape"),
        (dict(images=[good[0], good[1].astype(np.float32)], state=state_vec(rng), stamp_ns=200),
         "images[1]: dtype float32"),
        (dict(images=[None, None], state=state_vec(rng), stamp_ns=200), "every camera is missing"),
        (dict(images=good, state=np.array([0.1] * 7 + [np.nan], np.float32), stamp_ns=200), "state[7]"),
        (dict(images=good, state=np.array([0.1] * 3 + [np.inf] * 5, np.float32), stamp_ns=200), "state[3]"),
        (dict(images=good, state=np.zeros(7, np.float32), stamp_ns=200), "state: shape (7,)"),
        (dict(images=good, state=np.zeros(8, np.int64), stamp_ns=200), "state: dtype int64"),
        (dict(images=good, state=state_vec(rng), stamp_ns=99), "older than the last observation (100)"),
        (dict(images=good, state=state_vec(rng), stamp_ns=1.5), "stamp_ns: expected an integer"),
        (dict(images=good, state=None, stamp_ns=200), "state: required"),
        # checked after the cast to float32: a float64 that overflows it never reaches the buffer as inf
        (dict(images=good, state=np.array([0.1] * 7 + [1e39]), stamp_ns=200), "state[7]: 1e+39 overflows float32"),
        (dict(images=good, state=torch.from_numpy(state_vec(rng)).to(torch.bfloat16), stamp_ns=200),
         "state: torch dtype torch.bfloat16 has no numpy equivalent"),
        (dict(images=[torch.from_numpy(good[0]).to(torch.bfloat16), good[1]], state=state_vec(rng), stamp_ns=200),
         "images[0]: torch dtype torch.bfloat16"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InputError, match=None) as e:
            rt.set_observation(**kwargs)
        assert message in str(e.value), (message, str(e.value))
    for text, message in ((42, "prompt: expected a string"), ("  ", "prompt: empty"),
                          ("x" * 300, "300 bytes")):
        with pytest.raises(InputError) as e:
            rt.set_prompt(text)
        assert message in str(e.value)
    assert {n: m.version for n, m in rt.buffers.ledger.buffers.items()} == versions


def test_meta_round_trip_reproduces_the_next_decisions():
    """What a capsule needs: persistent buffers + runtime_meta restore the exact continuation."""
    rt = Runtime.from_config(CONFIG, seed=3)
    rng = np.random.default_rng(3)
    imgs, st = frames(rng), state_vec(rng)
    rt.set_prompt(PROMPT)
    rt.set_observation(images=imgs, state=st, stamp_ns=0)
    rt.step(0)
    rt.step(20 * MS)
    saved = {n: t.clone() for n, t in rt.persistent_buffers().items()}
    meta = rt.runtime_meta()
    assert meta["decisions"] == 2 and meta["prompt"] == PROMPT and meta["rng_state"].dtype == torch.uint8
    ptrs = {n: t.data_ptr() for n, t in rt.persistent_buffers().items()}
    first = [rt.step(t * MS).actions for t in (40, 60)]
    rt.set_prompt("stack the cups")  # dirty the state
    rt.step(80 * MS)
    for n, t in rt.persistent_buffers().items():
        t.copy_(saved[n])
    rt.apply_meta(meta)
    assert rt.prompt == PROMPT and rt.decisions == 2
    again = [rt.step(t * MS) for t in (40, 60)]
    assert [r.ran for r in again] == [["act"], ["act"]]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b.actions)
    assert {n: t.data_ptr() for n, t in rt.persistent_buffers().items()} == ptrs


def test_fingerprint_fields():
    a = Runtime.from_config(CONFIG, seed=0)
    f = a.fingerprint_fields()
    assert set(f) == {"model", "weights_digest", "precision", "layout"}
    assert f["precision"] == "float32" and f["model"].startswith("pi05:")
    assert f["layout"] == {n: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                           for n, t in a.persistent_buffers().items()}
    assert set(f["layout"]) == {"task", "prefix_k", "prefix_v", "prefix_mask", "prefix_valid", "action_offset",
                               "prev_chunk", "rtc_clock"}
    assert Runtime.from_config(CONFIG, seed=0).fingerprint_fields() == f
    assert Runtime.from_config(CONFIG, seed=1).fingerprint_fields()["weights_digest"] != f["weights_digest"]


def test_the_weights_digest_does_not_depend_on_the_thread_count():
    """A node at cpu_threads 1 and a script at the default count digest the same weights alike (the AdaRMS tables
    derived by CPU matmuls, whose last bits differ between thread counts, are not part of it): a capsule of one
    restores into the other."""
    import subprocess
    import sys

    code = ("import sys, torch; torch.set_num_threads(int(sys.argv[1])); from flashrt_core import Runtime; "
            f"print(Runtime.from_config({str(CONFIG)!r}, seed=0).fingerprint_fields()['weights_digest'])")
    root = str(pathlib.Path(__file__).resolve().parents[1])
    digests = {subprocess.run([sys.executable, "-c", code, str(n)], capture_output=True, text=True, check=True,
                              cwd=root).stdout.strip() for n in (1, 2)}
    assert len(digests) == 1 and all(digests), digests


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["stage", "plan"])
def test_cuda_graphs_match_eager_and_never_move(graphs):
    from flashrt_core.contract.spec import load_contract

    base = load_contract(CONFIG)
    runs = {}
    for mode in (graphs, "off"):  # the contract's own graphs: the reference engine (auto picks fused on CUDA)
        contract = base.with_overrides(dtype="float32", options={"engine": "reference"})
        contract = type(contract)(**{**vars(contract), "graphs": mode})
        rt = Runtime(contract, device="cuda", seed=0, debug_graphs=True)
        out = [(r.ran, r.actions) for r in drive(rt, seed=5, ticks=12)]
        runs[mode] = (out, rt.graphs.captures, rt.graphs.keys())
    (g_out, captures, keys), (e_out, _, _) = runs[graphs], runs["off"]
    for (ran_g, a_g), (ran_e, a_e) in zip(g_out, e_out):
        assert ran_g == ran_e
        np.testing.assert_allclose(a_g, a_e, atol=TOL["cuda_graph_vs_eager"], rtol=0)
    assert captures == 2  # stage: observe, act; plan: observe+act, act
    assert sorted(keys) == (sorted([("observe",), ("act",)]) if graphs == "stage"
                            else sorted([("observe", "act"), ("act",)]))


def test_vision_dtype_option():
    """SigLIP runs in float32 (LeRobot's choice) under the reference engine and in the model dtype under the
    fused one unless the contract says otherwise; anything else is a contract error naming the option."""
    ref = Runtime.from_config(CONFIG, seed=0, dtype="bfloat16")
    assert ref.binding.policy.weights.patch_w.dtype == torch.float32
    fused = Runtime.from_config(CONFIG, seed=0, dtype="bfloat16", options={"engine": "fused"})
    assert fused.binding.policy.weights.patch_w.dtype == torch.bfloat16
    assert fused.binding.policy.weights.vlm_layers[0].qkv_w.dtype == torch.bfloat16
    assert fused.binding.policy.engine.weights.patch_w.dtype == torch.bfloat16
    assert fused.binding.policy.engine.buffers.images.dtype == torch.bfloat16
    kept = Runtime.from_config(CONFIG, seed=0, dtype="bfloat16", options={"engine": "fused", "vision_dtype": "float32"})
    assert kept.binding.policy.weights.patch_w.dtype == torch.float32
    # the engine's own weights and SigLIP input buffer (the policy's copy alone hid that the engine cast them back)
    engine = kept.binding.policy.engine
    assert engine.weights.patch_w.dtype == engine.weights.proj_w.dtype == torch.float32
    assert engine.weights.vision_layers[0].qkv_w.dtype == engine.buffers.images.dtype == torch.float32
    assert engine.weights.vlm_layers[0].qkv_w.dtype == torch.bfloat16
    with pytest.raises(ContractError, match="model.options.vision_dtype"):
        Runtime.from_config(CONFIG, seed=0, options={"vision_dtype": "fp8"})


@pytest.mark.gpu
def test_deferred_observe_on_cuda_matches_inline_from_the_next_tick():
    """Fused engine on CUDA, observe deferred: at an observe tick act still uses the previous prefix and
    returns without waiting for observe; every other tick equals the inline runtime's actions (same noise)."""
    from flashrt_core.contract.spec import load_contract

    out = {}
    for deferred in (False, True):
        contract = load_contract(CONFIG).with_overrides(
            dtype="float32", rates={"observe": 10, "act": 50}, limits={"max_observation_age_ms": None},
            options={"engine": "fused"}, deferred={"observe": deferred})
        rt = Runtime(contract, device="cuda", seed=0)
        engine = rt.binding.policy.engine  # each stage and its contract copies captured as one graph
        if deferred:  # captured at configure time (warmup), not at the first tick; the buffers are put back
            before = {n: t.clone() for n, t in rt.buffers.tensors.items()}
            rt.warmup()
            assert {("observe", "contract"), ("act", "contract")} <= set(engine._graphs.keys())
            assert all(torch.equal(t, before[n]) for n, t in rt.buffers.tensors.items())
        out[deferred] = drive(rt, seed=6, ticks=16)
        assert engine.hook_capture_errors == {} and {("observe", "contract"), ("act", "contract")} <= set(engine._graphs.keys())
    for k, (a, d) in enumerate(zip(out[False], out[True])):
        if k % 5 == 0 and k > 0:
            assert a.ran == ["observe", "act"] and d.ran == ["act", "observe"] and d.deferred == ["observe"]
            assert a.observation_age_ms == 0.0 and d.observation_age_ms == pytest.approx(100.0)
            assert d.actions is not None and not np.allclose(d.actions, a.actions)  # the older prefix
            assert d.stage_latency_ms.get("observe", 0.0) < 50.0  # host part and launches only
            continue
        assert a.ran == d.ran
        np.testing.assert_allclose(d.actions, a.actions, atol=TOL["deferred_vs_inline"], rtol=0)
        if k % 5 == 1 and k > 1:  # the tick after a deferred observe reads its GPU time back
            assert d.deferred_latency_ms.get("observe", 0.0) > 0.0


def test_fused_engine_runtime_matches_the_reference_engine():
    """With the fused engine each stage runs with its contract copies in one engine graph on CUDA (on the
    CPU the same code runs eagerly): the actions match the reference engine's on the same inputs and noise."""
    out = {}
    for engine in ("reference", "fused"):
        rt = Runtime.from_config(CONFIG, seed=0, options={"engine": engine},
                                 rates={"observe": 10, "act": 50}, max_observation_age_ms=1000.0)
        out[engine] = drive(rt, seed=11, ticks=7)
    assert [r.ran for r in out["fused"]] == [r.ran for r in out["reference"]]
    assert sum(r.actions is not None for r in out["fused"]) == 7
    for ref, fused in zip(out["reference"], out["fused"]):
        np.testing.assert_allclose(fused.actions, ref.actions, atol=TOL["fused_vs_reference_cpu"], rtol=0)
        assert fused.prefix_id == ref.prefix_id and fused.observation_age_ms == ref.observation_age_ms


def _fused_runtime(graphs: str, device: str = "cpu"):
    from flashrt_core.contract.spec import load_contract

    contract = load_contract(CONFIG).with_overrides(dtype="float32", rates={"observe": 10, "act": 50},
                                                    limits={"max_observation_age_ms": 1000.0},
                                                    options={"engine": "fused"})
    return Runtime(type(contract)(**{**vars(contract), "graphs": graphs}), device=device, seed=0)


def test_a_plan_of_observe_and_act_runs_as_one_engine_decision():
    """contract graphs: plan, fused engine: a tick with observe and act runs them as one engine decision
    (`Pi05Binding.device_plan` -> `Pi05Engine.run_decision`, one graph on CUDA); act-only ticks stay per stage.
    On the CPU the same code runs eagerly: the actions are those of per-stage graphs, bit for bit."""
    out, decisions = {}, []
    for graphs in ("stage", "plan"):
        rt = _fused_runtime(graphs)
        engine = rt.binding.policy.engine
        run_decision = engine.run_decision

        def counting(hooks, key="hooks", run_decision=run_decision, graphs=graphs):
            decisions.append(graphs)
            return run_decision(hooks, key)
        engine.run_decision = counting
        out[graphs] = drive(rt, seed=12, ticks=11)
    combined = [k for k, r in enumerate(out["plan"]) if r.ran == ["prompt", "observe", "act"] or
                r.ran == ["observe", "act"]]
    assert combined == [0, 5, 10] and decisions == ["plan"] * 3
    for s, p in zip(out["stage"], out["plan"]):
        assert s.ran == p.ran and s.prefix_id == p.prefix_id
        np.testing.assert_array_equal(p.actions, s.actions)


@pytest.mark.gpu
def test_a_plan_of_observe_and_act_on_cuda_is_one_engine_graph():
    """The same on CUDA: the combined ticks replay the engine's decision graph (observe and act overlapped;
    the contract copies inside), the others its act graph; actions as with per-stage graphs (two runtimes tune
    their kernels apart: `deferred_vs_inline`)."""
    out = {}
    for graphs in ("stage", "plan"):
        rt = _fused_runtime(graphs, device="cuda")
        engine = rt.binding.policy.engine
        if graphs == "plan":  # configure time captures the decision graph too (the buffers are put back)
            before = {n: t.clone() for n, t in rt.buffers.tensors.items()}
            rt.warmup()
            assert ("decision", "contract") in engine._graphs
            assert all(torch.equal(t, before[n]) for n, t in rt.buffers.tensors.items())
        out[graphs] = drive(rt, seed=13, ticks=11)
        assert engine.hook_capture_errors == {}
        if graphs == "plan":
            assert ("decision", "contract") in engine._graphs
    for s, p in zip(out["stage"], out["plan"]):
        assert s.ran == p.ran
        np.testing.assert_allclose(p.actions, s.actions, atol=TOL["deferred_vs_inline"], rtol=0)


def test_the_fused_engine_works_in_the_contracts_prefix_buffers():
    """The contract's persistent prefix buffers are the engine's own (Pi05Binding.attach_buffers ->
    Pi05Engine.share_prefix): observe writes into them, act reads them, no tick copies a prefix either way,
    and a capsule restore of them is what the next act tick reads."""
    rt = _fused_runtime("stage")
    engine, b = rt.binding.policy.engine, rt.buffers
    for mine, theirs in (("prefix_k", "prefix_k"), ("prefix_v", "prefix_v"), ("prefix_mask", "pad_mask"),
                         ("prefix_valid", "n_valid")):
        assert getattr(engine.buffers, theirs).data_ptr() == b[mine].data_ptr(), mine
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(dst, src, *a, **kw):
        copies.append(tuple(dst.shape))
        return real_copy(dst, src, *a, **kw)
    torch.Tensor.copy_ = counting_copy
    try:
        out = drive(rt, seed=21, ticks=6)
    finally:
        torch.Tensor.copy_ = real_copy
    kv = tuple(b["prefix_k"].shape)
    assert not any(s in (kv, kv[:1] + (1,) + kv[1:]) for s in copies), "a prefix was copied"
    assert all(r.actions is not None for r in out)
    # a restore writes the contract's buffers, which the engine reads: the restored branch repeats
    cid = rt.snapshot("here")
    first = [rt.step((6 + k) * 20 * MS).actions for k in range(2)]
    kept = b["prefix_k"].clone()
    rng = np.random.default_rng(5)
    rt.set_observation(images=frames(rng), state=state_vec(rng), stamp_ns=10 * 20 * MS)
    assert "observe" in rt.step(10 * 20 * MS).ran  # a new prefix, in the engine's and the contract's buffer
    assert not torch.equal(b["prefix_k"], kept)
    rt.restore(cid, rewind_time=True)
    assert torch.equal(engine.buffers.prefix_k, kept[:, None])
    again = [rt.step((6 + k) * 20 * MS).actions for k in range(2)]
    for a, c in zip(first, again):
        np.testing.assert_array_equal(a, c)
