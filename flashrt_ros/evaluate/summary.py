"""The fleet report, rebuilt from the report folder's per-bag results: one row per bag (worst first), the
distributions across bags, the comparison of two configurations per bag, report.json and report.md."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from flashrt_ros.evaluate import plots
from flashrt_ros.evaluate.results import ReportFolder, _json_bytes, write_atomic
from flashrt_ros.replay.metrics import percentiles

WORST_ORDER = ("bags that could not be replayed first, then by action error against the recorded chunks (MSE, "
               "highest first), then by refused decisions, then by tick latency p99")


def _get(d, *path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def facts(row: dict) -> dict:
    """The numbers a person reads of one bag, from its result row. `latency_ms` holds all that depends on the
    machine's speed; everything else is a function of the bag, contract and seed."""
    out = {"key": row["key"], "bag": row["bag"], "episode": row.get("episode"), "status": row["status"],
           "error": row.get("error"), "attempts": row.get("attempts", 1),
           "worker_deaths": len(row.get("worker_deaths") or [])}
    r = row.get("replay")
    if not r:
        return out
    s = r.get("staleness", {})
    e = r.get("action_error", {})
    sp = _get(r, "splice", "replayed", "disagreement") or {}
    out.update(ticks=r.get("ticks"), decisions=r.get("decisions"), refused=s.get("refused", 0),
               refusals=[{"reason": g["reason"], "count": g["count"]} for g in s.get("refusals", [])],
               observation_age_ms={k: s.get(k) for k in ("p50", "p99", "max")} if s.get("n") else None,
               action_error={k: e.get(k) for k in ("mse", "max_abs", "matched", "recorded")} if "mse" in e else None,
               splice_rms={k: sp.get(k) for k in ("p50", "p99")} if sp.get("n") else None,
               bag_duration_s=_get(r, "bag", "duration_s"))
    stages = {name: {"p50": v["p50"], "p99": v["p99"], "deadline_misses": v.get("deadline_misses")}
              for name, v in (r.get("stages") or {}).items() if v.get("n")}
    if _get(r, "tick", "n"):
        stages["tick"] = {"p50": r["tick"]["p50"], "p99": r["tick"]["p99"],
                          "deadline_misses": r["tick"].get("deadline_misses")}
    out["latency_ms"] = stages
    c = r.get("compare")
    if c:
        ce = c.get("action_error", {})
        csp = _get(r, "splice", "compare", "disagreement") or {}
        out["compare"] = {"decisions": c.get("decisions"), "mismatched_decisions": c.get("mismatched_decisions"),
                          "rmse": c.get("rmse"), "max_abs": c.get("max_abs"), "cosine_min": c.get("cosine_min"),
                          "action_mse": ce.get("mse"),
                          "action_mse_diff": (ce["mse"] - e["mse"]) if "mse" in ce and "mse" in e else None,
                          "splice_rms_p50_diff": (csp["p50"] - sp["p50"]) if csp.get("n") and sp.get("n") else None}
        lat = c.get("compare_tick_latency_ms") or {}
        if lat.get("n") and "tick" in stages:
            out["latency_ms"]["compare_tick"] = {"p50": lat["p50"], "p99": lat["p99"]}
    return out


def worst_first(rows: list[dict]) -> list[dict]:
    def key(f):
        mse = (f.get("action_error") or {}).get("mse")
        tick = ((f.get("latency_ms") or {}).get("tick") or {}).get("p99") or 0.0
        return (f["status"] == "ok", -(mse if mse is not None else -1.0), -(f.get("refused") or 0), -tick)

    return sorted(rows, key=key)


def _dist(values) -> dict:
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"n": 0}
    a = np.asarray(v, np.float64)
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {"n": len(v), "min": float(a.min()), "p10": float(p10), "p50": float(p50), "p90": float(p90),
            "max": float(a.max())}


