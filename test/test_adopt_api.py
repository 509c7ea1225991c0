"""accelerate()/detach() on small Gemma-like, SigLIP-like and AdaRMS models: which units are kept or refused
(parity gate, latency gate with an injected timer, end-to-end gate), fallbacks, detach, the report."""
import json

import pytest
import torch
from torch import nn

from flashrt_core.adopt import (
    AdoptError, AdoptReport, DefaultTimer, GraphTimer, Plan, Replacement, TimedCall, accelerate, detach,
)
from flashrt_core.adopt import api, gates
from flashrt_core.adopt.graph import GraphedMethod
from test_adopt_models import (
    BATCH, TOKENS, GemmaNorm, cond, expert_like, gemma_like, siglip_like, tokens,
)

# Tolerance table: adopted fp32 models against their own eager output.
TOL = {"cos_min": 0.999, "fp32_rel": 1e-3}


def fused_is_faster(fn):
    """Injected timer: the original (or eager model) takes 1.0, every fused form 0.5; fn still runs."""
    fn()
    return 1.0 if fn.variant in ("original", "eager") else 0.5


def fused_is_slower_for(*units):
    def timer(fn):
        fn()
        if fn.variant in ("original", "eager"):
            return 1.0
        return 1.5 if fn.unit in units else 0.5
    return timer


def patches(t=TOKENS, seed=5):
    return torch.randn(BATCH, t, 27, generator=torch.Generator().manual_seed(seed))


def assert_close_e2e(out, ref):
    cos = torch.nn.functional.cosine_similarity(out.flatten().double(), ref.flatten().double(), dim=0)
    rel = (out - ref).abs().max() / ref.abs().max()
    assert cos >= TOL["cos_min"] and rel <= TOL["fp32_rel"], (float(cos), float(rel))


def kinds_kept(report):
    return sorted({u.kind for u in report.kept})


def test_gemma_like_adopted_units_kept():
    model, x = gemma_like(), tokens()
    ref = model(x)
    model, report = accelerate(model, (x,), timer=fused_is_faster)
    assert kinds_kept(report) == ["gated_mlp", "linear_merge", "rms_norm"]
    assert report.unit("layers.0.input_layernorm").detail.startswith("gemma (1+w)")
    assert report.unit("layers.1.self_attn[q_proj,k_proj,v_proj]").kept
    # RoPE attention is structurally an attention block but not plain SDPA: listed, not swapped.
    assert report.unit("layers.0.self_attn").reason.startswith("not recognised")
    # The GELU inside a kept gated MLP is not a separate unit.
    assert not any(u.name.endswith("act_fn") for u in report.units)
    with torch.no_grad():
        out = model(x)
    assert_close_e2e(out, ref)
    merged = report.unit("layers.0.self_attn[q_proj,k_proj,v_proj]")
    assert merged.stats.fused_calls == 3 and merged.stats.fallback_calls == 0
    assert report.end_to_end.cosine >= TOL["cos_min"] and report.end_to_end.gain == pytest.approx(1.0)


def test_siglip_like_adopted_units_kept():
    model, x = siglip_like(), patches()
    ref = model(x)
    model, report = accelerate(model, (x,), timer=fused_is_faster)
    # The attention block is kept whole, so its q/k/v are not offered again as a linear merge.
    assert kinds_kept(report) == ["attention", "layer_norm", "mlp"]
    assert "4/4 heads x 12, bidirectional" in report.unit("layers.0.self_attn").detail
    assert "attention weights not returned" in report.unit("layers.0.self_attn").detail
    with torch.no_grad():
        assert_close_e2e(model(x), ref)


def test_ada_rms_expert_adopted():
    model, x, c = expert_like(), tokens(), cond()
    ref = model(x, c)
    model, report = accelerate(model, (x, c), timer=fused_is_faster)
    assert {"ada_rms_norm", "gated_mlp"} <= set(kinds_kept(report))
    with torch.no_grad():
        assert_close_e2e(model(x, c), ref)


class WrongNorm(nn.Module):
    """A deliberately wrong fused norm: forgets the 1 + w scale."""

    def __init__(self, original):
        super().__init__()
        self.original = [original]

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


WRONG_NORM = Replacement(
    "wrong_norm", structure=lambda m: isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 1
    and not list(m.children()), recognise=lambda m, calls: Plan("forgets (1+w)", lambda: WrongNorm(m)))


