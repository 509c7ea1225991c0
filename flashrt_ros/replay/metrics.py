"""Numbers of a replay, from tick records alone: latency per stage, deadline misses, staleness, action error
against recorded chunks, and agreement between two configurations on the same inputs and noise."""
from __future__ import annotations

import bisect
import re
from typing import Sequence

import numpy as np


def percentiles(values: Sequence[float]) -> dict:
    if len(values) == 0:
        return {"n": 0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max()),
            "mean": float(a.mean())}


def stage_latency(ticks, periods_ms: dict) -> dict:
    """Per stage (or per graph group like "observe+act"), latency percentiles and deadline misses."""
    samples: dict[str, list[float]] = {}
    for t in ticks:
        for key, ms in t.stage_latency_ms.items():
            samples.setdefault(key, []).append(ms)
    out = {}
    for key, values in samples.items():
        members = [periods_ms.get(s) for s in key.split("+")]
        periods = [p for p in members if p is not None]
        period = min(periods) if periods else None
        row = percentiles(values)
        row["period_ms"] = period
        row["deadline_misses"] = int(sum(v > period for v in values)) if period is not None else None
        out[key] = row
    return out


def tick_latency(ticks, tick_period_ms: float) -> dict:
    row = percentiles([t.latency_ms for t in ticks])
    row["period_ms"] = tick_period_ms
    row["deadline_misses"] = int(sum(t.latency_ms > tick_period_ms for t in ticks))
    return row


def staleness(ticks, limit_ms: float | None) -> dict:
    ages = [t.observation_age_ms for t in ticks if t.actions is not None and t.observation_age_ms is not None]
    row = percentiles(ages)
    row["limit_ms"] = limit_ms
    row["over_limit"] = int(sum(a > limit_ms for a in ages)) if limit_ms is not None else 0
    # A tick where the output stage was due but produced nothing is a refusal (stale input, missing prefix).
    # Refusals of one kind differ only in their numbers (the age, the input's age): grouped by the reason with
    # its numbers taken out, each group shown by its first reason, counted, with the bag times it spans.
    groups: dict[str, dict] = {}
    t0 = ticks[0].t_ns if ticks else 0
    for t in ticks:
        if refused(t):
            g = groups.setdefault(_NUMBER.sub("#", t.reason), {"reason": t.reason, "count": 0,
                                                               "first_s": (t.t_ns - t0) / 1e9})
            g["count"] += 1
            g["last_s"] = (t.t_ns - t0) / 1e9
    row["refused"] = int(sum(g["count"] for g in groups.values()))
    row["refusals"] = sorted(groups.values(), key=lambda g: -g["count"])
    return row


_NUMBER = re.compile(r"(?<![\w/])-?\d+(\.\d+)?")  # (a quantity, not the digits of a name such as /cam0)


def refused(t) -> bool:
    """Whether a tick's output stage was due and refused (a stage that is not due is no refusal)."""
    return t.actions is None and bool(t.reason) and "is not due" not in t.reason


def match_recorded(ticks, recorded, tolerance_ns: int) -> list[tuple]:
    """(tick, chunk) pairs: each decision with the recorded chunk nearest in decision time, if within
    `tolerance_ns` (half a tick period: a chunk cannot belong to two ticks)."""
    chunks = sorted(recorded, key=lambda c: c.t_ns)
    times = [c.t_ns for c in chunks]
    pairs, used = [], set()
    for t in ticks:
        if t.actions is None or not chunks:
            continue
        i = bisect.bisect_left(times, t.t_ns)
        best = min((j for j in (i - 1, i) if 0 <= j < len(chunks)), key=lambda j: abs(times[j] - t.t_ns))
        if abs(times[best] - t.t_ns) <= tolerance_ns and best not in used:
            used.add(best)
            pairs.append((t, chunks[best]))
    return pairs


def action_error(ticks, recorded, tolerance_ns: int) -> dict:
    """MSE and max |error| of predicted vs recorded chunks over their common rows and columns (the node
    publishes the first len(joint_names) columns of the model's actions)."""
    decisions = sum(t.actions is not None for t in ticks)
    out = {"recorded": len(recorded), "decisions": decisions}
    if not recorded:
        out["note"] = "the bag has no recorded actions"
        return out
    pairs = match_recorded(ticks, recorded, tolerance_ns)
    out.update(matched=len(pairs), unmatched_decisions=decisions - len(pairs),
               unmatched_recorded=len(recorded) - len(pairs))
    if not pairs:
        out["note"] = "no recorded chunk within half a tick period of any decision"
        return out
    rows = min(min(t.actions.shape[0], c.actions.shape[0]) for t, c in pairs)
    cols = min(min(t.actions.shape[1], c.actions.shape[1]) for t, c in pairs)
    diff = np.stack([t.actions[:rows, :cols].astype(np.float64) - c.actions[:rows, :cols] for t, c in pairs])
    out.update(rows=rows, columns=cols, mse=float(np.mean(diff ** 2)), max_abs=float(np.max(np.abs(diff))),
               per_joint_mse=[float(v) for v in np.mean(diff ** 2, axis=(0, 1))],
               first_row_mse=float(np.mean(diff[:, 0] ** 2)))
    return out


