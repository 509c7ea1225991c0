"""`accelerate(model, example_inputs)` and `detach(model)`: parity- and latency-gated swaps, in place.

Order of work: one captured run of the example inputs (the eager reference output, plus every interesting
submodule's calls); then, kind by kind (larger units first), each recognised unit must pass its own parity on
its captured calls and the paired A/B timing; the units of a kind that passed are swapped in together and the
whole model is checked end to end against the reference, on the example inputs and on a perturbed copy of
them (a swap that leaves state its parent reads would only be right for the inputs it was gated on; a failing
set is bisected to the offending units);
then the whole model (or method) with the kept swaps is timed against the original, and if it does not gain,
the best-measured subset that does is kept, or none (e2e.py); finally, if asked, a method is captured as a
CUDA graph.

Timing follows the execution mode the model will run in: when a method is to be captured on CUDA (and no timer
is injected), units are timed as CUDA graph replays (gates.GraphTimer) and the end-to-end trials compare
captured methods (e2e.py), since a graph removes the host launch cost that dominates eager timings.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map

from flashrt_core.adopt import gates
from flashrt_core.adopt.candidates import Candidate, merge_candidates, module_candidates
from flashrt_core.adopt.capture import run_with_capture
from flashrt_core.adopt.e2e import DEFAULT_MAX_TRIALS, latency_gate
from flashrt_core.adopt.graph import GraphedMethod
from flashrt_core.adopt.kinds import BUILTIN_ORDER, KINDS, Replacement
from flashrt_core.adopt.kinds.base import first_tensor
from flashrt_core.adopt.report import AdoptReport, EndToEnd
from flashrt_core.adopt.wrappers import AdoptedModule, UnitStats, set_submodule
from flashrt_core.errors import FlashRTError

DEFAULT_ROUNDS = 7
_QUIET_KINDS = {"gelu"}  # every parameterless module is structurally a GELU candidate: do not list misses


class AdoptError(FlashRTError):
    """accelerate() cannot adopt this model as given (training mode, bad argument, already adopted)."""


def _refuse_training(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if module.training:
            where = f"submodule {name!r}" if name else "the model"
            raise AdoptError(f"{where} is in training mode (training=True); adopt only for inference: call "
                             f"model.eval() first")


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _device_of(model: nn.Module, args, kwargs) -> torch.device:
    for p in model.parameters():
        return p.device
    for t in gates.tensors_in((args, kwargs)):
        return t.device
    return torch.device("cpu")


class _Session:
    """timer: per-unit timings; e2e_timer: whole-method calls (eager ones, or replays of captured ones when
    graph_e2e: a graph cannot be captured around another graph's replay)."""

    def __init__(self, model, entry, args, kwargs, device, timer, rounds, min_gain, cos_min, max_rel_err,
                 e2e_timer=None, graph_e2e: bool = False):
        self.model, self.entry, self.args, self.kwargs, self.device = model, entry, args, kwargs, device
        self.timer, self.rounds, self.min_gain, self.cos_min = timer, rounds, min_gain, cos_min
        self.max_rel_err = max_rel_err
        self.e2e_timer, self.graph_e2e = e2e_timer or timer, graph_e2e
        self.kept: list[Candidate] = []

    # -- running the model
    def run_seeded(self, inputs=None):
        """The parity run: fixed RNG, and fresh copies of the inputs (default: the example ones) so a unit that
        writes into its input cannot change what later checks compare against."""
        args, kwargs = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                                inputs if inputs is not None else (self.args, self.kwargs))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(0)
            return self.entry(*args, **kwargs)

    def run_plain(self):
        with torch.no_grad():
            return self.entry(*self.args, **self.kwargs)

    def bound(self, *sources) -> float:
        if self.max_rel_err is not None:
            return self.max_rel_err
        return gates.MAX_REL_ERR[gates.compute_dtype(*sources)]

    # -- one unit
    def install(self, cand: Candidate) -> None:
        for name, wrapper in cand.wrappers.items():
            set_submodule(self.model, name, wrapper)

    def uninstall(self, cand: Candidate) -> None:
        for name, original in cand.originals.items():
            set_submodule(self.model, name, original)

    def gate_unit(self, cand: Candidate) -> bool:
        unit = cand.report
        stats = UnitStats()
        unit.stats = stats
        hooked = _hooked(cand.originals)
        if hooked:
            unit.reason = f"hooks on {hooked}: the fused path would not run them"
            return False
        try:
            cand.wrappers = cand.build(stats)
            with torch.no_grad():
                ref = [cand.originals[n](*c.args, **c.kwargs) for n, c in cand.calls]
                new = [cand.wrappers[n](*c.args, **c.kwargs) for n, c in cand.calls]
            if cand.main_output_only:
                ref, new = [first_tensor(o) for o in ref], [first_tensor(o) for o in new]
            par = gates.parity(ref, new)
        except Exception as exc:  # a fused form that cannot run on these inputs is simply refused
            unit.reason = f"fused form failed: {type(exc).__name__}: {exc}"
            return False
        unit.cosine, unit.max_rel_err = par.cosine, par.max_rel_err
        inputs = [t for _, c in cand.calls for t in gates.tensors_in((c.args, c.kwargs))]
        unit.rel_err_bound = self.bound(*cand.originals.values(), inputs)
        if not par.passes(self.cos_min, unit.rel_err_bound):
            unit.reason = (f"parity: cos {par.cosine:.6f} (min {self.cos_min}), rel err {par.max_rel_err:.2e} "
                           f"(max {unit.rel_err_bound:.0e})")
            return False

        def replay(modules):
            def fn():
                with torch.no_grad():
                    for n, c in cand.calls:
                        modules[n](*c.args, **c.kwargs)
            return fn

        timing = gates.paired_timing(self.timer, gates.TimedCall(replay(cand.originals), "original", unit.name),
                                     gates.TimedCall(replay(cand.wrappers), "fused", unit.name), self.rounds)
        unit.latency_before_s, unit.latency_after_s, unit.gain = timing.before_s, timing.after_s, timing.gain
        unit.timing = gates.timer_mode(self.timer, unit.name)
        if not timing.passes(self.min_gain):
            unit.reason = f"latency: gain {timing.gain:+.1%} < {self.min_gain:.0%}"
            return False
        return True

    # -- end to end
    def e2e(self):
        try:
            first = gates.parity(self.reference, self.run_seeded())
            second = gates.parity(self.reference2, self.run_seeded(self.inputs2))
            return gates.Parity(min(first.cosine, second.cosine), max(first.max_rel_err, second.max_rel_err)), None
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def settle(self, cands: list[Candidate]) -> None:
        """Swap in all of `cands`; keep them if the whole model still matches, else bisect."""
        if not cands:
            return
        for c in cands:
            self.install(c)
        par, err = self.e2e()
        bound = self.bound(self.model)
        if par is not None and par.passes(self.cos_min, bound):
            for c in cands:
                c.report.kept, c.report.reason = True, "kept"
                c.report.e2e_cosine, c.report.e2e_max_rel_err = par.cosine, par.max_rel_err
            self.kept.extend(cands)
            return
        for c in cands:
            self.uninstall(c)
        if len(cands) == 1:
            unit = cands[0].report
            if par is None:
                unit.reason = f"end to end: model failed with the swap: {err}"
            else:
                unit.e2e_cosine, unit.e2e_max_rel_err = par.cosine, par.max_rel_err
                unit.reason = f"end to end: cos {par.cosine:.6f}, rel err {par.max_rel_err:.2e} (max {bound:.0e})"
            return
        half = len(cands) // 2
        self.settle(cands[:half])
        self.settle(cands[half:])

    def taken(self) -> set[str]:
        return {name for c in self.kept for name in c.originals}


