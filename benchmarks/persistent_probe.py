"""Would one persistent kernel per flow step beat the action expert's chain of launches? (GPU round)

  python benchmarks/persistent_probe.py --json benchmarks/results/persistent_probe_h200.json

The act stage is a serial chain of ~8 kernels per layer and flow step, ~45 us per layer on the H200 where
its 34.6 MB of weights take ~8 us at copy speed: each launch pays a ramp-up and a tail. A persistent
kernel (one program per SM, resident for the whole step) would replace each kernel boundary by a grid
barrier. This measures the two costs that decide it, on the expert's real byte counts:
  barrier    grid barriers back to back in one kernel: us per barrier (one program per SM, and two)
  persistent one kernel streams a flow step's weights (per layer: QKV 5.2 MB, o 4.2, gate|up 16.8, down
             8.4, and three phases without weights where the attention and norms would run) with a grid
             barrier after every phase; `prefetch`: each program loads its first tile of the next phase
             before it waits at the barrier (what the skinny GEMMs do before their PDL wait)
  launches   the same phases as one kernel launch each, in a CUDA graph with PDL (the first tile loaded
             before the PDL wait): the engine's launch structure with the work reduced to the weight stream
Every variant reads the same bytes and sums them (the sums are checked against each other), so the
difference is the synchronization alone. It is a probe of the launch structure, not an engine path: the
real phases also compute (GEMM tiles, attention, norms).
The grid barrier: every program arrives with one acq_rel atomic add on a 64-bit counter that only grows
(no reset between barriers or launches: a barrier's target is the next multiple of the grid size above
the value a program drew), then polls it with acquire loads until all have arrived.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from _common import write_result  # noqa: E402
from flashrt_core.kernels._common import pdl_launch  # noqa: E402
from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait  # noqa: E402

# Bytes of the expert's weights per layer, in the order the phases run (0: a phase without weights).
LAYER_PHASES_MB = (("qkv", 5.24288), ("attention", 0.0), ("o", 4.194304), ("norm", 0.0), ("gate_up", 16.777216),
                   ("down", 8.388608), ("norm", 0.0))
LAYERS = 18
BLOCK = 4096  # bf16 elements per tile: 8 KB


@triton.jit
def grid_barrier(BAR, nprog):
    """Every program of the grid waits here until all have arrived (all must be resident). BAR: int64
    counter that only grows; the writes before the barrier are visible to every program after it (loads of
    them must bypass L1: .cg)."""
    tl.debug_barrier()  # the whole program's writes are issued before it arrives
    drawn = tl.atomic_add(BAR, 1, sem="acq_rel", scope="gpu")
    target = (drawn // nprog + 1) * nprog
    seen = drawn + 1
    while seen < target:
        seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _barrier_kernel(BAR, OUT, n_barriers):
    nprog = tl.num_programs(0)
    for _ in range(n_barriers):
        grid_barrier(BAR, nprog)
    if tl.program_id(0) == 0:
        tl.store(OUT, tl.atomic_add(BAR, 0, sem="relaxed", scope="gpu"))


@triton.jit
def _tile_sum(W, lo, hi, t, BLOCK: tl.constexpr):
    offs = lo + t * BLOCK + tl.arange(0, BLOCK)  # < 2^31 elements: int32 is enough
    return tl.sum(tl.load(W + offs, mask=offs < hi, other=0.0).to(tl.float32), 0)


@triton.jit
def _persistent_kernel(W, BOUNDS, BAR, ACC, n_phases, PREFETCH: tl.constexpr, BLOCK: tl.constexpr):
    """Phase p streams W[BOUNDS[p]:BOUNDS[p + 1]] (tiles dealt round-robin to the programs), then a barrier."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = 0.0
    first = 0.0
    if PREFETCH:
        first = _tile_sum(W, tl.load(BOUNDS), tl.load(BOUNDS + 1), pid, BLOCK)
    for p in range(n_phases):
        lo = tl.load(BOUNDS + p)
        hi = tl.load(BOUNDS + p + 1)
        tiles = tl.cdiv(hi - lo, BLOCK)
        start = pid
        if PREFETCH:
            total += first
            start = pid + nprog
        for t in range(start, tiles, nprog):
            total += _tile_sum(W, lo, hi, t, BLOCK)
        if PREFETCH:  # the next phase's first tile is in flight while this program waits
            if p + 1 < n_phases:
                first = _tile_sum(W, hi, tl.load(BOUNDS + p + 2), pid, BLOCK)
        grid_barrier(BAR, nprog)
    tl.store(ACC + pid, total)