def test_wrong_fused_form_refused_by_parity_gate_and_builtin_kept_instead():
    model, x = gemma_like(), tokens()
    model, report = accelerate(model, (x,), timer=fused_is_faster, extra=[WRONG_NORM])
    wrong = [u for u in report.units if u.kind == "wrong_norm"]
    assert len(wrong) == 5 and not any(u.kept for u in wrong)
    assert all(u.reason.startswith("parity: cos") for u in wrong)
    assert report.unit("norm").kind == "rms_norm" and report.unit("norm").kept


class ResidualClobberingNorm(nn.Module):
    """Right output, but scales its input in place: invisible to unit parity, fatal end to end when the
    input is the residual stream that the layer adds to afterwards."""

    def __init__(self, original, clobbers):
        super().__init__()
        self.original, self.clobbers = [original], clobbers

    def forward(self, x):
        y = self.original[0](x)
        if self.clobbers:
            x.mul_(2.0)
        return y


BAD_NORMS = {"layers.0.input_layernorm", "layers.1.post_attention_layernorm"}


def test_end_to_end_gate_bisects_to_the_offending_units():
    model, x = gemma_like(), tokens()
    names = {m: n for n, m in model.named_modules()}
    clobbering = Replacement("clobbering_norm", structure=lambda m: isinstance(m, GemmaNorm),
                             recognise=lambda m, calls: Plan("in-place side effect", lambda: ResidualClobberingNorm(
                                 m, names[m] in BAD_NORMS)))
    ref = model(x)
    model, report = accelerate(model, (x,), timer=fused_is_faster, extra=[clobbering], kinds=["clobbering_norm"])
    by_name = {u.name: u for u in report.units}
    assert set(by_name) == {"norm", "layers.0.input_layernorm", "layers.0.post_attention_layernorm",
                            "layers.1.input_layernorm", "layers.1.post_attention_layernorm"}
    for name, unit in by_name.items():
        assert unit.cosine == 1.0 and unit.max_rel_err == 0.0  # unit parity cannot see the side effect
        assert unit.kept == (name not in BAD_NORMS), name
        if name in BAD_NORMS:
            assert unit.reason.startswith("end to end: cos") and unit.e2e_cosine < 0.999
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_slower_fused_form_refused_by_latency_gate():
    model, x = gemma_like(), tokens()
    model, report = accelerate(model, (x,), timer=fused_is_slower_for("layers.0.mlp", "layers.1.mlp"))
    mlp = report.unit("layers.0.mlp")
    assert not mlp.kept and mlp.reason == "latency: gain -33.3% < 2%"
    assert mlp.latency_before_s == 1.0 and mlp.latency_after_s == 1.5
    assert report.unit("layers.0.input_layernorm").kept
    # With the gated MLP refused, its gate/up pair is merged as plain linears (and judged on its own).
    assert report.unit("layers.0.mlp[gate_proj,up_proj]").kept


def test_training_mode_refused():
    model = gemma_like()
    model.layers[1].mlp.train()
    with pytest.raises(AdoptError, match=r"'layers.1.mlp' is in training mode"):
        accelerate(model, (tokens(),), timer=fused_is_faster)


def test_other_shape_falls_back_to_original_and_is_counted():
    model, x = gemma_like(), tokens()
    other = tokens(t=TOKENS + 4, seed=11)
    with torch.no_grad():
        ref_other = model(other)
    model, report = accelerate(model, (x,), timer=fused_is_faster)
    assert report.fallback_calls == 0
    with torch.no_grad():
        out = model(other)
    assert torch.equal(out, ref_other)  # every unit ran its original
    assert report.unit("norm").stats.fallback_calls == 1 and report.unit("norm").stats.fused_calls == 0
    assert report.fallback_calls == sum(u.stats.fallback_calls for u in report.kept) > 10
    norm_row = next(u for u in json.loads(report.to_json())["units"] if u["name"] == "norm" and u["kept"])
    assert norm_row["fallback_calls"] == 1  # the JSON carries the live counters


def test_dtype_change_falls_back():
    model, x = gemma_like(), tokens()
    model, report = accelerate(model, (x,), timer=fused_is_faster, kinds=["rms_norm"])
    model.double()
    with torch.no_grad():
        out = model(x.double())
    assert out.dtype == torch.float64 and report.unit("norm").stats.fallback_calls == 1