def _trial_order(kinds, extra) -> list[tuple[str, Replacement | None]]:
    if kinds is not None:
        unknown = set(kinds) - set(KINDS) - {r.kind for r in extra}
        if unknown:
            raise AdoptError(f"kinds: unknown kind(s) {sorted(unknown)}; known: {list(KINDS)}")
    order = [(r.kind, r) for r in extra] + list(BUILTIN_ORDER)
    return [(k, r) for k, r in order if kinds is None or k in kinds]


def _timers(timer, capture: str | None, device: torch.device):
    """(unit timer, end-to-end timer, whether end-to-end trials compare captured methods). Graph timing where
    the method will be captured on CUDA; an injected timer is used for everything, as given."""
    if timer is not None:
        return timer, timer, False
    eager = gates.DefaultTimer(device)
    if capture is not None and device.type == "cuda" and torch.cuda.is_available():
        return gates.GraphTimer(device, fallback=eager), eager, True
    return eager, eager, False


def accelerate(model: nn.Module, example_inputs, *, timer=None, min_gain: float = 0.02,
               rounds: int = DEFAULT_ROUNDS, capture: str | None = None, cos_min: float = 0.999,
               max_rel_err: float | None = None, kinds=None, method: str | None = None,
               extra: tuple[Replacement, ...] | list[Replacement] = (), e2e_trials: int = DEFAULT_MAX_TRIALS):
    """Swap known submodules of `model` (in place) for fused forms that pass parity and latency gates.

    example_inputs: a tuple of positional arguments, a dict of keyword arguments, or one tensor, for
        `model.<method>`; method defaults to `capture` when that names a method, else "forward".
    timer: `timer(fn) -> seconds per call`; fn has `.variant` and `.unit` attributes. Default: with `capture`
        on CUDA, CUDA graph replays per unit and captured methods end to end (the mode the model will run in);
        otherwise eager calls under CUDA events on CUDA, perf_counter on CPU. An injected timer is used for
        every timing (units, and eager calls of the whole method), as given.
        min_gain: the median per-round speed-up a swap must show (0.02 = 2%).
    cos_min / max_rel_err: parity bounds per unit and end to end; max_rel_err defaults by precision
        (gates.MAX_REL_ERR: 1e-3 fp32, 2e-2 bf16). kinds: restrict to these kinds. extra: more Replacements,
        tried before the built-in ones. capture: "forward" or a method name to capture as a CUDA graph.
    e2e_trials: at most this many end-to-end timings (each `rounds` paired rounds of the whole method) when
        the kept set does not gain `min_gain` as a whole and a subset that does is searched for.
    Returns (model, AdoptReport).
    Weights changed later through the parameters themselves (`load_state_dict`, `p.copy_`, `.to`) send the
    swapped modules back to their originals until adopted again; changes through `p.data` (as some LoRA
    merges write them) bypass autograd's version counter and are not seen: `detach` and adopt again then.
    Modules with hooks are not swapped (the fused path would skip the hooks).
    """
    if any(isinstance(m, AdoptedModule) for m in model.modules()):
        raise AdoptError("model is already adopted; call detach(model) before adopting it again")
    _refuse_training(model)
    if rounds < 1:
        raise AdoptError(f"rounds must be >= 1, got {rounds}")
    if e2e_trials < 1:
        raise AdoptError(f"e2e_trials must be >= 1, got {e2e_trials}")
    method = method or (capture if capture else "forward")
    entry = getattr(model, method, None)
    if not callable(entry):
        raise AdoptError(f"method: model has no callable {method!r}")
    if capture is not None and not callable(getattr(model, capture, None)):
        raise AdoptError(f"capture: model has no callable {capture!r}")
    args, kwargs = _split_inputs(example_inputs)
    device = _device_of(model, args, kwargs)
    order = _trial_order(kinds, list(extra))
    unit_timer, e2e_timer, graph_e2e = _timers(timer, capture, device)
    session = _Session(model, entry, args, kwargs, device, unit_timer, rounds, min_gain, cos_min, max_rel_err,
                       e2e_timer=e2e_timer, graph_e2e=graph_e2e)

    structures = [r.structure for _, r in order if r is not None]
    interesting = lambda m: isinstance(m, nn.Linear) or any(s(m) for s in structures)  # noqa: E731
    session.reference, cap = run_with_capture(model, session.run_seeded, interesting)
    session.inputs2 = _perturbed((args, kwargs))  # the second end-to-end input, same shapes (same signatures)
    session.reference2 = session.run_seeded(session.inputs2)
    report = AdoptReport(device=str(device), dtype=str(gates.compute_dtype(model)).replace("torch.", ""),
                         cos_min=cos_min, min_gain=min_gain, rounds=rounds, timing=gates.timer_mode(unit_timer))

    tried: list[Candidate] = []
    for kind, rep in order:
        if rep is None:
            found, misses = merge_candidates(model, cap, session.taken())
        else:
            found, misses = module_candidates(model, cap, rep, session.taken(), kind in _QUIET_KINDS)
        report.units.extend(misses)
        passed = []
        tried.extend(found)
        for cand in found:
            report.units.append(cand.report)
            if session.gate_unit(cand):
                passed.append(cand)
        session.settle(passed)
    failed = getattr(unit_timer, "eager_only", {})
    if failed:
        first = next(iter(failed.items()))
        report.timing_note = (f"{len(failed)} unit(s) timed eagerly: their calls could not be captured as a CUDA "
                              f"graph (first: {first[0]}: {first[1]})")

    report.end_to_end = _end_to_end(session, method, e2e_trials)
    _drop_refused(session, tried)
    if capture is not None:
        _capture(session, report.end_to_end, capture)
    for c in session.kept:
        c.report.stats.reset()
    return model, report


