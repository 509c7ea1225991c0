"""The replay report: numbers (report.json), a readable page (report.md), plots, and the terminal table."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashrt_ros.replay import metrics, plots
from flashrt_ros.replay.clock import stage_periods_ms, stage_rates
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.staged import staged_folder


@dataclass
class Report:
    data: dict
    ticks: list = field(default_factory=list, repr=False)
    recorded: list = field(default_factory=list, repr=False)
    pairs: list = field(default_factory=list, repr=False)
    joint_names: tuple = ()

    @property
    def ok(self) -> bool:
        return self.data["status"] == "ok"

    def __getitem__(self, key):
        return self.data[key]

    def to_dict(self) -> dict:
        return self.data

    # ---- files -------------------------------------------------------------------------------------------
    def write(self, out_dir) -> Path:
        """Write the report folder whole or not at all: it is built in a sibling folder and then takes the
        place of `out_dir` (an older report there is replaced, never mixed with this one's files)."""
        final = Path(out_dir)
        if final.exists() and not final.is_dir():
            raise ReplayError(f"--report {final}: exists and is not a folder")
        with staged_folder(final, replace=True) as out:
            out.mkdir()
            self._write_files(out)
        self.data["report_dir"] = str(final)
        return final

    def _write_files(self, out: Path) -> None:
        made = []
        t0 = self.ticks[0].t_ns if self.ticks else 0
        if self.ticks:
            made.append(plots.latency_plot(self.ticks, self.data.get("stages", {}), t0, out / "latency.png"))
            made.append(plots.age_plot(self.ticks, self.data["staleness"].get("limit_ms"), t0,
                                       out / "observation_age.png"))
            label = "compare" if self.data.get("compare") else None
            err = self.data.get("action_error", {})
            note = (f"{err['matched']} chunks matched, MSE {err['mse']:.2e}, max |err| {err['max_abs']:.2e}"
                    if "mse" in err else "no recorded actions matched")
            made.append(plots.actions_plot(self.ticks, self.pairs, t0, out / "actions.png", self.joint_names,
                                           compare_label=label, note=note))
            splices = self.data.get("splice", {})
            if any(sp.get("series", {}).get("t_s") for sp in splices.values()):
                made.append(plots.splice_plot(splices, t0, out / "splices.png"))
        self.data["plots"] = [p.name for p in made]
        chunks = [t.actions for t in self.ticks if t.actions is not None]
        if chunks:  # every decision's whole chunk, row k of `actions` = decisions_table's "chunk": k
            rows = [r for r in self.data.get("decisions_table", []) if "chunk" in r]
            np.savez_compressed(out / "actions.npz", actions=np.stack([np.asarray(a, np.float32) for a in chunks]),
                                t_s=np.asarray([r["t_s"] for r in rows], np.float64),
                                decision_id=np.asarray([r["decision_id"] for r in rows], np.int64))
        (out / "report.json").write_text(json.dumps(self.data, indent=2, default=_jsonable) + "\n")
        (out / "report.md").write_text(self.markdown())

    # ---- text --------------------------------------------------------------------------------------------
    def stage_rows(self) -> list[list[str]]:
        rows = []
        items = list(self.data.get("stages", {}).items())
        if self.data.get("tick", {}).get("n"):
            items.append(("tick (all stages)", self.data["tick"]))
        for name, r in items:
            misses = "-" if r.get("deadline_misses") is None else f"{r['deadline_misses']}/{r['n']}"
            period = "-" if r.get("period_ms") is None else f"{r['period_ms']:.1f}"
            rows.append([name, str(r["n"]), f"{r['p50']:.2f}", f"{r['p90']:.2f}", f"{r['p99']:.2f}",
                         f"{r['max']:.2f}", period, misses])
        return rows

    def result_lines(self) -> list[str]:
        d = self.data
        lines = []
        for name, r in d.get("stages", {}).items():  # a rate this machine cannot hold is said, not only counted
            misses, n = r.get("deadline_misses"), r.get("n", 0)
            if misses and n and misses * 2 > n:
                lines.append(f"warning: {name} took longer than its period in {misses} of {n} runs (p50 "
                             f"{r['p50']:.1f} ms, period {r['period_ms']:.1f} ms): this machine does not hold the "
                             "contract's rate")
        s = d.get("staleness", {})
        if s.get("n"):
            limit = f" (limit {s['limit_ms']:.0f} ms)" if s.get("limit_ms") else ""
            lines.append(f"observation age of the decisions made: p50 {s['p50']:.1f} ms, p99 {s['p99']:.1f} ms, max "
                         f"{s['max']:.1f} ms{limit}; refused decisions: {s['refused']}")
        elif s.get("refused"):
            lines.append(f"refused decisions: {s['refused']} (no decision was made)")
        groups = s.get("refusals", [])
        for g in groups[:5]:
            span = (f"at {g['first_s']:.2f} s" if g["count"] == 1 else
                    f"from {g['first_s']:.2f} to {g['last_s']:.2f} s")
            lines.append(f"  refused {g['count']}x {span}: {g['reason']}")
        if len(groups) > 5:
            lines.append(f"  ... and {sum(g['count'] for g in groups[5:])} more refusals of {len(groups) - 5} other "
                         "kinds (report.json: staleness.refusals)")
        for note in d.get("input_notes", []):
            lines.append(f"input: {note}")
        e = d.get("action_error", {})
        if "mse" in e:
            lines.append(f"action error vs recorded: {e['matched']}/{e['recorded']} chunks matched, "
                         f"MSE {e['mse']:.3e}, max |err| {e['max_abs']:.3e} ({e['rows']}x{e['columns']} per chunk)")
        elif e:
            lines.append(f"action error vs recorded: n/a ({e.get('note', '')})")
        for who, sp in d.get("splice", {}).items():
            if "disagreement" in sp and sp["disagreement"].get("n"):
                dg, sj = sp["disagreement"], sp["splice_jerk"]
                jerk = f", jerk at splices p50 {sj['p50']:.3g} max {sj['max']:.3g}" if sj.get("n") else ""
                lines.append(f"splices ({who}, dt {sp['action_dt_s'] * 1e3:g} ms): {sp['splices']}, new vs old chunk "
                             f"over their overlap: RMS p50 {dg['p50']:.3e} p99 {dg['p99']:.3e}{jerk}")
        c = d.get("compare")
        if c and "max_abs" in c:
            lines.append(f"compare {c['config']}: {c['decisions']} decisions, max |diff| {c['max_abs']:.3e}, "
                         f"rmse {c['rmse']:.3e}, cosine min {c['cosine_min']:.6f} mean {c['cosine_mean']:.6f}, "
                         f"mismatched decisions {c['mismatched_decisions']}")
        elif c:
            lines.append(f"compare {c['config']}: no common decisions ({c.get('shape_mismatch', '')})")
        return lines

    def summary_table(self) -> str:
        d = self.data
        head = ["stage", "runs", "p50 ms", "p90 ms", "p99 ms", "max ms", "period ms", "misses"]
        rows = self.stage_rows()
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
        fmt = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
        bag = d.get("bag") or {}
        out = [f"replay of {bag.get('path', '?')} ({bag.get('storage', '?')}, {bag.get('duration_s', 0):.2f} s): "
               f"{d.get('ticks', 0)} ticks, {d.get('decisions', 0)} decisions, mode {d['mode']}, status {d['status']}"]
        if rows:
            out += [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
        out += self.result_lines()
        if d.get("error"):
            out.append(f"error: {d['error']}")
        return "\n".join(out)

    def markdown(self) -> str:
        d = self.data
        bag = d.get("bag") or {}
        lines = [f"# Replay report: {Path(bag.get('path', '?')).name}", "",
                 f"- status: **{d['status']}**" + (f" - {d['error']}" if d.get("error") else ""),
                 f"- bag: `{bag.get('path', '?')}` ({bag.get('storage', '?')}, {bag.get('duration_s', 0):.2f} s, "
                 f"{bag.get('message_count', 0)} messages)",
                 f"- contract: `{d.get('config')}`" + (f", compared with `{d['compare']['config']}`"
                                                      if d.get("compare") else ""),
                 f"- mode: {d['mode']}, seed {d.get('seed')}, {d.get('ticks', 0)} ticks, "
                 f"{d.get('decisions', 0)} decisions, {d.get('wall_s', 0):.1f} s wall", ""]
        if bag.get("topics"):
            lines += ["## Topics", "", "| topic | type | messages |", "|---|---|---|"]
            lines += [f"| `{t}` | {v['type']} | {v['count']} |" for t, v in sorted(bag["topics"].items())]
            lines.append("")
        rows = self.stage_rows()
        if rows:
            lines += ["## Latency per stage", "", "| stage | runs | p50 ms | p90 ms | p99 ms | max ms | period ms "
                      "| deadline misses |", "|---|---|---|---|---|---|---|---|"]
            lines += ["| " + " | ".join(r) + " |" for r in rows]
            lines.append("")
        results = self.result_lines()
        if results:
            lines += ["## Results", ""] + [f"- {r}" for r in results] + [""]
        for name in d.get("plots", []):
            lines += [f"![{name}]({name})", ""]
        return "\n".join(lines)


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def build_report(*, mode: str, config, seed: int, topics, info=None, player=None, contract=None,
                 compare_config=None, wall_s: float = 0.0, error: str | None = None, ticks=None,
                 recorded=None, action_dt_s: float = 0.02) -> Report:
    """Every number from the ticks and recorded chunks; works on partial input (an error mid-way)."""
    ticks = list(player.ticks if player is not None else ticks or [])
    recorded = list(player.recorded if player is not None else recorded or [])
    data = {"status": "error" if error else "ok", "error": error, "mode": mode, "config": str(config),
            "seed": seed, "topics": topics.describe(), "bag": info.to_dict() if info else None,
            "ticks": len(ticks), "decisions": sum(t.actions is not None for t in ticks), "wall_s": wall_s,
            "messages_read": player.messages if player is not None else None}
    pairs = []
    if contract is not None:
        rates, periods = stage_rates(contract), stage_periods_ms(contract)
        tick_period = 1000.0 / max(rates.values()) if rates else None
        data["contract"] = {"model": contract.model.name, "checkpoint": contract.model.checkpoint,
                            "dtype": contract.model.dtype, "rates_hz": rates, "graphs": contract.graphs,
                            "max_observation_age_ms": contract.limits.max_observation_age_ms}
        if ticks:
            data["bag_time_replayed_s"] = (ticks[-1].t_ns - ticks[0].t_ns) / 1e9
        data["stages"] = metrics.stage_latency(ticks, periods)
        data["tick"] = metrics.tick_latency(ticks, tick_period) if tick_period else {"n": 0}
        data["staleness"] = metrics.staleness(ticks, contract.limits.max_observation_age_ms)
        tol = int(tick_period * 1e6 / 2) if tick_period else 0
        data["action_error"] = metrics.action_error(ticks, recorded, tol)
        pairs = metrics.match_recorded(ticks, recorded, tol) if recorded else []
        if compare_config is not None:
            data["compare"] = dict(config=str(compare_config), **metrics.agreement(ticks))
        data["splice"] = {"replayed": metrics.splice(ticks, action_dt_s)}
        if compare_config is not None:
            data["splice"]["compare"] = metrics.splice(ticks, action_dt_s, index=0)
    if not error and ticks and data["decisions"] == 0 and data.get("staleness", {}).get("refused"):
        data["status"] = "error"
        data["error"] = (f"no decisions: all {data['staleness']['refused']} due decisions were refused (most: "
                         f"{data['staleness']['refusals'][0]['reason']})")
    # every tick whose output stage was due: a decision (`chunk`: its row in the report folder's actions.npz,
    # whose `actions` [decisions, rows, action columns] hold every whole chunk) or a refusal (`refused`: why)
    data["decisions_table"], k = [], 0
    for t in ticks:
        if t.actions is None and not metrics.refused(t):
            continue
        row = {"t_s": (t.t_ns - ticks[0].t_ns) / 1e9, "decision_id": t.decision_id, "ran": t.ran,
               "latency_ms": t.latency_ms, "observation_age_ms": t.observation_age_ms}
        if t.actions is not None:
            row["chunk"], k = k, k + 1
        else:
            row["refused"] = t.reason
        data["decisions_table"].append(row)
    joint_names = recorded[0].joint_names if recorded else ()
    return Report(data=data, ticks=ticks, recorded=recorded, pairs=pairs, joint_names=joint_names or
                  tuple(topics.joint_names))
