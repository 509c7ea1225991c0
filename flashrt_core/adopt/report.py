"""What `accelerate` decided: one row per unit tried, plus the end-to-end result. Plain data; `to_json()` and
`AdoptReport.from_json()` round-trip. Fallback counters of kept units are live (shared with the swapped
modules) until the report is serialised."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from flashrt_core.adopt.wrappers import UnitStats


@dataclass
class UnitReport:
    name: str  # qualified module name, or "parent[a,b,c]" for merged linears
    kind: str
    detail: str = ""
    kept: bool = False
    reason: str = ""  # why refused, or "kept"
    cosine: float | None = None  # unit parity on the captured inputs (worst call)
    max_rel_err: float | None = None
    rel_err_bound: float | None = None
    e2e_cosine: float | None = None  # whole model with this unit (and those kept before it) swapped in
    e2e_max_rel_err: float | None = None
    latency_before_s: float | None = None
    latency_after_s: float | None = None
    gain: float | None = None
    signatures: int = 0  # distinct call signatures adopted
    timing: str = ""  # how the latency gate measured this unit: "graph" (CUDA graph replays), "eager", "injected"
    stats: UnitStats = field(default_factory=UnitStats)

    @property
    def fallback_calls(self) -> int:
        return self.stats.fallback_calls

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stats"}
        data["fused_calls"], data["fallback_calls"] = self.stats.fused_calls, self.stats.fallback_calls
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "UnitReport":
        data = dict(data)
        stats = UnitStats(data.pop("fused_calls", 0), data.pop("fallback_calls", 0))
        return cls(**data, stats=stats)


@dataclass
class EndToEnd:
    method: str = "forward"
    cosine: float | None = None
    max_rel_err: float | None = None
    rel_err_bound: float | None = None
    latency_eager_s: float | None = None
    latency_adopted_s: float | None = None
    gain: float | None = None
    decided_by: str = ""  # which step of the end-to-end latency gate chose the kept set (e2e.py)
    trials: list[dict] = field(default_factory=list)  # every end-to-end timing: step, units, before/after, gain
    capture: str = "not requested"  # "captured <method>", "not captured: <why>"
    latency_graph_s: float | None = None
    graph_cosine: float | None = None
    timing: str = ""  # how the trials were timed: "graph" (captured methods), "eager", "injected", "mixed"
    timing_note: str = ""  # why some trials were timed eagerly where graphs were asked for


@dataclass
class AdoptReport:
    units: list[UnitReport] = field(default_factory=list)
    end_to_end: EndToEnd = field(default_factory=EndToEnd)
    device: str = ""
    dtype: str = ""
    cos_min: float = 0.999
    min_gain: float = 0.02
    rounds: int = 0
    timing: str = ""  # how units were timed: "graph" (CUDA graph replays), "eager", "injected"
    timing_note: str = ""  # units timed eagerly because their calls could not be captured

    @property
    def kept(self) -> list[UnitReport]:
        return [u for u in self.units if u.kept]

    @property
    def fallback_calls(self) -> int:
        return sum(u.stats.fallback_calls for u in self.kept)

    def unit(self, name: str) -> UnitReport:
        for u in self.units:
            if u.name == name and u.kept:
                return u
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit named {name!r} in the adoption report")

    def to_dict(self) -> dict:
        return {
            "units": [u.to_dict() for u in self.units], "end_to_end": asdict(self.end_to_end),
            "device": self.device, "dtype": self.dtype, "cos_min": self.cos_min, "min_gain": self.min_gain,
            "rounds": self.rounds, "timing": self.timing, "timing_note": self.timing_note,
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "AdoptReport":
        data = json.loads(text)
        return cls(units=[UnitReport.from_dict(u) for u in data["units"]],
                   end_to_end=EndToEnd(**data["end_to_end"]), device=data["device"], dtype=data["dtype"],
                   cos_min=data["cos_min"], min_gain=data["min_gain"], rounds=data["rounds"],
                   timing=data.get("timing", ""), timing_note=data.get("timing_note", ""))

    def __str__(self) -> str:
        return format_table(self)


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _us(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def format_table(report: AdoptReport) -> str:
    head = ("unit", "kind", "cos", "rel err", "e2e cos", "before us", "after us", "gain", "fallbacks", "verdict")
    rows = [head]
    for u in report.units:
        verdict = "kept" if u.kept else f"refused: {u.reason}"
        rows.append((u.name, u.kind, _num(u.cosine, ".6f"), _num(u.max_rel_err, ".1e"), _num(u.e2e_cosine, ".6f"),
                     _us(u.latency_before_s), _us(u.latency_after_s), _num(u.gain, "+.1%"),
                     str(u.stats.fallback_calls), verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    e = report.end_to_end
    lines.append("")
    lines.append(
        f"end to end ({e.method}, {report.device}, {report.dtype}): {len(report.kept)}/{len(report.units)} units "
        f"kept; cos {_num(e.cosine, '.6f')}, rel err {_num(e.max_rel_err, '.1e')} "
        f"(bound {_num(e.rel_err_bound, '.0e')}); {'graph of the original' if e.timing == 'graph' else 'eager'} "
        f"{_us(e.latency_eager_s)} us -> adopted {_us(e.latency_adopted_s)} us ({_num(e.gain, '+.1%')}); {e.capture}"
        + (f", graph {_us(e.latency_graph_s)} us" if e.latency_graph_s is not None else ""))
    lines.append(f"end-to-end latency gate: {e.decided_by or '-'}")
    lines.append(f"timing: units {report.timing or '-'}, end to end {e.timing or '-'}"
                 + "".join(f"; {n}" for n in (report.timing_note, e.timing_note) if n))
    for t in e.trials:
        lines.append(f"  {t['step']}: {t['units']} units, " + (
            f"parity failed ({t['parity_failed']})" if "parity_failed" in t else
            f"{_us(t['before_s'])} us -> {_us(t['after_s'])} us ({t['gain']:+.1%})"
            + (f", {t['timing']}" if t.get("timing") else "")))
    return "\n".join(lines)
