"""Do the engine's launch choices, each timed alone, also win inside the act graph? (issue 3, GPU round)

The engine's pickers time every GEMM / attention candidate on its own, in a CUDA graph of repeated calls
(`engine_gemm.LinearPicker`, `engine_attention.AttentionPicker`). Inside the act graph a kernel runs in a PDL
chain: it overlaps the tail of the kernel before it and its own tail delays the next, so the ranking may
differ (the two-kernel attention merge won alone and lost in the chain, README). This probe builds the W2
engine, then for each act-stage shape forces each of its best candidates by the isolated ranking (the top
--top of `results/pi05_w2.json`'s `gemm_choices` / `attention_choices`, cuBLAS and the attention heuristic
included), re-captures the act graph and times it (CUDA events, p50 of --iters replays); the engine's own
choice is timed again between shapes, so drift between the first and last rows shows. Each row checks the
actions against the engine's own (relative L2). The JSON is rewritten after every shape.

    python benchmarks/chain_tuning_probe.py [--json benchmarks/results/chain_tuning_probe_h200.json] [--top 6]
"""
from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_core.bench import random_inputs, random_state, time_cuda, workload_config  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def ranked(timings: dict, top: int) -> list[str]:
    """The `top` fastest candidate names of one shape's isolated timings (floats only)."""
    valid = {name: t for name, t in (timings or {}).items() if isinstance(t, float)}
    return sorted(valid, key=valid.get)[:top]


def as_config(name: str):
    """A candidate's name in the pickers' timings -> what their `choices` hold (None: cuBLAS / heuristic)."""
    return None if name in ("cublas", "heuristic") else tuple(ast.literal_eval(name))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/chain_tuning_probe.json")
    p.add_argument("--ranking", default=str(RESULTS / "pi05_w2.json"),
                   help="a bench_pi05 JSON whose gemm_choices / attention_choices rank the candidates")
    p.add_argument("--top", type=int, default=6, help="candidates per GEMM shape (attention: twice as many)")
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("chain_tuning_probe: needs a CUDA GPU")
    from flashrt_core.models.pi05 import convert
    from flashrt_core.models.pi05.engine import Pi05Engine

    ranking = json.loads(pathlib.Path(a.ranking).read_text())
    config = workload_config(2, 48, 10, 50)
    w32 = convert(config, random_state(config, 0, "cuda"))
    engine = Pi05Engine(w32, device="cuda", dtype=torch.bfloat16)
    del w32
    inputs = random_inputs(config, 0, "cuda")
    engine.sample_actions(*(inputs[k] for k in ("images", "image_masks", "lang_tokens", "lang_mask", "noise")))
    engine.act()  # the act graph (sample_actions captured the decision graph)
    torch.cuda.synchronize()
    want = engine.buffers.actions.clone()

    def act_ms() -> tuple[float, float]:
        """Re-capture the act graph with the pickers' current choices, time it; (p50 ms, rel L2 vs want)."""
        engine._graphs.pop("act", None)  # (the probe's business: a forced choice needs a new capture)
        engine.act()
        torch.cuda.synchronize()
        err = float((engine.buffers.actions - want).norm() / want.norm())
        return time_cuda(engine.act, 3, a.iters)["p50_ms"], err

    chunk = config.chunk_size
    shapes = []  # (kind, picker, key, [candidate names]) of the act stage's shapes
    for row in ranking.get("gemm_choices", []):
        if row["m"] != chunk:
            continue
        key = next((k for k in engine.linear.choices if k[0] == row["m"] and list(k[1]) == row["weight"]
                    and k[3] == row["geglu"] and str(k[4]) == row["dtype"]
                    and list(k[5:]) == list(row.get("fused", []))), None)
        if key is not None:
            shapes.append(("gemm", engine.linear, key, ranked(row["ms"], a.top)))
    for row in ranking.get("attention_choices", []):
        key = next((k for k in engine.attend.choices if list(k[0]) == row["q"] and list(k[1]) == row["k"]
                    and k[0][1] == chunk), None)
        if key is not None:
            shapes.append(("attention", engine.attend, key, ranked(row["ms"], 2 * a.top)))

    rows = []

    def save():
        write_result(a.json, workload={"model": "pi05", "views": 2, "prompt_len": 48, "steps": 10, "chunk": chunk,
                                       "dtype": "bfloat16", "iters": a.iters, "top": a.top,
                                       "ranking": pathlib.Path(a.ranking).name},
                     results={"rows": rows})

    base, _ = act_ms()
    rows.append({"kind": "engine", "shape": "all", "config": "engine's own choices", "act_ms": base, "rel_l2": 0.0})
    print(f"act with the engine's own choices: {base * 1e3:.0f} us", flush=True)
    for kind, picker, key, names in shapes:
        own = picker.choices[key]
        label = str(key[:4]) if kind == "gemm" else str(key[0])
        for name in names:
            picker.choices[key] = as_config(name)
            try:
                ms, err = act_ms()
                row = {"kind": kind, "shape": label, "config": name, "own": picker.choices[key] == own,
                       "act_ms": ms, "rel_l2": err}
            except Exception as exc:  # noqa: BLE001 - a candidate that fails in the graph is a result too
                torch.cuda.synchronize()
                row = {"kind": kind, "shape": label, "config": name, "error": f"{type(exc).__name__}: {exc}"[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        picker.choices[key] = own
        again, _ = act_ms()
        rows.append({"kind": "engine", "shape": label, "config": "engine's own choices, again", "act_ms": again,
                     "rel_l2": 0.0})
        print(f"act with the engine's own choices again: {again * 1e3:.0f} us", flush=True)
        save()

    print(f"\n{'kind':10} {'shape':44} {'config':26} {'act us':>8} {'rel L2':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['kind']:10} {r['shape'][:44]:44} {r['config'][:26]:26} {r['error'][:40]}")
        else:
            mark = " *" if r.get("own") else ""
            print(f"{r['kind']:10} {r['shape'][:44]:44} {r['config'][:26]:26} {r['act_ms'] * 1e3:8.0f} "
                  f"{r['rel_l2']:9.2e}{mark}")
    save()
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