@triton.jit
def _phase_kernel(W, lo, hi, ACC, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """One phase as its own launch: the first tile before the PDL wait, the rest after; the program's sum
    is added to ACC[pid] (the previous launch's write is complete after the wait)."""
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = _tile_sum(W, lo, hi, pid, BLOCK)
    pdl_wait(PDL)
    for t in range(pid + nprog, tl.cdiv(hi - lo, BLOCK), nprog):
        total += _tile_sum(W, lo, hi, t, BLOCK)
    tl.store(ACC + pid, tl.load(ACC + pid) + total)


def phase_bounds(layers: int, scale: float = 1.0) -> list[int]:
    """Element offsets of each phase's weights in one flat bf16 buffer (layers x LAYER_PHASES_MB)."""
    bounds = [0]
    for _ in range(layers):
        for _, mb in LAYER_PHASES_MB:
            bounds.append(bounds[-1] + int(mb * scale * 2 ** 20) // 2)
    return bounds


def run_persistent(w, bounds_t, bar, acc, prefetch: bool, grid: int):
    acc.zero_()
    _persistent_kernel[(grid,)](w, bounds_t, bar, acc, len(bounds_t) - 1, PREFETCH=prefetch, BLOCK=BLOCK,
                                num_warps=4)
    return acc


def run_launches(w, bounds, acc, grid: int):
    acc.zero_()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        _phase_kernel[(grid,)](w, lo, hi, acc, BLOCK=BLOCK, num_warps=4, **pdl_launch(w.device))
    return acc


def graph_time_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of fn captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/persistent_probe_h200.json")
    p.add_argument("--barriers", type=int, default=2000)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bar = torch.zeros(1, dtype=torch.int64, device=dev)
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    rows = {}
    for per_sm in (1, 2):
        grid = sms * per_sm
        ms = graph_time_ms(lambda g=grid: _barrier_kernel[(g,)](bar, out, args.barriers, num_warps=4))
        rows[f"barrier_us_grid{grid}"] = ms * 1e3 / args.barriers
        print(f"grid barrier, {grid} programs: {ms * 1e3 / args.barriers:.2f} us each")
    bounds = phase_bounds(LAYERS)
    w = torch.randn(bounds[-1], device=dev).to(torch.bfloat16)
    bounds_t = torch.tensor(bounds, dtype=torch.int64, device=dev)
    nbytes = bounds[-1] * 2
    want = float(w.float().sum())
    results = {}
    for per_sm in (1, 2):
        grid = sms * per_sm
        acc = torch.zeros(grid, dtype=torch.float32, device=dev)
        variants = {f"persistent_grid{grid}": lambda: run_persistent(w, bounds_t, bar, acc, False, grid),
                    f"persistent_prefetch_grid{grid}": lambda: run_persistent(w, bounds_t, bar, acc, True, grid),
                    f"launches_pdl_grid{grid}": lambda: run_launches(w, bounds, acc, grid)}
        for name, fn in variants.items():
            got = float(fn().sum())
            if abs(got - want) > 1e-3 * abs(want) + 1.0:
                raise SystemExit(f"{name}: sum {got} != {want}: the variant did not read every byte once")
            ms = graph_time_ms(fn)
            results[name] = {"ms_per_flow_step": ms, "us_per_layer": ms * 1e3 / LAYERS,
                             "tb_per_s": nbytes / ms / 1e9}
            print(f"{name:32s} {ms * 1e3:8.0f} us per flow step  {ms * 1e3 / LAYERS:6.1f} us per layer  "
                  f"{nbytes / ms / 1e9:5.2f} TB/s")
    workload = {"layers": LAYERS, "phases_per_layer": [n for n, _ in LAYER_PHASES_MB],
                "mb_per_layer": sum(mb for _, mb in LAYER_PHASES_MB), "block_elems": BLOCK,
                "barriers": args.barriers, "sms": sms}
    write_result(args.json, workload, {"barrier": rows, "stream": results})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
