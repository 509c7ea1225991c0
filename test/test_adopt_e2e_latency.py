"""The end-to-end latency gate of accelerate(): per-unit gains that do not add up to a faster whole model are
refused, a kind that slows the whole down is dropped while a good kind is kept, the marginal units of a kind
are dropped, and the number of end-to-end timings is bounded. Timers are injected: a unit's fused form is
always faster alone, and the whole model's cost is computed from the swaps actually installed in it."""
import pytest
import torch

from flashrt_core.adopt import AdoptError, accelerate, api, e2e
from flashrt_core.adopt.graph import CaptureError
from flashrt_core.adopt.wrappers import AdoptedModule
from test_adopt_models import GemmaLike, gemma_like, randomized, tokens

# Tolerance table: adopted fp32 models against their own eager output (reverted ones must be bit-exact).
TOL = {"cos_min": 0.999, "fp32_rel": 1e-3}
ROUNDS = 5
GAIN_RE = r"[+-]\d+\.\d%"


def swapped(model):
    """(name, kind) of every swapped module now installed (a merged q/k/v unit counts three times)."""
    return [(n, m.adopted_kind) for n, m in model.named_modules() if isinstance(m, AdoptedModule)]


def swapped_kinds(model):
    return [k for _, k in swapped(model)]


def whole_model_timer(model, per_swap, unit_fused=None, calls=None):
    """Units alone: original 1.0, fused `unit_fused.get(unit, 0.5)`. Whole model: 1.0 plus, for every
    installed swapped module, `per_swap[kind]` (a dict) or `per_swap(name, kind)` (an overhead when positive,
    a saving when negative)."""
    unit_fused = unit_fused or {}
    cost = per_swap if callable(per_swap) else (lambda name, kind: per_swap.get(kind, 0.0))

    def timer(fn):
        fn()
        if calls is not None:
            calls.append((fn.variant, fn.unit))
        if fn.unit == "model":
            if fn.variant == "eager":
                assert not swapped_kinds(model), "the eager side of an end-to-end timing ran with swaps"
                return 1.0
            return 1.0 + sum(cost(n, k) for n, k in swapped(model))
        return 1.0 if fn.variant == "original" else unit_fused.get(fn.unit, 0.5)
    return timer


def e2e_timings(calls):
    """Number of end-to-end timings (each is ROUNDS paired rounds, one adopted call per round)."""
    adopted = sum(1 for v, u in calls if u == "model" and v == "adopted")
    assert adopted % ROUNDS == 0
    return adopted // ROUNDS


def assert_close_e2e(out, ref):
    cos = torch.nn.functional.cosine_similarity(out.flatten().double(), ref.flatten().double(), dim=0)
    rel = (out - ref).abs().max() / ref.abs().max()
    assert cos >= TOL["cos_min"] and rel <= TOL["fp32_rel"], (float(cos), float(rel))


def test_units_faster_but_whole_slower_all_refused_and_model_is_the_original():
    model, x = gemma_like(), tokens()
    originals = dict(model.named_modules())
    with torch.no_grad():
        ref = model(x)
    calls = []
    timer = whole_model_timer(model, {"rms_norm": 0.01, "gated_mlp": 0.02, "linear_merge": 0.005}, calls=calls)
    model, report = accelerate(model, (x,), timer=timer, rounds=ROUNDS)
    gated = [u for u in report.units if u.gain is not None and u.gain >= 0.02 and u.cosine >= TOL["cos_min"]]
    assert len(gated) >= 9 and {u.kind for u in gated} == {"rms_norm", "gated_mlp", "linear_merge"}
    assert not report.kept and not swapped_kinds(model)
    assert dict(model.named_modules()) == originals
    for u in gated:
        assert u.reason.startswith("end-to-end latency: whole forward 1.000 s -> "), u.reason
        assert "reverted: no subset gained >= 2%" in u.reason
    e = report.end_to_end
    assert e.decided_by.startswith("reverted") and e.gain == 0.0 and e.latency_adopted_s == e.latency_eager_s
    assert e.trials[0]["step"] == "all kept" and e.trials[0]["units"] == len(gated) and e.trials[0]["gain"] < 0
    assert e.cosine == 1.0 and e.max_rel_err == 0.0
    assert 1 < e2e_timings(calls) <= 8
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    assert "refused: end-to-end latency" in str(report) and "reverted" in str(report)


