"""The end-to-end latency gate: the whole model (or method) with the kept swaps against the original.

Per-unit gains need not add up: in a launch-bound eager model every wrapper adds Python and dispatch work,
and a unit timed alone on its captured inputs does not see the real call's overlap. So the kept set is timed
as a whole (paired A/B rounds, the original and the adopted model alternating, median of per-round ratios).
If it gains less than `min_gain`, a subset that does gain is searched for, in steps that each cost one
end-to-end timing, at most `max_trials` in all:
  1. all kept units;
  2. each kind alone (most promising first: the largest summed per-unit saving), then the union of the kinds
     that gained alone;
  3. if nothing gained yet: the most promising half of the best kind (or of all units when there is one
     kind), by per-unit saving, then its quarter, ... (drops the individually marginal units).
The subset with the best measured gain among those that passed is kept; if none passed, every swap is
reverted and the model is exactly the original. Each subset is checked for end-to-end parity before it is
timed (a subset of a set that passed need not pass itself).

Where the method will run as a CUDA graph (session.graph_e2e), each trial times replays of captured methods
(graph.GraphedMethod, host uploads hoisted): one graph of the original, captured once, against one graph of
the trial's configuration, freed after the trial. A configuration that cannot be captured is timed eagerly,
and the trial row and EndToEnd.timing_note say so.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from flashrt_core.adopt import gates
from flashrt_core.adopt.graph import GraphedMethod
from flashrt_core.adopt.report import EndToEnd
from flashrt_core.adopt.wrappers import AdoptedModule

DEFAULT_MAX_TRIALS = 8


@dataclass
class Trial:
    step: str  # "all kept", "kind rms_norm", "kinds a+b", "best 3 of rms_norm", ...
    cands: list  # the Candidates swapped in
    timing: gates.Timing | None = None
    parity_failed: str = ""
    mode: str = ""  # "graph", "eager", "injected"; "eager (...)" when a graph was asked for and failed

    def passes(self, min_gain: float) -> bool:
        return self.timing is not None and self.timing.passes(min_gain)

    def row(self) -> dict:
        row = {"step": self.step, "units": len(self.cands)}
        if self.timing is None:
            row["parity_failed"] = self.parity_failed
        else:
            row.update(before_s=self.timing.before_s, after_s=self.timing.after_s, gain=self.timing.gain,
                       timing=self.mode)
        return row


def duration(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _saving(cand) -> float:
    u = cand.report
    return (u.latency_before_s or 0.0) - (u.latency_after_s or 0.0)


class _Search:
    def __init__(self, session, method: str, max_trials: int):
        self.session, self.method, self.max_trials = session, method, max_trials
        self.all = list(session.kept)
        self.trials: list[Trial] = []
        self.timed = 0
        self.original_graph: GraphedMethod | None = None
        self.original_graph_error = ""

    def configure(self, subset) -> None:
        chosen = {id(c) for c in subset}
        for c in self.all:
            (self.session.install if id(c) in chosen else self.session.uninstall)(c)

    def as_original(self) -> None:
        """The eager side of a timing: every original module object back in place, as after detach(); a
        wrapper left anywhere (even one passing every call through) would be timed as 'eager'."""
        self.configure([])
        left = [n for n, m in self.session.model.named_modules() if isinstance(m, AdoptedModule)]
        if left:
            raise RuntimeError(f"end-to-end gate: wrappers still installed for the eager timing: {left[:5]}")

    def budget_left(self) -> bool:
        return self.timed < self.max_trials

    def trial(self, step: str, cands) -> Trial:
        s = self.session
        t = Trial(step, list(cands))
        self.trials.append(t)
        self.configure(t.cands)
        if t.cands and len(t.cands) < len(self.all):
            par, err = s.e2e()
            bound = s.bound(s.model)
            if par is None or not par.passes(s.cos_min, bound):
                t.parity_failed = err or f"cos {par.cosine:.6f}, rel err {par.max_rel_err:.2e} (max {bound:.0e})"
                return t
        self.timed += 1
        t.timing, t.mode = self.time_configs(t.cands)
        return t

    def time_configs(self, cands) -> tuple[gates.Timing, str]:
        """The original against `cands` swapped in, as captured methods where graph timing is asked for."""
        s = self.session

        def eager():
            return paired_with_setup(s, ("eager", self.as_original), ("adopted", lambda: self.configure(cands)),
                                     "model")
        if not s.graph_e2e:
            return eager(), gates.timer_mode(s.e2e_timer)
        adopted, why = None, self.original_graph_error
        if not why:
            try:
                if self.original_graph is None:
                    self.as_original()
                    self.original_graph = self.capture()
                self.configure(cands)
                adopted = self.capture() if cands else self.original_graph
            except Exception as exc:
                why = f"{type(exc).__name__}: {str(exc)[:200]}"
                if self.original_graph is None:
                    self.original_graph_error = why
        if adopted is None:
            return eager(), f"eager (graph capture failed: {why})"
        # This configuration's graph (and its memory pool) is freed on return; the original's is kept.
        return paired_graphs(s, self.original_graph, adopted), "graph"

    def capture(self) -> GraphedMethod:
        s = self.session
        caller = torch.cuda.current_stream(s.device) if s.device.type == "cuda" else None
        try:
            return GraphedMethod(s.model, self.method, s.args, s.kwargs)
        except Exception:
            if caller is not None:
                gates.recover_from_failed_capture(caller, s.device)
            raise

    def run(self, min_gain: float) -> Trial | None:
        first = self.trial("all kept", self.all)
        if first.passes(min_gain):
            return first
        if not self.all:
            return None
        kinds: dict[str, list] = {}
        for c in self.all:
            kinds.setdefault(c.report.kind, []).append(c)
        pool = self.all
        if len(kinds) > 1:
            order = sorted(kinds, key=lambda k: -sum(_saving(c) for c in kinds[k]))
            alone = []
            for k in order:
                if not self.budget_left():
                    break
                alone.append(self.trial(f"kind {k} alone", kinds[k]))
            good = [t for t in alone if t.passes(min_gain)]
            if len(good) > 1 and self.budget_left():
                self.trial("kinds " + "+".join(t.cands[0].report.kind for t in good),
                           [c for t in good for c in t.cands])
            timed = [t for t in alone if t.timing is not None]
            if not good and timed:
                pool = max(timed, key=lambda t: t.timing.gain).cands
        if not any(t.passes(min_gain) for t in self.trials):
            ranked = sorted(pool, key=_saving, reverse=True)
            size = len(ranked)
            while size > 1 and self.budget_left():
                size = (size + 1) // 2
                kinds_in = "+".join(sorted({c.report.kind for c in ranked[:size]}))
                if self.trial(f"best {size} of {len(ranked)} ({kinds_in}) by unit saving",
                              ranked[:size]).passes(min_gain):
                    break
        passed = [t for t in self.trials if t.passes(min_gain)]
        return max(passed, key=lambda t: t.timing.gain) if passed else None


def latency_gate(session, method: str, max_trials: int = DEFAULT_MAX_TRIALS) -> EndToEnd:
    """Time the kept set end to end; keep the best subset that gains (possibly none). Updates session.kept,
    the unit reports of dropped units and leaves the model configured with the chosen subset."""
    search = _Search(session, method, max_trials)
    try:
        chosen = search.run(session.min_gain)
    finally:
        search.original_graph = None
    first = search.trials[0]
    e = EndToEnd(method=method, rel_err_bound=session.bound(session.model),
                 trials=[t.row() for t in search.trials])
    e.timing, e.timing_note = _timing_summary(search.trials)
    keep = chosen.cands if chosen is not None else []
    search.configure(keep)
    if chosen is not None:
        timing = chosen.timing
        e.latency_eager_s, e.latency_adopted_s, e.gain = timing.before_s, timing.after_s, timing.gain
        e.decided_by = f"{chosen.step}: {len(keep)}/{len(search.all)} units" + (
            f" (all kept: {first.timing.gain:+.1%})" if chosen is not first else "")
    else:
        # Nothing kept: the adopted model is the original, so it costs what the original costs.
        e.latency_eager_s = statistics.median(t.timing.before_s for t in search.trials if t.timing)
        e.latency_adopted_s, e.gain = e.latency_eager_s, 0.0
        timed = [t for t in search.trials if t.timing]
        best = max(timed, key=lambda t: t.timing.gain)
        e.decided_by = ("nothing to time: no unit passed its own gates" if not search.all else
                        f"reverted: no subset gained >= {session.min_gain:.0%} in {search.timed} timings "
                        f"(best: {best.step} {best.timing.gain:+.1%})")
    summary = (f"whole {method} {duration(first.timing.before_s)} -> {duration(first.timing.after_s)} "
               f"({first.timing.gain:+.1%} < {session.min_gain:.0%}) with all {len(search.all)} kept units")
    kept_ids = {id(c) for c in keep}
    for c in search.all:
        if id(c) not in kept_ids:
            c.report.kept = False
            c.report.reason = f"end-to-end latency: {summary}; {e.decided_by}"
    session.kept = [c for c in search.all if id(c) in kept_ids]
    return e


def _timing_summary(trials) -> tuple[str, str]:
    modes = [t.mode for t in trials if t.timing is not None]
    kinds = {m.split(" ", 1)[0] for m in modes}
    mode = "mixed" if len(kinds) > 1 else (kinds.pop() if kinds else "")
    failed = [(t.step, t.mode) for t in trials if t.timing is not None and t.mode.startswith("eager (")]
    if not failed:
        return mode, ""
    return mode, (f"{len(failed)} of {len(modes)} end-to-end trial(s) timed eagerly, not as CUDA graphs "
                  f"(first: {failed[0][0]}: {failed[0][1]})")


def paired_graphs(session, original: GraphedMethod, adopted: GraphedMethod) -> gates.Timing:
    """Paired timing of two captured methods: each call copies the inputs in, replays, clones the outputs."""
    args, kwargs = session.args, session.kwargs
    with torch.no_grad():
        return gates.paired_timing(session.e2e_timer,
                                   gates.TimedCall(lambda: original(*args, **kwargs), "eager", "model"),
                                   gates.TimedCall(lambda: adopted(*args, **kwargs), "adopted", "model"),
                                   session.rounds)


def paired_with_setup(session, a, b, unit: str) -> gates.Timing:
    """Paired timing of the whole model in two configurations; setup runs outside the timed call."""
    (name_a, setup_a), (name_b, setup_b) = a, b
    before, after, ratios = [], [], []
    for r in range(session.rounds):
        times = {}
        for name, setup in ((name_a, setup_a), (name_b, setup_b))[:: 1 if r % 2 == 0 else -1]:
            setup()
            times[name] = session.e2e_timer(gates.TimedCall(session.run_plain, name, unit))
        before.append(times[name_a])
        after.append(times[name_b])
        ratios.append(times[name_a] / times[name_b] if times[name_b] > 0 else float("inf"))
    return gates.Timing(statistics.median(before), statistics.median(after), statistics.median(ratios) - 1.0)