def _perturbed(inputs):
    """The inputs with every floating tensor moved by 10% of its spread in seeded directions (integer tensors,
    e.g. token ids or masks, unchanged): other values through the same call signatures."""
    g = torch.Generator().manual_seed(1)

    def bump(v):
        if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1):
            return v
        noise = torch.randn(v.shape, generator=g).to(device=v.device, dtype=v.dtype)
        return v + 0.1 * v.detach().float().std().to(v.dtype) * noise
    return tree_map(bump, inputs)


def _drop_refused(session: _Session, tried: list[Candidate]) -> None:
    """Refused units leave nothing behind: their originals are in place (not a pass-through wrapper) and their
    wrappers, with derived tensors such as merged weights, are released."""
    kept = {id(c) for c in session.kept}
    for cand in tried:
        if id(cand) not in kept:
            for name, original in cand.originals.items():
                if session.model.get_submodule(name) is cand.wrappers.get(name, original):
                    set_submodule(session.model, name, original)
            cand.wrappers = {}
    ours = {id(w) for c in session.kept for w in c.wrappers.values()}
    stray = [n for n, m in session.model.named_modules() if isinstance(m, AdoptedModule) and id(m) not in ours]
    if stray:
        raise AdoptError(f"internal: wrappers of refused units still installed: {stray[:5]}")


