"""PNG plots of a fleet evaluation: latency and action error across bags, the worst bag's actions against the
recorded ones (the replay report's own actions plot), and the two configurations per bag."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from flashrt_ros.replay.plots import _figure, actions_plot


def _log_bins(values, n=30):
    v = np.asarray([x for x in values if x is not None and x > 0], np.float64)
    if v.size == 0:
        return None
    lo, hi = v.min(), v.max()
    return np.geomspace(lo / 1.05, hi * 1.05, n) if hi > lo else np.geomspace(lo / 2, lo * 2, 5)


def _save(fig, axes, path: Path) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _ecdf(ax, values, label, **kw):
    v = np.sort(np.asarray(values, np.float64))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label, **kw)


def latency_plot(rows, arrays, path: Path) -> Path:
    """Left: each bag's p99 latency per stage, as a histogram over bags. Right: every tick of every bag."""
    fig = _figure((11, 4))
    ax_b, ax_t = fig.subplots(1, 2)
    ok = [f for f in rows if f["status"] == "ok"]
    stages = sorted({s for f in ok for s in (f.get("latency_ms") or {}) if s != "prompt"})
    everything = [f["latency_ms"][s]["p99"] for f in ok for s in stages if s in f["latency_ms"]]
    bins = _log_bins(everything)
    for s in stages:
        v = [f["latency_ms"][s]["p99"] for f in ok if s in f["latency_ms"]]
        if bins is not None and v:
            ax_b.hist(v, bins=bins, histtype="step", lw=1.2, label=s)
    ax_b.set(xlabel="p99 latency of the bag (ms)", ylabel="bags", title=f"p99 latency per bag ({len(ok)} bags)")
    ticks = [a["tick_latency_ms"] for a in arrays.values() if "tick_latency_ms" in a and len(a["tick_latency_ms"])]
    if ticks:
        _ecdf(ax_t, np.concatenate(ticks), f"all bags ({sum(map(len, ticks))} ticks)", color="k", lw=1.4)
        slow = max(ok, key=lambda f: (f.get("latency_ms") or {}).get("tick", {}).get("p99") or 0)
        a = arrays.get(slow["key"], {})
        if len(a.get("tick_latency_ms", [])):
            _ecdf(ax_t, a["tick_latency_ms"], f"slowest bag: {Path(slow['bag']).name}", color="C3", lw=1.0)
    ax_t.set(xlabel="tick latency (ms)", ylabel="fraction of ticks", title="tick latency, every tick")
    if bins is not None:
        ax_b.set_xscale("log")
    if ticks:
        ax_t.set_xscale("log")
    return _save(fig, (ax_b, ax_t), path)


def action_error_plot(rows, arrays, path: Path) -> Path:
    """Left: each bag's action MSE against its recorded chunks (and the compare configuration's). Right: every
    matched chunk's MSE."""
    fig = _figure((11, 4))
    ax_b, ax_c = fig.subplots(1, 2)
    ok = [f for f in rows if f["status"] == "ok" and f.get("action_error")]
    mine = [f["action_error"]["mse"] for f in ok]
    theirs = [(f.get("compare") or {}).get("action_mse") for f in ok]
    theirs = [v for v in theirs if v is not None]
    bins = _log_bins(mine + theirs)
    zeros = sum(v == 0 for v in mine)
    if bins is not None:
        ax_b.hist([v for v in mine if v > 0], bins=bins, histtype="step", lw=1.4, label="contract under test")
        if theirs:
            ax_b.hist([v for v in theirs if v > 0], bins=bins, histtype="step", lw=1.0, ls="--", label="compare")
        ax_b.set_xscale("log")
    note = f"; {zeros} bag(s) with MSE 0" if zeros else ""
    ax_b.set(xlabel="action MSE of the bag (robot units²)", ylabel="bags",
             title=f"action error per bag ({len(ok)} bags{note})")
    chunks = [a["chunk_mse"] for a in arrays.values() if len(a.get("chunk_mse", []))]
    if chunks:
        pooled = np.concatenate(chunks)
        if (pooled > 0).any():
            _ecdf(ax_c, pooled[pooled > 0], f"{pooled.size} chunks", color="k")
            ax_c.set_xscale("log")
        if (pooled == 0).any():
            ax_c.set_title(f"every matched chunk ({int((pooled == 0).sum())} exact)")
    if not ax_c.get_title():
        ax_c.set_title("every matched chunk")
    ax_c.set(xlabel="chunk MSE vs recorded (robot units²)", ylabel="fraction of chunks")
    return _save(fig, (ax_b, ax_c), path)


def worst_bag_plot(row: dict, a: dict, path: Path) -> Path:
    """The replay report's actions plot for one bag, from its stored first action rows."""
    ticks = [SimpleNamespace(t_ns=int(t), actions=x[None], compare_actions=[])
             for t, x in zip(a.get("decision_t_ns", []), a.get("first_actions", []))]
    ticks += [SimpleNamespace(t_ns=int(t), actions=None, compare_actions=[x[None]])
              for t, x in zip(a.get("compare_t_ns", []), a.get("compare_first", []))]
    pairs = [(None, SimpleNamespace(t_ns=int(t), actions=x[None]))
             for t, x in zip(a.get("recorded_t_ns", []), a.get("recorded_first", []))]
    t0 = int(a["tick_t_ns"][0]) if len(a.get("tick_t_ns", [])) else 0
    e = row.get("action_error") or {}
    note = f"worst bag {Path(row['bag']).name}" + (f" ep {row['episode']}" if row.get("episode") is not None else "")
    if e:
        note += f": MSE {e['mse']:.2e}, max |err| {e['max_abs']:.2e}"
    return actions_plot(ticks, pairs, t0, path, tuple(row.get("joint_names") or ()),
                        compare_label="compare" if len(a.get("compare_t_ns", [])) else None, note=note)


def compare_plot(rows, path: Path) -> Path:
    """Per bag: the two configurations' action MSE against the recorded chunks, and their RMS difference."""
    fig = _figure((11, 4))
    ax_s, ax_h = fig.subplots(1, 2)
    ok = [f for f in rows if f["status"] == "ok" and f.get("compare")]
    pts = [(f["action_error"]["mse"], f["compare"]["action_mse"]) for f in ok
           if f.get("action_error") and f["compare"].get("action_mse") is not None]
    if pts:
        x, y = map(np.asarray, zip(*pts))
        ax_s.plot(x, y, "o", ms=4, mfc="none")
        hi = max(x.max(), y.max()) or 1.0
        ax_s.plot([0, hi], [0, hi], "--", color="0.6", lw=0.8)
        if (x > 0).all() and (y > 0).all():
            ax_s.set_xscale("log")
            ax_s.set_yscale("log")
    ax_s.set(xlabel="action MSE, contract under test", ylabel="action MSE, compare",
             title="per bag: error vs recorded (dashed: equal)")
    rmse = [f["compare"]["rmse"] for f in ok if f["compare"].get("rmse") is not None]
    bins = _log_bins(rmse)
    if bins is not None:
        ax_h.hist([v for v in rmse if v > 0], bins=bins, histtype="step", lw=1.4)
        ax_h.set_xscale("log")
    ax_h.set(xlabel="RMS difference of the two configurations' actions", ylabel="bags",
             title="per bag: agreement on the same inputs and noise")
    return _save(fig, (ax_s, ax_h), path)
