"""Does a weight stream that runs ahead through the phase barriers reach copy speed? (GPU round, sm_90+)

  python benchmarks/tma_stream_probe.py --json benchmarks/results/tma_stream_probe_h200.json

`persistent_probe.py` showed that the act stage's launch structure caps even a bare weight stream at ~2.2
TB/s (15.7 us per layer, ~2.8 ms per act): each phase boundary (a launch, or a grid barrier) stalls the
stream, and Triton can only hold a few early tiles in registers across it; bulk L2 prefetches made it worse.
This probe streams the same bytes (a flow step's expert weights, 18 x 34.6 MB in 126 phases, three per layer
without weights) with the structure a persistent act kernel would have: every program keeps STAGES tiles
in flight as TMA copies into a ring of shared-memory slots (Gluon: tensor-memory-accelerator loads signalled
by mbarriers, no registers held), its issue cursor walking its tiles of every phase in order, past the phase
boundaries, while its consume cursor sums the tiles of the current phase and then waits at a grid barrier.
So at each barrier the next phase's first tiles are already on their way. Sums are checked as in
`persistent_probe.py`, and its fastest launch structure (two programs per SM, 4 tiles requested before the
PDL wait) runs in the same process as the baseline.
A second form (`_tma_stream_ws_kernel`) moves the copies to a producer warp of their own (Gluon warp
specialization): the producer walks the tile sequence and refills each slot as soon as the consumers hand it
back through an `empty` mbarrier; the consumers only wait, read, hand back and synchronize.
It is a probe of the structure, not an engine path: the real phases also compute (GEMM tiles, attention,
norms). The grid barrier is `persistent_probe.grid_barrier`'s (all programs resident: one per SM, or two
where the shared memory allows).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from _common import write_result  # noqa: E402
from persistent_probe import LAYERS, LAYER_PHASES, graph_time_ms, phase_bounds, run_launches  # noqa: E402

TILE_ROWS, TILE_COLS = 32, 128  # bf16: 8 KB per tile, 256-byte rows (the flat weights viewed as [-1, 128])
TILE = TILE_ROWS * TILE_COLS
ROWS_CHOICES = (32, 128)  # 8 and 32 KB tiles
WARPS = 4
# Triton 3.6 (the GPU machine) names the CTA-wide barrier thread_barrier, 3.9 (here) barrier
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# ... and the TMA load async_copy_global_to_shared, which 3.9 replaced by async_load (same arguments)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _phase_tiles(TILES, phase, n_phases):
    """(first tile, tile count) of phase `phase` ((0, 0) past the last)."""
    live = phase < n_phases
    base = gl.load(TILES + phase, mask=live, other=0)
    return base, gl.load(TILES + phase + 1, mask=live, other=0) - base


@gluon.jit
def _next_tile(phase, tile, base, count, pid, nprog, TILES, n_phases):
    """The program's tile after (phase, tile) with its phase's (first tile, count) kept in registers: tiles of
    a phase dealt round-robin, phases in order (those without weights have none), TILES read only when the
    phase changes; phase == n_phases once the program has no tile left."""
    tile = tile + nprog
    while (phase < n_phases) & (tile >= count):
        phase += 1
        tile = pid
        base, count = _phase_tiles(TILES, phase, n_phases)
    return phase, tile, base, count


@gluon.jit
def _issue(desc, ring, ready, slot, live, row):
    """Start the TMA copy of the tile at `row` into ring slot `slot` (nothing when not live)."""
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes, pred=live)
    _tma_load(desc, [row, 0], ready.index(slot), ring.index(slot), pred=live)


@gluon.jit
def _first_tile(TILES, pid, nprog, n_phases):
    """The issue cursor at the program's first tile: (phase, tile, phase's first tile, its count); the phase
    starts as a tensor 0 (it is loop-carried)."""
    base, count = _phase_tiles(TILES, pid * 0, n_phases)
    return _next_tile(pid * 0, pid - nprog, base, count, pid, nprog, TILES, n_phases)


@gluon.jit
def _my_tiles(TILES, p, pid, nprog):
    """How many of phase p's tiles are the program's (dealt round-robin)."""
    return gl.cdiv(gl.load(TILES + p + 1) - gl.load(TILES + p) - pid, nprog)


@gluon.jit
def _take(ring, ready, used, layout: gl.constexpr, STAGES: gl.constexpr):
    """Wait for the program's tile number `used` (slot used % STAGES, its fill used // STAGES) and return its
    column sums; every warp of the caller has read the slot when this returns."""
    slot = used % STAGES
    mbarrier.wait(ready.index(slot), (used // STAGES) & 1)
    sums = gl.sum(ring.index(slot).load(layout).to(gl.float32), 0)
    _cta_barrier()
    return sums


@gluon.jit
def _grid_barrier(BAR, nprog):
    _cta_barrier()
    drawn = gl.atomic_add(BAR, 1, sem="acq_rel", scope="gpu")
    target = (drawn // nprog + 1) * nprog
    seen = drawn + 1
    while seen < target:
        seen = gl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    _cta_barrier()


@gluon.jit
def _tma_stream_kernel(desc, TILES, BAR, ACC, n_phases, STAGES: gl.constexpr, TILE_ROWS: gl.constexpr,
                       TILE_COLS: gl.constexpr, WARPS: gl.constexpr):
    """TILES[p]: phase p's first tile (tiles of TILE_ROWS x TILE_COLS in the flat weights); the program sums
    its tiles of every phase, with a grid barrier after each phase, the copies STAGES tiles ahead."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TILE_ROWS, TILE_COLS], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    # issue cursor: the first STAGES tiles of the program's sequence
    i_phase, i_tile, i_base, i_count = _first_tile(TILES, pid, nprog, n_phases)
    for s in gl.static_range(STAGES):
        _issue(desc, ring, ready, s, i_phase < n_phases, (i_base + i_tile) * TILE_ROWS)
        i_phase, i_tile, i_base, i_count = _next_tile(i_phase, i_tile, i_base, i_count, pid, nprog, TILES, n_phases)
    total = gl.zeros([TILE_COLS], gl.float32, gl.SliceLayout(0, layout))
    used = 0  # tiles consumed so far: slot used % STAGES, its fill number used // STAGES
    for p in range(n_phases):
        for _ in range(_my_tiles(TILES, p, pid, nprog)):
            total += _take(ring, ready, used, layout, STAGES)  # (read by every warp before the refill)
            fence_async_shared()
            _issue(desc, ring, ready, used % STAGES, i_phase < n_phases, (i_base + i_tile) * TILE_ROWS)
            i_phase, i_tile, i_base, i_count = _next_tile(i_phase, i_tile, i_base, i_count, pid, nprog, TILES,
                                                          n_phases)
            used += 1
        _grid_barrier(BAR, nprog)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    gl.store(ACC + pid, gl.sum(total, 0))