def test_detach_restores_bit_exact_and_shares_parameters():
    model, x = siglip_like(), patches()
    with torch.no_grad():
        ref = model(x)
    keys = list(model.state_dict())
    originals = {n: m for n, m in model.named_modules()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    model, report = accelerate(model, (x,), timer=fused_is_faster)
    assert len(report.kept) > 5
    assert list(model.state_dict()) == keys  # swapped modules expose the same parameter names
    assert model.layers[0].mlp.fc1.weight.data_ptr() == ptrs["layers.0.mlp.fc1.weight"]
    with torch.no_grad():
        model(x)
    assert all(u.stats.fused_calls > 0 for u in report.kept)  # the fused path really ran
    assert detach(model) is model
    assert {n: m for n, m in model.named_modules()} == originals
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    accelerate(model, (x,), timer=fused_is_faster)  # adoptable again after detach


def test_train_mode_reaches_the_originals_and_survives_detach():
    """A wrapper runs its original in training mode, so the original must be in training mode then (dropout,
    batch statistics): `model.train()` reaches it through the wrapper, and detach keeps the model's mode."""
    model, x = siglip_like(), patches()
    model, report = accelerate(model, (x,), timer=fused_is_faster)
    wrapped = [m for m in model.modules() if isinstance(m, api.AdoptedModule)]
    assert wrapped
    model.train()
    assert all(w.training and w.original.training for w in wrapped)
    model.eval()
    assert all(not w.training and not w.original.training for w in wrapped)
    model.train()
    detach(model)
    assert all(m.training for m in model.modules())


def test_modules_with_hooks_are_left_alone():
    """A fused path does not run a submodule's hooks: a unit with any forward or backward hook is refused
    (and its hook keeps firing); the others are adopted as before."""
    model, x = gemma_like(), tokens()
    calls = []
    handle = model.norm.register_forward_hook(lambda m, i, o: calls.append(1))
    model, report = accelerate(model, (x,), timer=fused_is_faster)
    refused = [u for u in report.units if u.name == "norm"]
    assert refused and not any(u.kept for u in refused) and "hooks on norm" in refused[0].reason
    assert report.kept  # the others
    calls.clear()
    with torch.no_grad():
        model(x)
    assert calls == [1]
    handle.remove()


def test_a_swap_that_leaves_state_its_parent_reads_is_refused_end_to_end():
    """A GELU that also stores its output for the parent (a skip read from `self.act.last`): on the fused path
    the stored value stays the one of the gating run, so the model is right on the example input only. The
    end-to-end check on a perturbed copy of the inputs catches it; the model stays exact on new inputs."""
    import torch.nn.functional as F

    class RecordingGelu(nn.Module):
        def forward(self, x):
            self.last = F.gelu(x, approximate="tanh")
            return self.last

    class Net(nn.Module):
        def __init__(self, w=64):
            super().__init__()
            self.fc1, self.act, self.fc2, self.skip = nn.Linear(w, 4 * w), RecordingGelu(), nn.Linear(4 * w, w), \
                nn.Linear(4 * w, w)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x))) + self.skip(self.act.last)

    torch.manual_seed(1)
    net, x, x2 = Net().eval(), torch.randn(4, 64), torch.randn(4, 64)
    with torch.no_grad():
        want = net(x2)
    net, report = accelerate(net, (x,), timer=fused_is_faster)
    assert not any("act" in u.name.split("+") or u.name == "act" for u in report.kept), [u.name for u in report.kept]
    with torch.no_grad():
        got = net(x2)
    assert float((got - want).abs().max() / want.abs().max()) <= TOL["fp32_rel"]


def test_adopting_twice_refused():
    model, x = gemma_like(), tokens()
    accelerate(model, (x,), timer=fused_is_faster, kinds=["rms_norm"])
    with pytest.raises(AdoptError, match="already adopted"):
        accelerate(model, (x,), timer=fused_is_faster)


