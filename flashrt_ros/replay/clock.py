"""The replay clock: tick times of a contract's rate stages on the bag's clock.

Grid point n of a stage at `rate` Hz is t0 + ceil(n * 1e9 / rate) ns with exact fractions, as the runtime's
scheduler counts them, so a replay ticks exactly when each stage is due and no grid point is skipped. The
ticks of all rate stages are merged (50 Hz act and 10 Hz observe give the 50 Hz grid).
"""
from __future__ import annotations

import heapq
from fractions import Fraction
from typing import Iterator, Mapping

NS = 1_000_000_000


def stage_rates(contract) -> dict[str, float]:
    return {name: s.trigger.rate_hz for name, s in contract.stages.items() if s.trigger.rate_hz is not None}


def stage_periods_ms(contract) -> dict[str, float | None]:
    """Deadline of each stage: its period, or the period of the stage it runs after; None for stages that
    only run when an input changes (a prompt re-encode has no rate to keep up with)."""
    out: dict[str, float | None] = {}
    for name, s in contract.stages.items():  # DAG order: a parent is resolved before its `after` children
        if s.trigger.rate_hz is not None:
            out[name] = 1000.0 / s.trigger.rate_hz
        elif s.trigger.after is not None:
            out[name] = out.get(s.trigger.after)
        else:
            out[name] = None
    return out


def grid(t0: int, rate_hz: float) -> Iterator[int]:
    rate = Fraction(str(rate_hz))
    n = 0
    while True:
        yield t0 + -(-(n * NS * rate.denominator) // rate.numerator)
        n += 1


def tick_times(t0: int, rates: Mapping[str, float]) -> Iterator[int]:
    """Merged, de-duplicated grid points of every rate, from t0 on (infinite)."""
    if not rates:
        raise ValueError("a contract with no rate stage has no clock to replay on")
    last = None
    for t in heapq.merge(*(grid(t0, r) for r in sorted(set(rates.values())))):
        if t != last:
            yield t
            last = t