def test_kind_that_slows_the_whole_is_dropped_and_the_good_kind_kept():
    model, x = gemma_like(), tokens()
    with torch.no_grad():
        ref = model(x)
    calls = []
    # 5 norms save 0.03 each (-0.15), 2 gated MLPs cost 0.1 each (+0.2): all together 1.05 (slower).
    timer = whole_model_timer(model, {"rms_norm": -0.03, "gated_mlp": 0.1}, calls=calls)
    model, report = accelerate(model, (x,), timer=timer, rounds=ROUNDS, kinds=["rms_norm", "gated_mlp"])
    assert sorted({u.kind for u in report.kept}) == ["rms_norm"] and len(report.kept) == 5
    for name in ("layers.0.mlp", "layers.1.mlp"):
        unit = report.unit(name)
        assert not unit.kept and unit.gain == pytest.approx(1.0)  # faster alone, refused end to end
        assert unit.reason.startswith("end-to-end latency: whole forward") and "kind rms_norm alone" in unit.reason
    assert not isinstance(model.layers[0].mlp, AdoptedModule) and isinstance(model.norm, AdoptedModule)
    e = report.end_to_end
    assert e.decided_by.startswith("kind rms_norm alone: 5/7 units")
    assert e.latency_eager_s == 1.0 and e.latency_adopted_s == pytest.approx(0.85)
    assert e.gain == pytest.approx(1.0 / 0.85 - 1.0)
    steps = [t["step"] for t in e.trials]
    assert steps == ["all kept", "kind rms_norm alone", "kind gated_mlp alone"]
    assert e.trials[0]["gain"] == pytest.approx(1.0 / 1.05 - 1.0)
    assert e2e_timings(calls) == 3
    with torch.no_grad():
        out = model(x)
    assert_close_e2e(out, ref)
    assert report.unit("norm").stats.fused_calls == 1  # the kept kind really runs


def test_whole_faster_keeps_every_unit_after_one_timing():
    model, x = gemma_like(), tokens()
    with torch.no_grad():
        ref = model(x)
    calls = []
    timer = whole_model_timer(model, {"rms_norm": -0.01, "gated_mlp": -0.02, "linear_merge": 0.001}, calls=calls)
    model, report = accelerate(model, (x,), timer=timer, rounds=ROUNDS)
    assert sorted({u.kind for u in report.kept}) == ["gated_mlp", "linear_merge", "rms_norm"]
    assert all(u.reason == "kept" for u in report.kept)
    e = report.end_to_end
    assert e.decided_by.startswith("all kept:") and e2e_timings(calls) == 1
    expected = 1.0 - 0.01 * 5 - 0.02 * 2 + 0.001 * 3 * 2  # two merged q/k/v units of three modules each
    assert e.latency_adopted_s == pytest.approx(expected) and e.gain == pytest.approx(1.0 / expected - 1.0)
    with torch.no_grad():
        assert_close_e2e(model(x), ref)


def test_marginal_units_of_one_kind_dropped_by_halving():
    model, x = gemma_like(), tokens()
    calls = []
    marginal = {"layers.0.input_layernorm", "layers.0.post_attention_layernorm"}
    # Layer-0 norms save little alone (0.9 vs 1.0) and, swapped in, cost the whole model 0.05 each; the
    # others save 0.5 alone and 0.01 each in the whole: all five 1.07 (slower), the best three 0.97.
    timer = whole_model_timer(model, lambda name, kind: 0.05 if name in marginal else -0.01,
                              {n: 0.9 for n in marginal}, calls)
    model, report = accelerate(model, (x,), timer=timer, rounds=ROUNDS, kinds=["rms_norm"])
    assert {u.name for u in report.kept} == {"norm", "layers.1.input_layernorm", "layers.1.post_attention_layernorm"}
    for name in marginal:
        assert report.unit(name).reason.startswith("end-to-end latency:")
    e = report.end_to_end
    assert e.decided_by.startswith("best 3 of 5 (rms_norm) by unit saving: 3/5 units")
    assert e.gain == pytest.approx(1.0 / 0.97 - 1.0) and e2e_timings(calls) == 2


