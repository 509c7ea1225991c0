"""The act stage's deferred-reduction GEMMs, ranked again inside the act graph.

`LinearPicker` times each GEMM candidate alone (a CUDA graph of repeated calls). For a GEMM that leaves its
split-K partials to the kernel after it (`defer`: the expert's QKV, o and down projections), that timing
leaves out a cost that depends on the candidate: the reader loads every partial of each row, so more splits
make the next kernel slower, and in the act graph's PDL chain a kernel's start and tail overlap its
neighbours differently than alone. On the H200 (W2, 2026-12-04, `benchmarks/chain_tuning_probe.py` and
`benchmarks/results/chain_tuning_probe_h200.json` at f940ba3) the picker's choice for the down
projection, 8 splits at 5.21 us alone, gave an act graph of 6060 us; a 4-split candidate at 5.74 us alone gave
5873 us. Every other act-stage shape kept its isolated ranking there.

So, once per engine (before its first graph holding the act stage is captured), each deferred GEMM's best
few candidates by isolated time are timed again as the act graph they would run in, one shape after the other
with the others at their current choice, and the fastest act graph decides. The result is kept in the tuning
cache (picker "<linear picker>_act_graph"), so a restarted engine applies it without timing again. Every
candidate here is one the picker accepted when it tuned the shape (its output agreed with cuBLAS's: only those
have an isolated time), in the same cache context (GPU, software, kernel sources), so a cached ranking is
applied as it is; the picker's own cached choice is still checked once, as before.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from flashrt_core.engine.gemm import Fusion
from flashrt_core.engine.tuning import TuningCache

log = logging.getLogger(__name__)

TOP = 4  # candidates per deferred GEMM timed in the act graph (the picker's choice among them)


def cache_name(picker) -> str:
    return f"{picker.cache_name}_act_graph"


def deferred_keys(picker) -> list:
    """The picker's shape keys of GEMMs that leave their partials to their reader (tag "defer")."""
    return [key for key in picker.choices if "defer" in key[5:]]


def _name(config) -> str:
    return "cublas" if config is None else str(config)


def candidates(picker, key, top: int = TOP) -> list:
    """The picker's current choice for `key`, then the fastest others by its isolated timings, `top` in all
    (configurations; None is cuBLAS). Names the picker no longer offers are skipped."""
    offered = {_name(c): c for c in picker.candidates_for(Fusion(defer=True), key[1][1])}
    offered["cublas"] = None
    times = {n: t for n, t in (picker.timings.get(key) or {}).items() if isinstance(t, float) and n in offered}
    out = [picker.choices[key]]
    for name in sorted(times, key=times.get):
        if len(out) >= top:
            break
        if offered[name] != out[0]:
            out.append(offered[name])
    return out


def rerank(picker, cache: TuningCache | None, time_graph: Callable[[], float], top: int = TOP) -> dict:
    """Choose each deferred GEMM's configuration by `time_graph()` (ms of the act graph with the picker's
    current choices; it captures a graph of its own). A choice the cache holds for this context is applied
    without timing if the picker still offers it. Returns {key: {candidate name: ms, or why it failed}} of
    the shapes timed here. A candidate that fails to capture or run is skipped; if every one fails, the
    picker's own choice stays."""
    timed = {}
    name = cache_name(picker)
    for key in deferred_keys(picker):
        cands = candidates(picker, key, top)
        if len(cands) < 2:  # (no isolated timings to rank by: nothing to choose between)
            continue
        found, choice, _ = cache.get(name, key) if cache is not None else (False, None, {})
        if found and choice in cands:
            picker.choices[key] = choice
            continue
        own, times = picker.choices[key], {}
        for config in cands:
            picker.choices[key] = config
            try:
                times[_name(config)] = float(time_graph())
            except Exception as exc:  # noqa: BLE001 (a candidate this graph cannot hold: the others decide)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times[_name(config)] = f"failed: {type(exc).__name__}: {exc}"[:200]
        valid = {n: t for n, t in times.items() if isinstance(t, float)}
        if valid:
            picker.choices[key] = {_name(c): c for c in cands}[min(valid, key=valid.get)]
        else:
            log.warning("act-graph ranking of %s: every candidate failed (%s); keeping the picker's choice",
                        key, times)
            picker.choices[key] = own
        timed[key] = times
        if cache is not None and valid:
            cache.put(name, key, picker.choices[key], valid)
    if cache is not None:
        cache.save()
    return timed