def test_report_json_round_trips_and_prints_a_table():
    model, x = gemma_like(), tokens()
    model, report = accelerate(model, (x,), timer=fused_is_slower_for("norm"), capture="forward")
    with torch.no_grad():
        model(tokens(t=3))  # one fallback per kept unit, so counters are non-zero in the JSON
    text = report.to_json()
    again = AdoptReport.from_json(text)
    assert again.to_json() == text
    assert again.unit("layers.0.mlp").stats.fallback_calls == 1
    table = str(report)
    assert "layers.0.mlp" in table and "refused: latency" in table and "end to end (forward" in table
    assert report.end_to_end.capture == "not captured: no CUDA"
    # An injected timer times everything eagerly, as given, capture or not; the report says so.
    e = report.end_to_end
    assert report.timing == "injected" and e.timing == "injected" and not report.timing_note
    assert all(t["timing"] == "injected" for t in e.trials if "gain" in t)
    assert all(u.timing == "injected" for u in report.units if u.gain is not None)
    data = json.loads(text)
    assert data["timing"] == "injected" and data["end_to_end"]["timing"] == "injected"
    assert "timing: units injected, end to end injected" in table


def test_report_from_json_without_timing_fields():
    model, x = gemma_like(), tokens()
    _, report = accelerate(model, (x,), timer=fused_is_faster, kinds=["rms_norm"])
    data = report.to_dict()
    for row in [data, data["end_to_end"]] + data["units"]:
        for key in ("timing", "timing_note"):
            row.pop(key, None)
    old = AdoptReport.from_json(json.dumps(data))
    assert old.timing == "" and old.end_to_end.timing == "" and old.kept and "timing: units -" in str(old)


def test_timer_selection_graph_only_when_capturing_on_cuda(monkeypatch):
    cuda = torch.device("cuda")
    assert api._timers(fused_is_faster, "forward", cuda) == (fused_is_faster, fused_is_faster, False)
    unit, e2e, graph = api._timers(None, "forward", torch.device("cpu"))
    assert isinstance(unit, DefaultTimer) and unit is e2e and not graph
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GraphTimer() itself touches no device
    unit, e2e, graph = api._timers(None, "forward", cuda)
    assert isinstance(unit, GraphTimer) and isinstance(e2e, DefaultTimer) and unit.fallback is e2e and graph
    assert gates.timer_mode(unit) == "graph" and gates.timer_mode(e2e) == "eager"
    unit, e2e, graph = api._timers(None, None, cuda)  # nothing to capture: eager, as the model will run
    assert isinstance(unit, DefaultTimer) and unit is e2e and not graph
    with pytest.raises(ValueError, match="CUDA"):
        GraphTimer(torch.device("cpu"))


def test_unknown_kind_and_missing_method_are_refused():
    model, x = gemma_like(), tokens()
    with pytest.raises(AdoptError, match=r"kinds: unknown kind\(s\) \['rmsnorm'\]"):
        accelerate(model, (x,), timer=fused_is_faster, kinds=["rmsnorm"])
    with pytest.raises(AdoptError, match="'sample_actions'"):
        accelerate(model, (x,), timer=fused_is_faster, capture="sample_actions")


def test_default_timer_runs_on_cpu_without_injection():
    # Real numbers decide here; only check that every unit was judged and the model still matches.
    model, x = gemma_like(), tokens()
    ref = model(x)
    model, report = accelerate(model, (x,), rounds=1, capture="forward")
    assert report.units and all(u.reason for u in report.units)
    assert report.timing == "eager" and report.end_to_end.timing == "eager"  # no graph timing without CUDA
    assert all(u.timing == "eager" for u in report.units if u.gain is not None)
    assert all(u.latency_before_s > 0 for u in report.units if u.latency_before_s is not None)
    with torch.no_grad():
        assert_close_e2e(model(x), ref)


@pytest.mark.gpu
def test_cuda_graph_capture_of_forward():
    model, x = gemma_like().cuda(), tokens().cuda()
    ref = model(x)
    def graph_is_fastest(fn):  # the captured method must also beat the adopted eager one to be kept
        fn()
        return {"original": 1.0, "eager": 1.0, "graph": 0.25}.get(fn.variant, 0.5)
    model, report = accelerate(model, (x,), capture="forward", timer=graph_is_fastest)
    assert report.end_to_end.capture.startswith("captured forward"), report.end_to_end.capture
    assert report.end_to_end.latency_graph_s == 0.25 and report.timing == "injected"
    with torch.no_grad():
        assert_close_e2e(model(x), ref)
    detach(model)
    assert "forward" not in vars(model)


