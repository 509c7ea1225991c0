"""PNG plots of a replay (matplotlib, Agg backend, chosen per figure so importing this sets nothing global)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

DPI = 80  # keeps a plot well under 200 KB


def _figure(figsize):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _seconds(ticks, t0):
    return np.array([(t.t_ns - t0) / 1e9 for t in ticks])


def latency_plot(ticks, stages: dict, t0: int, path: Path) -> Path:
    fig = _figure((11, 4))
    ax_t, ax_h = fig.subplots(1, 2)
    series = {key: [((t.t_ns - t0) / 1e9, t.stage_latency_ms[key]) for t in ticks if key in t.stage_latency_ms]
              for key in stages}
    values = [v for pts in series.values() for _, v in pts if v > 0]
    # Stages differ by orders of magnitude (a prompt re-encode vs a prefix): log axes, log-spaced bins.
    bins = np.geomspace(min(values), max(values) * 1.0001, 40) if values else 10
    for key, pts in series.items():
        if not pts:
            continue
        x, y = zip(*pts)
        line = ax_t.plot(x, y, ".", ms=3, label=key)[0]
        if stages[key].get("period_ms"):
            ax_t.axhline(stages[key]["period_ms"], color=line.get_color(), lw=0.8, ls="--")
        ax_h.hist([v for v in y if v > 0], bins=bins, histtype="step", label=key, color=line.get_color())
    ax_t.set(xlabel="bag time (s)", ylabel="latency (ms)", title="latency per stage (dashed: period)")
    ax_h.set(xlabel="latency (ms)", ylabel="runs", title="latency histogram")
    for ax, axis in ((ax_t, "y"), (ax_h, "x")):
        if values:
            (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    for ax in (ax_t, ax_h):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def age_plot(ticks, limit_ms, t0: int, path: Path) -> Path:
    fig = _figure((8, 3))
    ax = fig.subplots()
    pts = [((t.t_ns - t0) / 1e9, t.observation_age_ms) for t in ticks
           if t.actions is not None and t.observation_age_ms is not None]
    if pts:
        x, y = zip(*pts)
        ax.plot(x, y, ".-", ms=3, lw=0.6)
    if limit_ms is not None:
        ax.axhline(limit_ms, color="r", ls="--", lw=0.8, label="max_observation_age_ms")
        ax.legend(fontsize=8)
    ax.set(xlabel="bag time (s)", ylabel="observation age (ms)", title="staleness of the observation behind each chunk")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def actions_plot(ticks, pairs, t0: int, path: Path, joint_names=(), compare_label=None, max_joints=8,
                 note: str = "") -> Path:
    """First action row of each chunk per joint: recorded (solid), predicted (dots), compare (x)."""
    decided = [t for t in ticks if t.actions is not None]
    width = pairs[0][1].actions.shape[1] if pairs else (decided[0].actions.shape[1] if decided else 1)
    joints = min(width, max_joints)
    cols = 2 if joints > 1 else 1
    rows = (joints + cols - 1) // cols
    fig = _figure((11, 1.9 * rows + 0.6))
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, squeeze=False)).ravel()
    for j in range(joints):
        ax = axes[j]
        if pairs:
            x = [(c.t_ns - t0) / 1e9 for _, c in pairs]
            ax.plot(x, [c.actions[0, j] for _, c in pairs], "-", lw=1.6, color="0.55", label="recorded")
        if decided:
            ax.plot(_seconds(decided, t0), [t.actions[0, j] for t in decided], "o", ms=3.5, mfc="none",
                    mew=0.9, color="C0", label="replayed")
        comp = [t for t in ticks if t.compare_actions and t.compare_actions[0] is not None]
        if comp and compare_label:
            ax.plot(_seconds(comp, t0), [t.compare_actions[0][0, j] for t in comp], "x", ms=2.5, color="C3",
                    label=compare_label)
        name = joint_names[j] if j < len(joint_names) else f"action[{j}]"
        ax.set_ylabel(f"{name}\n(robot units)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[joints:]:
        ax.set_visible(False)
    if axes[0].get_legend_handles_labels()[0]:  # (nothing to label when no decision was made)
        axes[0].legend(fontsize=7, loc="upper right")
    for c in range(cols):  # the lowest panel of each column carries the time axis
        last = max((j for j in range(joints) if j % cols == c), default=None)
        if last is not None:
            axes[last].set_xlabel("bag time (s)")
            axes[last].xaxis.set_tick_params(labelbottom=True)
    fig.suptitle("first action of each chunk: replayed vs recorded" + (f" ({note})" if note else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def splice_plot(splices: dict, t0: int, path: Path) -> Path:
    """Per splice: how far the new chunk moved from the old over their overlap, and the executed stream's
    jerk there (replayed, and the compare configuration when there is one), on bag time as the other plots."""
    fig = _figure((11, 4.2))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for k, (who, sp) in enumerate(splices.items()):
        series = sp.get("series", {})
        if not series.get("t_s"):
            continue
        x = np.asarray(series["t_s"]) + (series.get("t0_ns", t0) - t0) / 1e9
        top.plot(x, series["disagreement"], ".-" if k == 0 else "x--", ms=3, lw=0.8, color=f"C{k}", label=who)
        jerk = [(t, j) for t, j in zip(x, series["splice_jerk"]) if j is not None]
        if jerk:
            bottom.plot(*zip(*jerk), ".-" if k == 0 else "x--", ms=3, lw=0.8, color=f"C{k}", label=who)
    top.set_ylabel("new vs old chunk, RMS\nover overlap (robot units)", fontsize=8)
    bottom.set_ylabel("jerk at splice, max over\njoints (robot units/s³)", fontsize=8)
    bottom.set_xlabel("bag time (s)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("chunk splices", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path