def _end_to_end(session: _Session, method: str, max_trials: int) -> EndToEnd:
    par, err = session.e2e()
    if par is None:
        raise AdoptError(f"the adopted model failed end to end: {err}")
    e = latency_gate(session, method, max_trials)
    par, err = session.e2e()  # the set finally kept (a subset of the one checked above, or none)
    if par is None:
        raise AdoptError(f"the adopted model failed end to end: {err}")
    e.cosine, e.max_rel_err = par.cosine, par.max_rel_err
    return e


def _capture(session: _Session, e: EndToEnd, name: str) -> None:
    if session.device.type != "cuda" or not torch.cuda.is_available():
        e.capture = "not captured: no CUDA"
        return
    model = session.model
    try:
        graphed = GraphedMethod(model, name, session.args, session.kwargs)
    except Exception as exc:
        e.capture = f"not captured: {type(exc).__name__}: {str(exc)[:200]}"
        return
    setattr(model, name, graphed)  # an instance attribute: detach() finds and removes it
    run = (lambda: graphed(*session.args, **session.kwargs))
    try:
        outs = []
        for _ in range(2):  # twice: a graph that corrupts its own constants fails the second time
            with torch.random.fork_rng(devices=[session.device]), torch.no_grad():
                torch.manual_seed(0)  # as the reference run, for methods that draw noise inside
                outs.append(run())
        par = min((gates.parity(session.reference, o) for o in outs), key=lambda p: p.cosine)
    except Exception as exc:
        delattr(model, name)
        e.capture = f"not captured: replay failed: {type(exc).__name__}: {exc}"
        return
    e.graph_cosine = par.cosine
    if not par.passes(session.cos_min, e.rel_err_bound):
        delattr(model, name)
        e.capture = f"not captured: parity cos {par.cosine:.6f}, rel err {par.max_rel_err:.2e}"
        return

    eager_call = gates.TimedCall(lambda: session.entry(*session.args, **session.kwargs), "adopted", name)
    graph_call = gates.TimedCall(run, "graph", name)
    # session.entry is the class's bound method, so eager_call runs the adopted model without the graph.
    with torch.no_grad():
        timing = gates.paired_timing(session.e2e_timer, eager_call, graph_call, session.rounds)
    e.latency_graph_s = timing.after_s
    if not timing.passes(session.min_gain):
        delattr(model, name)
        e.capture = f"not captured: graph gain {timing.gain:+.1%} < {session.min_gain:.0%}"
        return
    e.capture = f"captured {name} ({graphed.uploads_hoisted} host uploads hoisted)"


def _hooked(originals: dict) -> str | None:
    """The first of these modules (or their submodules) with forward or backward hooks, or None."""
    for name, module in originals.items():
        for sub, m in module.named_modules():
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                return f"{name}.{sub}" if sub else name
    return None


def detach(model: nn.Module) -> nn.Module:
    """Put every original submodule back (the same objects, so outputs are bit-exact and parameters shared)
    and remove captured graphs. Safe to call on a model that was never adopted."""
    swapped = [(name, m) for name, m in model.named_modules() if isinstance(m, AdoptedModule)]
    for name, wrapper in swapped:
        if not name:
            raise AdoptError("the root module itself is a swapped module; detach its parent instead")
        wrapper.original.train(wrapper.training)  # (the same mode the model had through the wrapper)
        set_submodule(model, name, wrapper.original)
    for module in model.modules():
        for attr in [k for k, v in vars(module).items() if isinstance(v, GraphedMethod)]:
            delattr(module, attr)
    return model