def agreement(ticks, index: int = 0) -> dict:
    """Primary vs compare runtime `index` on the same inputs and noise, decision by decision."""
    both = [(t.actions, t.compare_actions[index]) for t in ticks
            if t.compare_actions and (t.actions is not None or t.compare_actions[index] is not None)]
    pairs = [(a, b) for a, b in both if a is not None and b is not None]
    out = {"decisions": len(pairs), "mismatched_decisions": len(both) - len(pairs)}
    if not pairs:
        return out
    cos, max_abs, sq, ab = [], 0.0, 0.0, 0.0
    n = 0
    for a, b in pairs:
        if a.shape != b.shape:
            out["shape_mismatch"] = f"{list(a.shape)} vs {list(b.shape)}"
            return out
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        d = a64 - b64
        max_abs = max(max_abs, float(np.max(np.abs(d))))
        sq += float(d @ d)
        ab += float(np.abs(d).sum())
        n += d.size
        denom = np.linalg.norm(a64) * np.linalg.norm(b64)
        cos.append(float(a64 @ b64 / denom) if denom > 0 else (1.0 if not d.any() else 0.0))
    out.update(max_abs=max_abs, mean_abs=ab / n, rmse=(sq / n) ** 0.5, cosine_min=min(cos),
               cosine_mean=float(np.mean(cos)))
    compare_ms = [t.compare_latency_ms[index] for t in ticks if t.compare_latency_ms]
    out["compare_tick_latency_ms"] = percentiles(compare_ms)
    return out


def splice(ticks, action_dt_s: float, index: int | None = None) -> dict:
    """How consecutive chunks join (primary chunks, or compare runtime `index`'s). The robot executes the
    newest chunk from its decision on, one action per `action_dt_s` (time-aligned chunks): from chunk i it
    executes rows 0 .. s_i - 1, s_i = round((t_{i+1} - t_i) / dt) (at least 1), then switches to chunk i+1.
    - disagreement: per splice, RMS of new chunk - old chunk over their overlap (old rows s.., new rows ..-s):
      how much the new decision changes the plan it replaces;
    - jerk: third difference of the executed stream / dt^3, max over the action columns, at the windows that
      cross a splice (the executed rows k-2 .. k+1 around the first row k of a new chunk), and in all windows.
    `series` keeps (seconds since the first decision, at t0_ns, disagreement, splice jerk) per splice for the plot."""
    chunks = [(t.t_ns, t.actions if index is None else (t.compare_actions[index] if t.compare_actions else None))
              for t in ticks]
    chunks = [(t, a.astype(np.float64)) for t, a in chunks if a is not None]
    out = {"action_dt_s": action_dt_s, "splices": max(len(chunks) - 1, 0)}
    if len(chunks) < 2:
        return out
    dt_ns = action_dt_s * 1e9
    stream, starts, disagree, times = [], [], [], []
    for i, (t, a) in enumerate(chunks):
        if i + 1 < len(chunks):
            s = max(1, min(int(round((chunks[i + 1][0] - t) / dt_ns)), a.shape[0]))
        else:
            s = a.shape[0]
        if i > 0:
            prev_t, prev = chunks[i - 1]
            shift = max(1, int(round((t - prev_t) / dt_ns)))
            overlap = min(prev.shape[0] - shift, a.shape[0])
            if overlap > 0:
                d = a[:overlap] - prev[shift:shift + overlap]
                disagree.append(float(np.sqrt(np.mean(d ** 2))))
                times.append((t - chunks[0][0]) / 1e9)
            starts.append(len(stream))
        stream.extend(a[:s])
    e = np.asarray(stream)
    jerk = np.abs(e[3:] - 3 * e[2:-1] + 3 * e[1:-2] - e[:-3]).max(axis=1) / action_dt_s ** 3 if len(e) > 3 \
        else np.zeros(0)
    # the window of rows k-2 .. k+1 is jerk[k - 2]
    at_splice = [float(jerk[k - 2]) for k in starts if 2 <= k <= len(e) - 2]
    out.update(disagreement=percentiles(disagree), splice_jerk=percentiles(at_splice),
               jerk=percentiles(jerk.tolist()),
               series={"t_s": times, "t0_ns": int(chunks[0][0]), "disagreement": disagree,
                       "splice_jerk": [float(jerk[k - 2]) if 2 <= k <= len(e) - 2 else None for k in starts]})
    return out
