"""The observe stage's attention picks against forced older ones, in the same process (issue 3, GPU round).

Builds the W2 engine (its AttentionPicker tunes every candidate, `engine_attention.CANDIDATES`), then, for
the observe stage's two attention shapes (SigLIP over its patches, the prefix over itself), alternates
between the engine's own picks and `--old` forced on both shapes, re-capturing the observe graph each time
(CUDA events, p50 of --iters replays per round, --rounds rounds interleaved). Each forced graph's prefix K/V
are checked against the engine's own (relative L2). Prints a table, writes JSON.

    python benchmarks/observe_attention_ab.py [--json benchmarks/results/observe_attention_ab_h200.json]
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_core.bench import random_inputs, random_state, time_cuda, workload_config  # noqa: E402


def observe_keys(engine, chunk: int) -> list:
    """The attention picker's shape keys of the observe stage (everything but the expert's chunk-row queries)."""
    return [k for k in engine.attend.choices if k[0][1] != chunk]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/observe_attention_ab.json")
    p.add_argument("--old", default="(64, 64, 1, 4)", help="the configuration forced on both shapes (W2's pick "
                   "at 6d7a0bc, before the wider key tiles)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("observe_attention_ab: needs a CUDA GPU")
    from flashrt_core.models.pi05 import convert
    from flashrt_core.models.pi05.engine import Pi05Engine

    config = workload_config(2, 48, 10, 50)
    w32 = convert(config, random_state(config, 0, "cuda"))
    engine = Pi05Engine(w32, device="cuda", dtype=torch.bfloat16)
    del w32
    inputs = random_inputs(config, 0, "cuda")
    engine.set_observation(*(inputs[k] for k in ("images", "image_masks", "lang_tokens", "lang_mask")))
    engine.observe()
    torch.cuda.synchronize()
    buf = engine.buffers
    want_k, want_v = buf.prefix_k.clone(), buf.prefix_v.clone()
    keys = observe_keys(engine, config.chunk_size)
    own = {k: engine.attend.choices[k] for k in keys}
    old = tuple(ast.literal_eval(a.old))

    def observe_ms(forced: bool) -> tuple[float, float]:
        for k in keys:
            engine.attend.choices[k] = old if forced else own[k]
        engine._graphs.pop("observe", None)  # (the probe's business: other picks need a new capture)
        engine.observe()
        torch.cuda.synchronize()
        err = max(float((buf.prefix_k - want_k).norm() / want_k.norm()),
                  float((buf.prefix_v - want_v).norm() / want_v.norm()))
        return time_cuda(engine.observe, 3, a.iters)["p50_ms"], err

    samples = {"own": [], "old": []}
    errors = {"own": 0.0, "old": 0.0}
    for _ in range(a.rounds):
        for name, forced in (("own", False), ("old", True)):
            ms, err = observe_ms(forced)
            samples[name].append(ms)
            errors[name] = max(errors[name], err)
    observe_ms(False)  # leave the engine with its own picks
    picks = [{"q": list(k[0]), "k": list(k[1]), "own": str(own[k]),
              "isolated_us": {n: round(t * 1e3, 2) for n, t in (engine.attend.timings.get(k) or {}).items()
                              if isinstance(t, float)}} for k in keys]
    result = {name: {"observe_p50_ms": statistics.median(v), "rounds_ms": v, "max_rel_l2_kv": errors[name]}
              for name, v in samples.items()}
    print(f"{'observe graph':40} {'p50 us':>8} {'rounds us':>40} {'rel L2 K/V':>11}")
    for name, r in result.items():
        label = "engine's own picks" if name == "own" else f"{a.old} forced"
        rounds = " ".join(f"{x * 1e3:.0f}" for x in r["rounds_ms"])
        print(f"{label:40} {r['observe_p50_ms'] * 1e3:8.0f} {rounds:>40} {r['max_rel_l2_kv']:11.2e}")
    for pk in picks:
        print(f"q {pk['q']} k {pk['k']}: own pick {pk['own']}; isolated {pk['isolated_us'].get(pk['own'], '?')} us, "
              f"{a.old} {pk['isolated_us'].get(a.old, '?')} us")
    write_result(a.json, workload={"model": "pi05", "views": 2, "prompt_len": 48, "dtype": "bfloat16",
                                   "iters": a.iters, "rounds": a.rounds, "old": a.old},
                 results=result, extra={"picks": picks})
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