@pytest.mark.gpu
def test_graphed_method_replays_however_the_arguments_are_passed():
    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = gemma_like()

        def sample_actions(self, tokens, noise=None, scale=1.0, **extra):
            return self.net(tokens) * scale + (0 if noise is None else noise) + extra["bias"] - 2 * extra["shift"]
    policy = Policy().cuda()
    gen = torch.Generator(device="cuda").manual_seed(11)

    def inputs():
        x = tokens().cuda() + torch.randn(tokens().shape, generator=gen, device="cuda")
        shape = policy.sample_actions(x, bias=0.0, shift=0.0).shape
        return x, *(torch.randn(shape, generator=gen, device="cuda") for _ in range(3))
    with torch.no_grad():
        x, noise, bias, shift = inputs()
        graphed = GraphedMethod(policy, "sample_actions", (), {"tokens": x, "noise": noise, "bias": bias,
                                                               "shift": shift})
        # Fresh inputs each call (the static buffers must be refilled), passed in different forms.
        calls = [lambda x, n, b, s: ((x, n), {"bias": b, "shift": s}),
                 lambda x, n, b, s: ((x,), {"shift": s, "noise": n, "scale": 1.0, "bias": b}),
                 lambda x, n, b, s: ((), {"tokens": x, "noise": n, "bias": b, "shift": s})]
        for form in calls:
            args, kwargs = form(*inputs())
            torch.testing.assert_close(graphed(*args, **kwargs), policy.sample_actions(*args, **kwargs),
                                       rtol=1e-5, atol=1e-5)
        assert graphed.stats.fused_calls == 3 and graphed.stats.fallback_calls == 0
        x, noise, bias, shift = inputs()
        torch.testing.assert_close(graphed(x, noise, 2.0, bias=bias, shift=shift),
                                   policy.sample_actions(x, noise, 2.0, bias=bias, shift=shift), rtol=1e-5, atol=1e-5)
    assert graphed.stats.fallback_calls == 1  # another plain value: the eager method


@pytest.mark.gpu
def test_graph_timer_falls_back_to_eager_when_capture_raises():
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(257, 129, generator=gen, device="cuda") + 0.5
    caller = torch.cuda.current_stream()
    timer = GraphTimer(x.device)
    syncs = TimedCall(lambda: float((x * 2).sum()), "fused", "syncs")  # a host sync: cannot be captured
    assert timer(syncs) > 0
    assert timer.mode_of("syncs") == "eager" and "syncs" in timer.eager_only and timer.captures == 0
    assert torch.cuda.current_stream() == caller and not torch.cuda.is_current_stream_capturing()
    plain = TimedCall(lambda: torch.nn.functional.gelu(x), "original", "plain")
    assert timer(plain) > 0 and timer.captures == 1 and timer.mode_of("plain") == "graph"
    torch.testing.assert_close((x * 2).sum(), x.double().sum().float() * 2, rtol=1e-4, atol=1e-3)
    # A unit whose fused side cannot be captured is timed eagerly on both sides, every round.
    calls = {"original": 0, "fused": 0}

    def counted(variant, fn):
        def run():
            calls[variant] += 1
            return fn()
        return TimedCall(run, variant, "mixed")
    timing = gates.paired_timing(timer, counted("original", lambda: torch.nn.functional.gelu(x)),
                                 counted("fused", lambda: float(x.sum())), rounds=3)
    assert timer.mode_of("mixed") == "eager" and timing.before_s > 0 and timing.after_s > 0
    assert calls["fused"] > 6  # the first rounds were redone once the capture had failed


@pytest.mark.gpu
def test_graph_timing_when_capturing_without_an_injected_timer():
    model, x = gemma_like().cuda(), tokens().cuda()
    with torch.no_grad():
        ref = model(x)
    model, report = accelerate(model, (x,), capture="forward", rounds=1)
    assert report.timing == "graph" and report.end_to_end.timing == "graph", (report.timing_note,
                                                                                report.end_to_end.timing_note)
    assert all(u.timing == "graph" for u in report.units if u.gain is not None)
    assert all(t["timing"] == "graph" for t in report.end_to_end.trials if "gain" in t)
    with torch.no_grad():
        assert_close_e2e(model(x), ref)
    detach(model)