def distributions(rows: list[dict]) -> dict:
    ok = [f for f in rows if f["status"] == "ok"]
    stages = sorted({s for f in ok for s in (f.get("latency_ms") or {}) if s != "prompt"})  # (once per task)
    out = {"decisions": _dist([f.get("decisions") for f in ok]),
           "refused": _dist([f.get("refused") for f in ok]),
           "observation_age_p99_ms": _dist([_get(f, "observation_age_ms", "p99") for f in ok]),
           "action_mse": _dist([_get(f, "action_error", "mse") for f in ok]),
           "action_max_abs": _dist([_get(f, "action_error", "max_abs") for f in ok]),
           "splice_rms_p50": _dist([_get(f, "splice_rms", "p50") for f in ok])}
    for s in stages:
        out[f"{s}_p50_ms"] = _dist([_get(f, "latency_ms", s, "p50") for f in ok])
        out[f"{s}_p99_ms"] = _dist([_get(f, "latency_ms", s, "p99") for f in ok])
    if any(f.get("compare") for f in ok):
        for k in ("rmse", "max_abs", "action_mse_diff", "splice_rms_p50_diff"):
            out[f"compare_{k}"] = _dist([_get(f, "compare", k) for f in ok])
    return out


def build(folder: ReportFolder, units, manifest: dict, evaluation: dict) -> dict:
    """report.json, report.md and the plots of the units that have a result; -> report.json's content."""
    rows, arrays, missing = [], {}, []
    for u in units:
        row = folder.load_row(u.key)
        if row is None:
            missing.append(u.label)
            continue
        f = facts(row)
        f["joint_names"] = row.get("joint_names") or []
        rows.append(f)
        arrays[u.key] = folder.load_arrays(u.key)
    rows = worst_first(rows)
    ok = [f for f in rows if f["status"] == "ok"]
    ticks = np.concatenate([a["tick_latency_ms"] for a in arrays.values() if "tick_latency_ms" in a] or [[]])
    chunks = np.concatenate([a["chunk_mse"] for a in arrays.values() if "chunk_mse" in a] or [[]])
    data = {"evaluation": evaluation,
            "totals": {"bags": len(units), "with_result": len(rows), "ok": len(ok), "errors": len(rows) - len(ok),
                       "without_result": len(missing), "decisions": sum(f.get("decisions") or 0 for f in rows),
                       "refused": sum(f.get("refused") or 0 for f in rows),
                       "retried": sum(f["attempts"] > 1 for f in rows),
                       "worker_deaths": sum(f["worker_deaths"] for f in rows)},
            "distributions": distributions(rows),
            "pooled": {"tick_latency_ms": percentiles(ticks.tolist()), "chunk_mse": percentiles(chunks.tolist())},
            "worst_order": WORST_ORDER, "rows": rows, "without_result": missing, "runs": manifest.get("runs", [])}
    out = folder.root
    made = []
    if ok:
        made.append(plots.latency_plot(rows, arrays, out / "latency.png"))
        made.append(plots.action_error_plot(rows, arrays, out / "action_error.png"))
        worst = next((f for f in ok if f.get("action_error")), ok[0])
        made.append(plots.worst_bag_plot(worst, arrays[worst["key"]], out / "worst_bag_actions.png"))
        if any(f.get("compare") for f in ok):
            made.append(plots.compare_plot(rows, out / "compare.png"))
    data["plots"] = [p.name for p in made]
    write_atomic(out / "report.json", _json_bytes(data))
    write_atomic(out / "report.md", markdown(data).encode())
    return data


# ---- text -------------------------------------------------------------------------------------------------
def _f(v, fmt="{:.3g}") -> str:
    return "-" if v is None else fmt.format(v)


def _pair(d, a="p50", b="p99") -> str:
    return "-" if not d else f"{_f(d.get(a), '{:.1f}')} / {_f(d.get(b), '{:.1f}')}"


def _name(f) -> str:
    name = Path(f["bag"]).name
    return f"`{name}`" + (f" ep {f['episode']}" if f.get("episode") is not None else "")


def stage_columns(rows) -> list[str]:
    stages = []
    for f in rows:
        for s in f.get("latency_ms") or {}:
            if s not in stages and s not in ("prompt", "compare_tick"):
                stages.append(s)
    return stages


