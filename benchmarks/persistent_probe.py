"""Would one persistent kernel per flow step beat the action expert's chain of launches? (GPU round)

  python benchmarks/persistent_probe.py --json benchmarks/results/persistent_probe_h200.json

The act stage is a serial chain of ~8 kernels per layer and flow step, ~45 us per layer on the H200 where
its 34.6 MB of weights take ~8 us at copy speed: each launch pays a ramp-up and a tail. A persistent
kernel (one program per SM, resident for the whole step) would replace each kernel boundary by a grid
barrier. This measures the two costs that decide it, on the expert's real byte counts:
  barrier    grid barriers back to back in one kernel: us per barrier (one program per SM, and two)
  persistent one kernel streams a flow step's weights (per layer: QKV 5.2 MB, o 4.2, gate|up 16.8, down
             8.4, and three phases without weights where the attention and norms would run) with a grid
             barrier after every phase; each program loads UNROLL tiles of 8 KB at a time, and with
             PREFETCH = n loads its first n tiles of the next phase before it waits at the barrier, keeping
             them in registers until after it (what the skinny GEMMs do before their PDL wait)
  launches   the same phases as one kernel launch each, in a CUDA graph with PDL (the first PREFETCH tiles
             loaded before the PDL wait): the engine's launch structure with the work reduced to the stream
  AHEAD = n MB (sm_90+; third config entry): besides, before every barrier (persistent) or PDL wait
             (launches) the programs issue bulk L2 prefetches (`kernels._prefetch`, fire-and-forget: no
             register or shared memory holds them) for the next n MB of weights in stream order that no
             earlier prefetch covered, so HBM keeps streaming while the programs synchronize and while the
             phases without weights run; the loads after the barrier then hit L2
Every variant reads the same bytes and sums them (the sums are checked against each other), so the
difference is the synchronization alone. It is a probe of the launch structure, not an engine path: the
real phases also compute (GEMM tiles, attention, norms).
The grid barrier: every program arrives with one acq_rel atomic add on a 64-bit counter that only grows
(no reset between barriers or launches: a barrier's target is the next multiple of the grid size above
the value a program drew), then polls it with acquire loads until all have arrived. Every program must be
resident at once, or the first barrier waits forever: a persistent grid runs only where the compiled kernel
fits that many programs per SM (`programs_per_sm`, from its registers and shared memory).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from _common import write_result  # noqa: E402
from flashrt_core.bench import graph_ms  # noqa: E402
from flashrt_core.kernels._common import pdl_launch  # noqa: E402
from flashrt_core.kernels._pdl import pdl_trigger, pdl_wait  # noqa: E402
from flashrt_core.kernels._prefetch import (PREFETCH_CHUNK, PREFETCH_LANES, _prefetch_range,  # noqa: E402
                                            prefetch_supported)

# The expert's weights per layer (0: a phase without weights, where the attention or a norm would run).
LAYER_PHASES = (("qkv", 2560 * 1024), ("attention", 0), ("o", 1024 * 2048), ("norm", 0), ("gate_up", 8192 * 1024),
                ("down", 1024 * 4096), ("norm", 0))  # bf16 weight elements per phase, in the order they run
ALIGN = 1024  # every phase is a multiple of this many elements (weight rows of K >= 1024): aligned loads
_ALIGN = tl.constexpr(ALIGN)  # the same, as the kernels may read it
LAYERS = 18
BLOCK = 4096  # bf16 elements per tile: 8 KB
WARPS = 4  # per program; the default configs compile without register spills at this size (sm_90)


@triton.jit
def grid_barrier(BAR, nprog):
    """Every program of the grid waits here until all have arrived (all must be resident). BAR: int64
    counter that only grows; it must be a multiple of the grid size when a kernel starts (a counter of its
    own per grid size: each launch adds grid x barriers). The writes before the barrier are visible to every
    program after it (loads of them must bypass L1: .cg). The polling add of 0 compiles to an acquire load."""
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
def _tiles(W, lo, hi, t0, step, N: tl.constexpr, BLOCK: tl.constexpr):
    """Tiles t0, t0 + step, ... (N of them) of W[lo:hi] as one [N, BLOCK] load; zeros past hi."""
    j = tl.arange(0, N)
    offs = lo + (t0 + j[:, None] * step) * BLOCK + tl.arange(0, BLOCK)[None, :]  # < 2^31 elements: int32
    return tl.load(W + offs, mask=offs < hi, other=0.0)


@triton.jit
def _sum(tiles):
    return tl.sum(tl.sum(tiles.to(tl.float32), 1), 0)


@triton.jit
def _l2_window(WADDR, start, end, pid, nprog):
    """Bulk L2 prefetch of weight elements [start, end) (bf16 at byte address WADDR), shared over the grid."""
    if end > start:
        _prefetch_range(WADDR + start * 2, (end - start) * 2, pid, nprog, PREFETCH_CHUNK, PREFETCH_LANES)


@triton.jit
def _persistent_kernel(W, BOUNDS, BAR, ACC, n_phases, WADDR, l2_ahead, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
                       AHEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Phase p streams W[BOUNDS[p]:BOUNDS[p + 1]] (tiles dealt round-robin to the programs, UNROLL tiles per
    load), then a grid barrier. PREFETCH > 0: before the barrier each program loads its first PREFETCH
    tiles of the next phase and keeps them in registers, summing them only after the barrier (the loads
    are in flight while it waits). AHEAD: before each barrier the grid also prefetches into L2 the `l2_ahead`
    weight elements after the phase (only those no earlier window covered)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = 0.0
    covered = tl.load(BOUNDS)  # weights before this element are (being) prefetched already
    end_all = tl.load(BOUNDS + n_phases)
    if PREFETCH > 0:
        ahead = _tiles(W, tl.multiple_of(tl.load(BOUNDS), _ALIGN), tl.multiple_of(tl.load(BOUNDS + 1), _ALIGN), pid,
                       nprog, PREFETCH, BLOCK)
    for p in range(n_phases):
        lo = tl.multiple_of(tl.load(BOUNDS + p), _ALIGN)
        hi = tl.multiple_of(tl.load(BOUNDS + p + 1), _ALIGN)
        tiles = tl.cdiv(hi - lo, BLOCK)
        start = pid
        if PREFETCH > 0:
            total += _sum(ahead)
            start = pid + PREFETCH * nprog
        for t in range(start, tiles, nprog * UNROLL):
            total += _sum(_tiles(W, lo, hi, t, nprog, UNROLL, BLOCK))
        if PREFETCH > 0:  # past the last phase: an empty range
            following = tl.multiple_of(tl.load(BOUNDS + p + 2, mask=p + 1 < n_phases, other=0), _ALIGN)
            ahead = _tiles(W, hi, tl.maximum(following, hi), pid, nprog, PREFETCH, BLOCK)
        if AHEAD:
            window_end = tl.minimum(hi + l2_ahead, end_all)
            _l2_window(WADDR, tl.maximum(covered, hi), window_end, pid, nprog)
            covered = tl.maximum(covered, window_end)
        grid_barrier(BAR, nprog)
    tl.store(ACC + pid, total)


@triton.jit
def _phase_kernel(W, lo, hi, ACC, WADDR, pf_start, pf_end, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
                  AHEAD: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """One phase as its own launch (lo, hi: multiples of ALIGN, which Triton sees divisible by 16): the first
    PREFETCH tiles loaded before the PDL wait, the rest after; the program's sum is added to ACC[pid] (the
    previous launch's write is complete after the wait). AHEAD: weight elements [pf_start, pf_end) are
    prefetched into L2 before the wait."""
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = 0.0
    start = pid
    if AHEAD:
        _l2_window(WADDR, pf_start, pf_end, pid, nprog)
    if PREFETCH > 0:
        ahead = _tiles(W, lo, hi, pid, nprog, PREFETCH, BLOCK)
        start = pid + PREFETCH * nprog
    pdl_wait(PDL)
    if PREFETCH > 0:
        total += _sum(ahead)
    for t in range(start, tl.cdiv(hi - lo, BLOCK), nprog * UNROLL):
        total += _sum(_tiles(W, lo, hi, t, nprog, UNROLL, BLOCK))
    tl.store(ACC + pid, tl.load(ACC + pid) + total)


def phase_bounds(layers: int, scale: float = 1.0) -> list[int]:
    """Element offsets of each phase's weights in one flat bf16 buffer (layers x LAYER_PHASES), each phase
    scaled by `scale` (tests) and kept a multiple of ALIGN elements (the kernels promise the compiler that)."""
    bounds = [0]
    for _ in range(layers):
        for _, n in LAYER_PHASES:
            bounds.append(bounds[-1] + (max(1, round(n * scale / ALIGN)) * ALIGN if n else 0))
    return bounds


def run_persistent(w, bounds_t, bar, acc, grid: int, unroll: int = 1, prefetch: int = 0, ahead: int = 0):
    acc.zero_()
    launch_persistent(w, bounds_t, bar, acc, grid, unroll, prefetch, ahead)
    return acc


def launch_persistent(w, bounds_t, bar, acc, grid: int, unroll: int, prefetch: int, ahead: int = 0):
    """One launch of the persistent kernel; returns what Triton's launcher returns (the compiled kernel).
    ahead: weight elements prefetched into L2 past each phase (0: none)."""
    return _persistent_kernel[(grid,)](w, bounds_t, bar, acc, len(bounds_t) - 1, w.data_ptr(), ahead,
                                       UNROLL=unroll, PREFETCH=prefetch, AHEAD=ahead > 0, BLOCK=BLOCK,
                                       num_warps=WARPS)


def prefetch_windows(bounds: list[int], ahead: int) -> list[tuple[int, int]]:
    """Per phase launch, the weight elements [start, end) to prefetch into L2 before its PDL wait: the `ahead`
    elements after the phase's own, less what an earlier launch's window covered (empty: start == end).
    The persistent kernel computes the same windows before its barriers."""
    windows, covered = [], bounds[0]
    for hi in bounds[1:]:
        end = min(hi + ahead, bounds[-1]) if ahead > 0 else hi
        start = max(covered, hi)
        windows.append((start, max(start, end)))
        covered = max(covered, end)
    return windows


def run_launches(w, bounds, acc, grid: int, unroll: int = 1, prefetch: int = 0, ahead: int = 0):
    """One launch per phase; with ahead, launch i prefetches the window after phase i - 1 (issued before its
    PDL wait, while phase i - 1 finishes: the launch-structure twin of the persistent kernel's prefetch
    before the barrier after phase i - 1)."""
    acc.zero_()
    windows = [(bounds[0], bounds[0])] + prefetch_windows(bounds, ahead)[:-1]
    for (lo, hi), (pf_start, pf_end) in zip(zip(bounds[:-1], bounds[1:]), windows):
        _phase_kernel[(grid,)](w, lo, hi, acc, w.data_ptr(), pf_start, pf_end, UNROLL=unroll, PREFETCH=prefetch,
                               AHEAD=ahead > 0, BLOCK=BLOCK, num_warps=WARPS, **pdl_launch(w.device))
    return acc


def programs_per_sm(kernel, device) -> int:
    """How many programs of a compiled kernel fit on one SM at once (registers, warps, shared memory): a
    persistent grid larger than SMs x this would wait at its first barrier forever. 1 when the launcher
    does not say how many registers the kernel uses."""
    regs = getattr(kernel, "n_regs", 0) or 0
    if not regs:
        return 1
    props = torch.cuda.get_device_properties(device)
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in units of 256
    fit = min(getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * WARPS), 64 // WARPS)
    shared = getattr(getattr(kernel, "metadata", None), "shared", 0) or 0
    if shared:
        reserved = 1024  # per program on sm_80+
        fit = min(fit, getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // (shared + reserved))
    return max(1, fit)


def graph_time_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of fn captured in a CUDA graph (`flashrt_core.bench.graph_ms`, one call per
    graph)."""
    return graph_ms(lambda _: fn(), [None], rounds=reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/persistent_probe_h200.json")
    p.add_argument("--barriers", type=int, default=2000)
    p.add_argument("--configs", default="1,0 2,4 4,4 1,0,8 2,4,8 2,0,16 2,4,16 4,4,16 2,4,32",
                   help="UNROLL,PREFETCH[,AHEAD]: tiles per load, next-phase tiles loaded before each barrier "
                        "(persistent) or before the PDL wait (launches), and MB of weights prefetched into L2 "
                        "ahead of the stream there (sm_90+; default 0)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    rows = {}
    for per_sm in (1, 2):
        grid = sms * per_sm
        bar = torch.zeros(1, dtype=torch.int64, device=dev)  # a counter per grid size (see grid_barrier)
        ms = graph_time_ms(lambda g=grid, c=bar: _barrier_kernel[(g,)](c, out, args.barriers, num_warps=4))
        rows[f"barrier_us_grid{grid}"] = ms * 1e3 / args.barriers
        print(f"grid barrier, {grid} programs: {ms * 1e3 / args.barriers:.2f} us each")
    bounds = phase_bounds(LAYERS)
    # Mean 1: one tile missed or read twice moves the sum by ~4096, outside the check's tolerance (fp32
    # accumulation over ~300 tiles per program stays within a few hundred).
    w = (torch.randn(bounds[-1], device=dev) + 1.0).to(torch.bfloat16)
    bounds_t = torch.tensor(bounds, dtype=torch.int64, device=dev)
    nbytes = bounds[-1] * 2
    want = float(w.float().sum())
    configs = [(*(int(v) for v in c.split(",")), 0)[:3] for c in args.configs.split()]
    if any(a > 0 for *_, a in configs) and not prefetch_supported(dev):
        raise SystemExit("AHEAD needs bulk L2 prefetch (sm_90+, compiled kernels)")
    results = {}
    fits = {}
    for unroll, prefetch, mb in configs:  # one program per SM always fits; it also compiles the kernel
        kernel = launch_persistent(w, bounds_t, torch.zeros(1, dtype=torch.int64, device=dev),
                                   torch.zeros(sms, device=dev), sms, unroll, prefetch, mb * 2 ** 19)
        fits[(unroll, prefetch, mb)] = programs_per_sm(kernel, dev)
    for per_sm in (1, 2):
        grid = sms * per_sm
        acc = torch.zeros(grid, dtype=torch.float32, device=dev)
        bar = torch.zeros(1, dtype=torch.int64, device=dev)  # a counter per grid size (see grid_barrier)
        for unroll, prefetch, mb in configs:
            tag = f"u{unroll}_p{prefetch}_a{mb}_grid{grid}"
            ahead = mb * 2 ** 19  # bf16 elements
            variants = {f"launches_pdl_{tag}": lambda u=unroll, f=prefetch, a=ahead: run_launches(w, bounds, acc,
                                                                                                grid, u, f, a)}
            if per_sm <= fits[(unroll, prefetch, mb)]:
                variants[f"persistent_{tag}"] = lambda u=unroll, f=prefetch, a=ahead: run_persistent(
                    w, bounds_t, bar, acc, grid, u, f, a)
            else:
                fit = fits[(unroll, prefetch, mb)]
                results[f"persistent_{tag}"] = {"skipped": f"{fit} program(s) per SM fit"}
                print(f"persistent_{tag}: skipped, only {fit} program(s) per SM fit")
            for name, fn in variants.items():
                got = float(fn().sum())
                if abs(got - want) > 1e-6 * abs(want) + 1e3:
                    raise SystemExit(f"{name}: sum {got} != {want}: the variant did not read every byte once")
                ms = graph_time_ms(fn)
                results[name] = {"ms_per_flow_step": ms, "us_per_layer": ms * 1e3 / LAYERS,
                                 "tb_per_s": nbytes / ms / 1e9, "unroll": unroll, "prefetch_tiles": prefetch,
                                 "l2_ahead_mb": mb, "grid": grid}
                print(f"{name:36s} {ms * 1e3:8.0f} us per flow step  {ms * 1e3 / LAYERS:6.1f} us per layer  "
                      f"{nbytes / ms / 1e9:5.2f} TB/s")
    workload = {"layers": LAYERS, "phases_per_layer": [n for n, _ in LAYER_PHASES],
                "mb_per_layer": sum(2 * n for _, n in LAYER_PHASES) / 1e6, "block_elems": BLOCK,
                "barriers": args.barriers, "sms": sms, "configs": configs}
    write_result(args.json, workload, {"barrier": rows, "stream": results})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