@gluon.jit
def _ws_consumer(ring, ready, empty, TILES, BAR, ACC, n_phases, STAGES: gl.constexpr, TILE_COLS: gl.constexpr,
                 WARPS: gl.constexpr):
    """Default partition: sum the program's tiles phase by phase (slot k % STAGES holds its k-th tile), hand
    each slot back to the producer, and wait at the grid barrier after each phase."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    total = gl.zeros([TILE_COLS], gl.float32, gl.SliceLayout(0, layout))
    used = 0
    for p in range(n_phases):
        for _ in range(_my_tiles(TILES, p, pid, nprog)):
            total += _take(ring, ready, used, layout, STAGES)  # (read by every consumer warp before the hand-back)
            mbarrier.arrive(empty.index(used % STAGES), count=1)
            used += 1
        _grid_barrier(BAR, nprog)
    gl.store(ACC + pid, gl.sum(total, 0))


@gluon.jit
def _ws_producer(desc, ring, ready, empty, TILES, n_phases, STAGES: gl.constexpr, TILE_ROWS: gl.constexpr):
    """Worker partition (one warp): copy the program's tiles of every phase in order into the ring, each as
    soon as its slot is free; it never waits at the grid barrier, so it runs up to STAGES tiles ahead."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    phase, tile, base, count = _first_tile(TILES, pid, nprog, n_phases)
    issued = 0
    while phase < n_phases:
        slot = issued % STAGES
        # a fresh mbarrier passes a wait for parity 1: the first lap through the ring does not wait
        mbarrier.wait(empty.index(slot), ((issued // STAGES) & 1) ^ 1)
        _issue(desc, ring, ready, slot, phase < n_phases, (base + tile) * TILE_ROWS)
        phase, tile, base, count = _next_tile(phase, tile, base, count, pid, nprog, TILES, n_phases)
        issued += 1


@gluon.jit
def _tma_stream_ws_kernel(desc, TILES, BAR, ACC, n_phases, STAGES: gl.constexpr, TILE_ROWS: gl.constexpr,
                          TILE_COLS: gl.constexpr, WARPS: gl.constexpr):
    """The same stream with the copies issued by a producer warp of their own (warp specialization): the
    consumers' path per tile is a wait, the read and the hand-back only."""
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TILE_ROWS, TILE_COLS], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([(_ws_consumer, (ring, ready, empty, TILES, BAR, ACC, n_phases, STAGES, TILE_COLS, WARPS)),
                        (_ws_producer, (desc, ring, ready, empty, TILES, n_phases, STAGES, TILE_ROWS))],
                       [1], [48])


def tile_bounds(bounds: list[int], rows: int = TILE_ROWS) -> list[int]:
    """Phase bounds in tiles of rows x TILE_COLS elements (each phase must be whole tiles)."""
    tile = rows * TILE_COLS
    if any(b % tile for b in bounds):
        raise ValueError(f"tma_stream_probe: every phase must be a multiple of {tile} elements")
    return [b // tile for b in bounds]


def descriptor(w: torch.Tensor, rows: int = TILE_ROWS) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([rows, TILE_COLS], gl.bfloat16)
    return TensorDescriptor.from_tensor(w.view(-1, TILE_COLS), [rows, TILE_COLS], layout)


def run_tma_stream(w, desc, tiles_t, bar, acc, grid: int, stages: int, rows: int = TILE_ROWS, ws: bool = False):
    """ws: the warp-specialized kernel (a producer warp issues the copies)."""
    acc.zero_()
    kernel = _tma_stream_ws_kernel if ws else _tma_stream_kernel
    kernel[(grid,)](desc, tiles_t, bar, acc, len(tiles_t) - 1, STAGES=stages, TILE_ROWS=rows, TILE_COLS=TILE_COLS,
                    WARPS=WARPS, num_warps=WARPS)
    return acc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/tma_stream_probe_h200.json")
    p.add_argument("--stages", default="2,4,8,16")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bounds = phase_bounds(LAYERS)
    w = (torch.randn(bounds[-1], device=dev) + 1.0).to(torch.bfloat16)
    nbytes = bounds[-1] * 2
    want = float(w.float().sum())
    results = {}

    def record(name, fn, **info):
        try:
            got = float(fn().sum())
            if abs(got - want) > 1e-6 * abs(want) + 1e3:
                raise RuntimeError(f"sum {got} != {want}: not every byte read once")
            ms = graph_time_ms(fn)
        except Exception as exc:  # a configuration this GPU or Triton cannot run: reported, not fatal
            torch.cuda.synchronize()
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", **info}
            print(f"{name:36s} failed: {type(exc).__name__}: {str(exc)[:200]}")
            return
        results[name] = {"ms_per_flow_step": ms, "us_per_layer": ms * 1e3 / LAYERS, "tb_per_s": nbytes / ms / 1e9,
                         **info}
        print(f"{name:36s} {ms * 1e3:8.0f} us per flow step  {ms * 1e3 / LAYERS:6.1f} us per layer  "
              f"{nbytes / ms / 1e9:5.2f} TB/s")

    workload = {"layers": LAYERS, "phases_per_layer": [n for n, _ in LAYER_PHASES],
                "mb_per_layer": sum(2 * n for _, n in LAYER_PHASES) / 1e6, "tile_rows": ROWS_CHOICES,
                "tile_cols": TILE_COLS, "sms": sms}
    acc = torch.zeros(2 * sms, dtype=torch.float32, device=dev)
    record("launches_pdl_u2_p4_grid264", lambda: run_launches(w, bounds, acc, 2 * sms, 2, 4), grid=2 * sms)
    smem = torch.cuda.get_device_properties(dev).shared_memory_per_multiprocessor
    for rows in ROWS_CHOICES:
        tiles_t = torch.tensor(tile_bounds(bounds, rows), dtype=torch.int32, device=dev)
        desc = descriptor(w, rows)
        for stages in (int(s) for s in args.stages.split(",")):
            for per_sm in (1, 2):
                if per_sm * (stages * rows * TILE_COLS * 2 + 2048) > smem:  # all resident (grid barrier)
                    continue
                grid = per_sm * sms
                # the warp-specialized form takes the whole register file (setmaxnreg): one program per SM
                for ws in ((False, True) if per_sm == 1 else (False,)):
                    bar = torch.zeros(1, dtype=torch.int64, device=dev)
                    record(f"tma_stream{'_ws' if ws else ''}_r{rows}_s{stages}_grid{grid}",
                           lambda g=grid, s=stages, b=bar, d=desc, t=tiles_t, r=rows, x=ws: run_tma_stream(
                               w, d, t, b, acc[:g], g, s, r, x),
                           stages=stages, grid=grid, tile_kb=rows * TILE_COLS * 2 // 1024, warp_specialized=ws)
                    write_result(args.json, workload, {"stream": results})  # kept if a later variant hangs
    write_result(args.json, workload, {"stream": results})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