def bag_table(rows: list[dict]) -> list[str]:
    stages = stage_columns(rows)
    head = (["bag", "decisions", "refused (most: reason)"] + [f"{s} p50 / p99 ms" for s in stages]
            + ["obs. age p50 / p99 ms", "action MSE", "max abs err", "splice RMS p50"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in rows:
        if f["status"] != "ok":
            continue
        ref = f"{f['refused']}" + (f" ({f['refusals'][0]['reason'][:60]})" if f.get("refusals") else "")
        cells = [_name(f) + (f" (attempt {f['attempts']})" if f["attempts"] > 1 else ""), str(f["decisions"]), ref]
        cells += [_pair((f.get("latency_ms") or {}).get(s)) for s in stages]
        e = f.get("action_error") or {}
        cells += [_pair(f.get("observation_age_ms")), _f(e.get("mse")), _f(e.get("max_abs")),
                  _f((f.get("splice_rms") or {}).get("p50"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(d: dict) -> str:
    ev, t, rows = d["evaluation"], d["totals"], d["rows"]
    lines = [f"# Fleet evaluation: {t['bags']} bags", "",
             f"- contract: `{ev.get('config')}`" + (f", checkpoint `{ev['checkpoint']}`" if ev.get("checkpoint") else "")
             + (f"; compared with `{ev['compare']}`" if ev.get("compare") else ""),
             f"- seed {ev.get('seed')}, device {ev.get('device')}, "
             + ((f"{ev['actors']} replay worker(s)" + (f" on {ev['ray_address']}" if ev.get("ray_address")
                                                        else " (local Ray cluster)"))
                if ev.get("actors") else "no replay in this run (every bag had its result)"),
             f"- **{t['ok']} ok, {t['errors']} failed**" + (f", {t['without_result']} not replayed yet (run again "
                                                           "with the same --report to continue)"
                                                           if t["without_result"] else "")
             + f"; {t['decisions']} decisions, {t['refused']} refused; {t['retried']} bag(s) retried after "
               f"{t['worker_deaths']} worker death(s)"]
    runs = d.get("runs") or []
    if runs:
        last = runs[-1]
        lines += [f"- this run replayed {len(last.get('replayed', []))} bag(s) and took "
                  f"{last.get('reused', 0)} result(s) from earlier runs ({len(runs)} run(s) so far)"]
    lines.append("")
    failed = [f for f in rows if f["status"] != "ok"]
    if failed:
        lines += ["## Bags that could not be replayed", "", "| bag | attempts | error |", "|---|---|---|"]
        lines += [f"| {_name(f)} | {f['attempts']} | {' '.join(str(f['error']).replace('|', '/').split())} |"
                  for f in failed]
        lines.append("")
    dist = d["distributions"]
    if dist.get("decisions", {}).get("n"):
        lines += ["## Across bags", "", "Distribution over the bags replayed ok of each bag's number.", "",
                  "| per bag | bags | min | p10 | p50 | p90 | max |", "|---|---|---|---|---|---|---|"]
        for name, v in dist.items():
            if v.get("n"):
                lines.append(f"| {name} | {v['n']} | " + " | ".join(_f(v[k]) for k in ("min", "p10", "p50", "p90",
                                                                                         "max")) + " |")
        p = d["pooled"]
        if p["tick_latency_ms"].get("n"):
            lines.append("")
            lines.append(f"All {p['tick_latency_ms']['n']} ticks of all bags: latency p50 "
                         f"{p['tick_latency_ms']['p50']:.1f} ms, p99 {p['tick_latency_ms']['p99']:.1f} ms"
                         + (f"; all {p['chunk_mse']['n']} matched chunks: MSE p50 {p['chunk_mse']['p50']:.3g}, "
                            f"p99 {p['chunk_mse']['p99']:.3g}" if p["chunk_mse"].get("n") else ""))
        lines += ["", f"## Bags, worst first", "", f"Order: {d['worst_order']}.", ""] + bag_table(rows) + [""]
    compared = [f for f in rows if f.get("compare")]
    if compared:
        lines += ["## The two configurations per bag", "",
                  f"Same inputs and noise; differences are `{ev.get('compare')}` minus the contract under test.", "",
                  "| bag | decisions | RMS diff | max abs diff | cosine min | action MSE diff | splice RMS p50 diff |",
                  "|---|---|---|---|---|---|---|"]
        for f in sorted(compared, key=lambda f: -(f["compare"].get("rmse") or 0)):
            c = f["compare"]
            lines.append(f"| {_name(f)} | {c['decisions']} | {_f(c.get('rmse'))} | {_f(c.get('max_abs'))} | "
                         f"{_f(c.get('cosine_min'), '{:.6f}')} | {_f(c.get('action_mse_diff'), '{:+.3g}')} | "
                         f"{_f(c.get('splice_rms_p50_diff'), '{:+.3g}')} |")
        lines.append("")
    for name in d.get("plots", []):
        lines += [f"![{name}]({name})", ""]
    lines += ["Each bag's numbers: `bags/<bag>.json` (the `flashrt replay` report of that bag, without its decision "
              "table); `flashrt replay BAG --report DIR` with the same contract and seed gives the same numbers "
              "and its per-decision plots.", ""]
    return "\n".join(lines)