@pytest.mark.parametrize("limit, layers", [(1, 8), (3, 8), (8, 64)])
def test_number_of_end_to_end_timings_is_bounded(limit, layers):
    # 2 * layers + 1 norms of one kind, every subset slower: all kept, then halving the ranked units
    # (64 layers: 129, 65, 33, ..., 1 would be 9 timings; 8 layers: 17, 9, 5, 3, 2, 1 would be 6).
    model, x = randomized(GemmaLike(layers=layers)), tokens()
    with torch.no_grad():
        ref = model(x)
    calls = []
    timer = whole_model_timer(model, {"rms_norm": 0.01}, calls=calls)
    model, report = accelerate(model, (x,), timer=timer, rounds=ROUNDS, kinds=["rms_norm"], e2e_trials=limit)
    e = report.end_to_end
    assert e2e_timings(calls) == limit and len(e.trials) == limit
    halving = [2 * layers + 1]
    while halving[-1] > 1:
        halving.append((halving[-1] + 1) // 2 if halving[-1] > 2 else 1)
    assert [t["units"] for t in e.trials] == halving[:limit]
    assert not report.kept and e.decided_by.startswith(f"reverted: no subset gained >= 2% in {limit} timings")
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_no_end_to_end_timing_budget_is_refused():
    with pytest.raises(AdoptError, match="e2e_trials must be >= 1, got 0"):
        accelerate(gemma_like(), (tokens(),), timer=whole_model_timer(None, {}), e2e_trials=0)


def test_eager_side_of_every_timing_is_the_original_module_objects():
    model, x = gemma_like(), tokens()
    originals = dict(model.named_modules())
    seen = {"eager": 0, "adopted": 0}

    def timer(fn):
        fn()
        if fn.unit == "model":
            now = dict(model.named_modules())
            if fn.variant == "eager":  # exactly as after detach(): the same objects under the same names
                assert now.keys() == originals.keys() and all(now[n] is m for n, m in originals.items())
            else:
                assert any(isinstance(m, AdoptedModule) for m in now.values())
            seen[fn.variant] += 1
            # Slower as a whole, so the subset search runs several configurations, each against the eager.
            return 1.0 if fn.variant == "eager" else 1.0 + 0.01 * len(swapped(model))
        return 1.0 if fn.variant == "original" else 0.5

    model, report = accelerate(model, (x,), timer=timer, rounds=ROUNDS)
    assert seen["eager"] == seen["adopted"] >= 2 * ROUNDS
    assert not report.kept and dict(model.named_modules()) == originals


def test_refused_units_leave_no_wrapper_behind():
    model, x = gemma_like(), tokens()
    originals = dict(model.named_modules())

    def timer(fn):  # layers.0.mlp slower alone (latency gate); gated MLPs slow the whole (end-to-end gate)
        fn()
        if fn.unit == "model":
            return 1.0 if fn.variant == "eager" else 1.0 + sum(0.5 if k == "gated_mlp" else -0.03
                                                               for _, k in swapped(model))
        if fn.variant == "original":
            return 1.0
        return 1.5 if fn.unit == "layers.0.mlp" else 0.5

    model, report = accelerate(model, (x,), timer=timer, rounds=ROUNDS)
    refused = [u for u in report.units if not u.kept and u.cosine is not None]
    assert {u.reason.split(":")[0] for u in refused} >= {"latency", "end-to-end latency"}
    for u in refused:
        for name in u.name.split("+") if "[" not in u.name else [
                f"{u.name.split('[')[0]}.{m}" for m in u.name.split("[")[1].rstrip("]").split(",")]:
            assert model.get_submodule(name) is originals[name], name
    kept_modules = {n for u in report.kept for n in (
        [u.name] if "[" not in u.name else [f"{u.name.split('[')[0]}.{m}"
                                            for m in u.name.split("[")[1].rstrip("]").split(",")])}
    assert {n for n, _ in swapped(model)} == kept_modules
    for name, module in model.named_modules():
        if name not in kept_modules and not any(name.startswith(k + ".") for k in kept_modules):
            assert module is originals[name], name


class FakeGraphs:
    """Stands in for graph.GraphedMethod on the CPU: a capture freezes which swaps are installed (or raises
    where `fails(swaps)`); a replay records that configuration, for the timer to price, and runs the method."""

    def __init__(self, fails=lambda swaps: False):
        self.fails, self.attempts, self.captured, self.replayed = fails, [], [], None

    def __call__(self, owner, name, args, kwargs):  # the GraphedMethod constructor
        swaps = swapped(owner)
        self.attempts.append(swaps)
        if self.fails(swaps):
            raise CaptureError("host sync during capture (fake)")
        self.captured.append(swaps)
        method = getattr(owner, name)

        def replay(*a, **k):
            self.replayed = swaps
            return method(*a, **k)
        return replay


def graph_mode(monkeypatch, fake):
    """accelerate() as where a method is captured on CUDA: end-to-end trials compare captured methods."""
    monkeypatch.setattr(e2e, "GraphedMethod", fake)
    monkeypatch.setattr(api, "_timers", lambda timer, capture, device: (timer, timer, True))


def replay_timer(model, fake, per_swap, modes):
    """Units as whole_model_timer; a whole-model call is priced by the configuration it ran: the captured
    one for a replay (the model itself may be configured otherwise by then), else the installed swaps."""
    def timer(fn):
        fake.replayed = None
        fn()
        if fn.unit != "model":
            return 1.0 if fn.variant == "original" else 0.5
        swaps = fake.replayed if fake.replayed is not None else swapped(model)
        modes.append("graph" if fake.replayed is not None else "eager")
        if fn.variant == "eager":
            assert not swaps, "the original side of an end-to-end timing ran with swaps"
        return 1.0 + sum(per_swap.get(k, 0.0) for _, k in swaps)
    return timer


# Whole model: norms save 0.01 each, gated MLPs cost 0.05 each: all kept is slower, norms alone are faster.
GRAPH_COSTS = {"rms_norm": -0.01, "gated_mlp": 0.05}


def test_graph_mode_trials_time_captured_methods(monkeypatch):
    model, x = gemma_like(), tokens()
    with torch.no_grad():
        ref = model(x)
    fake, modes = FakeGraphs(), []
    graph_mode(monkeypatch, fake)
    model, report = accelerate(model, (x,), timer=replay_timer(model, fake, GRAPH_COSTS, modes), rounds=ROUNDS,
                               capture="forward")
    e = report.end_to_end
    assert e.decided_by.startswith("kind rms_norm alone") and {u.kind for u in report.kept} == {"rms_norm"}
    assert e.latency_adopted_s == pytest.approx(0.95) and e.latency_eager_s == 1.0
    assert e.timing == "graph" and not e.timing_note and all(t["timing"] == "graph" for t in e.trials)
    assert set(modes) == {"graph"}
    # The original is captured once, first; then one capture per trial, each of the trial's configuration.
    assert fake.captured[0] == [] and len(fake.captured) == 1 + len(e.trials)
    for swaps, t in zip(fake.captured[1:], e.trials):
        every = {"rms_norm", "gated_mlp", "linear_merge"}
        assert {k for _, k in swaps} == (every if t["step"] == "all kept" else {t["step"].split()[1]}), t["step"]
    assert "timing: units injected, end to end graph" in str(report)
    with torch.no_grad():
        assert_close_e2e(model(x), ref)


def test_graph_mode_trial_that_cannot_be_captured_is_timed_eagerly(monkeypatch):
    model, x = gemma_like(), tokens()
    fake, modes = FakeGraphs(fails=lambda swaps: any(k == "gated_mlp" for _, k in swaps)), []
    graph_mode(monkeypatch, fake)
    model, report = accelerate(model, (x,), timer=replay_timer(model, fake, GRAPH_COSTS, modes), rounds=ROUNDS)
    e = report.end_to_end
    rows = {t["step"]: t["timing"] for t in e.trials}
    assert rows["all kept"].startswith("eager (graph capture failed: CaptureError: host sync")
    assert rows["kind gated_mlp alone"].startswith("eager (graph capture failed")
    assert rows["kind rms_norm alone"] == "graph"
    assert e.timing == "mixed" and e.timing_note.startswith(f"{sum(r != 'graph' for r in rows.values())} of "
                                                            f"{len(rows)} end-to-end trial(s) timed eagerly")
    assert "(first: all kept: eager (graph capture failed: CaptureError: host sync" in e.timing_note
    assert e.timing_note in str(report)
    assert {u.kind for u in report.kept} == {"rms_norm"} and modes.count("eager") == 4 * ROUNDS


def test_graph_mode_original_that_cannot_be_captured_times_every_trial_eagerly(monkeypatch):
    model, x = gemma_like(), tokens()
    fake, modes = FakeGraphs(fails=lambda swaps: not swaps), []
    graph_mode(monkeypatch, fake)
    model, report = accelerate(model, (x,), timer=replay_timer(model, fake, GRAPH_COSTS, modes), rounds=ROUNDS)
    e = report.end_to_end
    assert len(fake.attempts) == 1 and not fake.captured  # tried once, not once per trial
    assert e.timing == "eager" and set(modes) == {"eager"} and len(e.trials) > 1
    assert e.timing_note.startswith(f"{len(e.trials)} of {len(e.trials)} end-to-end trial(s) timed eagerly")
    assert "CaptureError: host sync during capture (fake)" in e.timing_note
    assert e.decided_by.startswith("kind rms_norm alone")
