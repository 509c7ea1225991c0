"""Does a hand-written CUDA kernel that streams the weights ahead through the phase boundaries beat the
launch chain of the action expert's GEMMs? (GPU round; needs nvcc for sm_90a)

  python benchmarks/cuda_chain_probe.py --json benchmarks/results/cuda_chain_probe_h200.json

The act stage is ~180 layer-steps of ~33 us on the H200, of which the four GEMMs take ~19.5 us, each with
~2-4 us of ramp-up and tail around its share of the layer's 34.6 MB of weights (8.2 us at 4.2 TB/s). The
Triton / Gluon probes (`persistent_probe.py`, `tma_stream_probe.py`) found no persistent structure that
streams those weights faster than one PDL launch per phase (16.1 us per layer for the bare stream). This one
asks the same of CUDA, with the real work: `cuda/chain_probe.cu` runs one flow step (18 layers x 7 phases:
QKV, attention, o, norm, gate|up, down, norm; the phases without weights only synchronize) as one
persistent kernel, one block per SM. A producer warp streams the block's 16 KB weight tiles of every phase
into a ring of shared-memory slots (bulk copies + mbarriers) without ever waiting for another block; a
second warp waits for the phase's grid-wide arrival counter and then copies the activation tiles; eight
math warps multiply them on the tensor cores (mma.sync or wgmma, bf16 -> fp32) and write split-K partials.
Findings (H200, 2026-12-04): benchmarks/README.md, "The expert's GEMM chain as one persistent CUDA kernel".

Variants (each is one CUDA graph: the arrival counters zeroed, one launch), named by what they do:
  stream        math off, no activation copies: the bare weight stream through the phase barriers
  stream_x      math off, activation copies after each barrier
  gemm          the whole chain: tiles multiplied with mma.sync, partials written (checked against float64
                torch)
  wgmma         the same with wgmma (operands straight from the shared-memory slots)
  wgmma2        wgmma with two tiles in flight (two accumulators; a tile's slots given back one tile later)
  gemmgx        mma.sync with the activations loaded from global memory (L2) straight into registers: no
                activation copies (the activation warp only signals that the previous phase is complete)
  _w<a>_x<b>    weight / activation ring slots (16 KB each; default 10 and 3)
  _s<bits>      the kernel's `sync` bits: 1 no __threadfence before the arrival's release add, 2 relaxed
                polling and one acquire fence, 4 no proxy fence before the activation copies
                (8: no wait for the previous phase at all, a diagnostic of the stream and the slot hand-offs;
                16: no partial stores, a diagnostic of what they cost; neither is checked)
  _4ph          the four GEMM phases per layer only (no phases without weights): the engine_gemms structure
  _flat         stream only: every weight tile in one phase (no barriers, one run per block): the copy rate
  _trace        also one run with %globaltimer stamps per block and phase, summarized per phase kind (median
                over layers 2-18 and blocks, us): seen = the last arrival of the previous phase -> a block's
                activation warp sees it; ready = seen -> the first tile's weights and activations are in
                shared memory; math = first -> last tile done; tail = partial stores + arrival; span = the
                phase's last arrival after the previous phase's; lead = first weight copy issued -> ready;
                per tile (the first 16 of a run): w_gap = weights ready after the previous tile was done,
                x_gap = activations after weights, tile = one tile, done to done
Baselines in the same process, the same weight bytes (622 MB per flow step, past the 50 MB L2):
  triton_stream_launches  persistent_probe's launch structure (PDL, 264 programs, 2 tiles per load, 4
                          before the wait): the bare stream, one launch per phase
  engine_gemms            the engine's skinny GEMMs with their tuned H200 configurations, 4 per layer
                          back to back with PDL (QKV / o / down leave split-K partials, gate|up with GeGLU)
  cublas_gemms            torch.mm for the same 4 products per layer
The inputs of each phase are fixed (not the previous phase's output), so the partials can be checked; the
timing structure is the same as a chained one (every phase still waits for the previous one).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import write_result  # noqa: E402

SOURCE = HERE / "cuda" / "chain_probe.cu"
# (name, N, K) per phase of a layer, in the order they run; N = 0: a phase without weights
LAYER_PHASES = (("qkv", 2560, 1024), ("attention", 0, 0), ("o", 1024, 2048), ("norm", 0, 0),
                ("gate_up", 8192, 1024), ("down", 1024, 4096), ("norm", 0, 0))
GEMMS = tuple(name for name, n, _ in LAYER_PHASES if n)
LAYERS = 18
ROWS = 50  # the action chunk: 50 tokens
COLS = 64  # output columns per tile (one partial chunk)
KTILE = 128  # k per tile
ATOM = 64  # k per atom: rows of 128 bytes (wgmma's 128-byte swizzle)
PIECE = 8  # bf16 per 16-byte piece
TILE_BYTES = COLS * KTILE * 2
JMAX = 3  # partials per block and phase (the kernel's JMAX)
FIELDS = 6  # int64 fields per phase in the kernel's table
MATH_WARPS = 8
THREADS = (MATH_WARPS + 2) * 32
X_SLOT_BYTES = 64 * KTILE * 2  # two atoms of 64 rows
# The engine's tuned picks for these shapes on the H200 (`.cache/tuning`, 2026-12-04; down as ranked in the
# act graph): (block_n, block_k, split_k, warps, stages)
DEFAULT_VARIANTS = ("stream_flat", "gemm_s3_4ph_trace", "gemmgx_s3_4ph_trace", "wgmma_s3_4ph_trace",
                    "gemmgx_s8_4ph_trace", "gemmgx_s3_trace", "gemm_s3_trace")
ENGINE_CONFIGS = {"qkv": (64, 512, 0, 8, 1), "o": (64, 512, 0, 8, 1), "gate_up": (32, 128, 1, 4, 4),
                  "down": (64, 128, 4, 4, 4)}


# ---- layouts (shared with the CPU tests) -------------------------------------------------------------------
def _swizzle(t: torch.Tensor) -> torch.Tensor:
    """t [..., R, ATOM] (rows of 64 k) -> the same rows with their 16-byte pieces stored at piece ^ (row & 7):
    the 128-byte swizzle of the kernel's atoms."""
    rows = t.shape[-2]
    pieces = t.reshape(*t.shape[:-1], ATOM // PIECE, PIECE)
    stored = torch.arange(ATOM // PIECE)
    source = stored[None, :] ^ (torch.arange(rows)[:, None] & 7)  # stored piece q holds logical q ^ (r & 7)
    index = source.to(t.device).reshape(rows, ATOM // PIECE, 1).expand(*pieces.shape)
    return torch.gather(pieces, -2, index).reshape(t.shape)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (N % 64 == 0, K % 128 == 0) -> the kernel's tiles, flat: chunk-major (all k-tiles of output
    columns 0-63, then 64-127, ...), each tile two atoms (k 0-63, 64-127) of 64 rows x 64 k, swizzled."""
    n, k = w.shape
    if n % COLS or k % KTILE:
        raise ValueError(f"pack_weight: shape {tuple(w.shape)} is not a multiple of ({COLS}, {KTILE})")
    atoms = w.reshape(n // COLS, COLS, k // KTILE, KTILE // ATOM, ATOM).permute(0, 2, 3, 1, 4)
    return _swizzle(atoms.contiguous()).reshape(-1)


def pack_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> per k-tile two atoms of M rows x 64 k, swizzled, flat (what the kernel's two bulk copies of
    M * 128 bytes bring into an activation slot)."""
    m, k = x.shape
    if k % KTILE:
        raise ValueError(f"pack_x: K = {k} is not a multiple of {KTILE}")
    return _swizzle(x.reshape(m, k // ATOM, ATOM).permute(1, 0, 2).contiguous()).reshape(-1)


def tile_range(tiles: int, block: int, blocks: int) -> tuple[int, int]:
    """The run of a phase's tiles that block `block` of `blocks` takes (the kernel's tile_range)."""
    return tiles * block // blocks, tiles * (block + 1) // blocks


def chunks_per_block(tiles: int, ktiles: int, blocks: int) -> int:
    """The most output chunks any block's run touches (each gets a partial; must be <= JMAX)."""
    most = 0
    for b in range(blocks):
        t0, t1 = tile_range(tiles, b, blocks)
        if t1 > t0:
            most = max(most, (t1 - 1) // ktiles - t0 // ktiles + 1)
    return most


def phase_table(layers: int, blocks: int, weightless: bool = True) -> tuple[list[list[int]], dict[str, int]]:
    """The kernel's phase table (w_offset bytes, tiles, ktiles, x_offset bytes, part_base, 0 per phase) and
    the byte offset of each GEMM's packed activations in the x buffer. weightless=False leaves out the phases
    without weights (the GEMMs back to back)."""
    x_offsets, at = {}, 0
    for name, n, k in LAYER_PHASES:
        if n:
            x_offsets[name] = at
            at += ROWS * k * 2
    table, w_at = [], 0
    for _ in range(layers):
        for name, n, k in LAYER_PHASES:
            if not n:
                if weightless:
                    table.append([0, 0, 0, 0, 0, 0])
                continue
            tiles, ktiles = (n // COLS) * (k // KTILE), k // KTILE
            if chunks_per_block(tiles, ktiles, blocks) > JMAX:
                raise ValueError(f"{name}: a block would touch more than {JMAX} output chunks at {blocks} blocks")
            table.append([w_at, tiles, ktiles, x_offsets[name], GEMMS.index(name) * blocks * JMAX, 0])
            w_at += n * k * 2
    return table, x_offsets


def flat_table(nbytes: int) -> list[list[int]]:
    """One phase over every weight tile, its k-tile count past any run (one output chunk, no activations)."""
    return [[0, nbytes // TILE_BYTES, 1 << 30, 0, 0, 0]]


def emulate_partials(x: torch.Tensor, w: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel writes for one GEMM phase (partials [blocks * JMAX, M, 64] fp32, tags: the output chunk
    of each, -1 where unused), computed in torch with the kernel's tile runs: the reference for its
    control flow."""
    n, k = w.shape
    ktiles = k // KTILE
    parts = torch.zeros(blocks * JMAX, x.shape[0], COLS, dtype=torch.float32)
    tags = torch.full((blocks * JMAX,), -1, dtype=torch.int32)
    xf, wf = x.float(), w.float()
    for b in range(blocks):
        t0, t1 = tile_range((n // COLS) * ktiles, b, blocks)
        j = -1
        for t in range(t0, t1):
            chunk, kt = divmod(t, ktiles)
            if j < 0 or tags[b * JMAX + j] != chunk:
                j += 1
                tags[b * JMAX + j] = chunk
            ks = slice(kt * KTILE, (kt + 1) * KTILE)
            parts[b * JMAX + j] += xf[:, ks] @ wf[chunk * COLS:(chunk + 1) * COLS, ks].T
    return parts, tags


def reduce_partials(parts: torch.Tensor, tags: torch.Tensor, n: int) -> torch.Tensor:
    """Sum the partials of each output chunk: [M, n] fp32 (what the phase's reader would do)."""
    out = torch.zeros(parts.shape[1], n, dtype=torch.float32, device=parts.device)
    for i in torch.nonzero(tags >= 0).flatten().tolist():
        c = int(tags[i])
        out[:, c * COLS:(c + 1) * COLS] += parts[i]
    return out


# ---- the CUDA kernel ---------------------------------------------------------------------------------------
def parse_variant(name: str) -> dict:
    """'gemm_w4_x2_s3_4ph' -> the kernel's arguments (see the module doc); unknown parts raise ValueError."""
    parts = name.split("_")
    kinds = ("stream", "gemm", "wgmma", "wgmma2", "gemmgx")
    if parts[0] not in kinds:
        raise ValueError(f"variant {name!r}: must start with one of {', '.join(kinds)}")
    spec = {"math": kinds.index(parts[0]), "xload": int(parts[0] not in ("stream", "gemmgx")), "w_slots": 10,
            "x_slots": 3, "sync": 0, "weightless": True, "flat": False, "trace": False}
    for part in parts[1:]:
        if part == "x" and parts[0] == "stream":
            spec["xload"] = 1
        elif part == "4ph":
            spec["weightless"] = False
        elif part == "trace":
            spec["trace"] = True
        elif part == "flat" and parts[0] == "stream":
            spec["flat"] = True
        elif part[:1] in "wxs" and part[1:].isdigit():
            spec[{"w": "w_slots", "x": "x_slots", "s": "sync"}[part[0]]] = int(part[1:])
        else:
            raise ValueError(f"variant {name!r}: unknown part {part!r}")
    if not 0 <= spec["sync"] <= 31:
        raise ValueError(f"variant {name!r}: sync bits are 0-31")
    if spec["flat"] and spec["xload"]:
        raise ValueError(f"variant {name!r}: a flat stream has no activations")
    return spec


def nvcc() -> str | None:
    """The nvcc to compile with: $NVCC, then PATH, then /usr/local/cuda*/bin."""
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc",
                 "/usr/local/cuda-13/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def compile_cubin(out_dir: str, arch: str = "sm_90a") -> tuple[Path, str]:
    """nvcc -cubin of chain_probe.cu; returns the cubin and ptxas's resource report."""
    exe = nvcc()
    if exe is None:
        raise RuntimeError("cuda_chain_probe: no nvcc found (set NVCC)")
    cubin = Path(out_dir) / "chain_probe.cubin"
    res = subprocess.run([exe, f"-arch={arch}", "-cubin", "-O3", "-Xptxas", "-v", "-o", str(cubin), str(SOURCE)],
                         capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvcc failed:\n{res.stderr}")
    return cubin, res.stderr


class ChainKernel:
    """chain_kernel loaded through the driver API (ctypes), launched on torch's current stream."""

    def __init__(self, cubin: Path):
        self.cu = ctypes.CDLL("libcuda.so.1")
        torch.zeros(1, device="cuda")  # the runtime's primary context is current from here on
        self.module, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        self._ok(self.cu.cuModuleLoadData(ctypes.byref(self.module), cubin.read_bytes()), "cuModuleLoadData")
        self.funcs = []  # per math mode (the kernel's template argument)
        for name in KERNELS:
            func = ctypes.c_void_p()
            self._ok(self.cu.cuModuleGetFunction(ctypes.byref(func), self.module, name.encode()), f"GetFunction {name}")
            self.funcs.append(func)
        self.cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3

    def _ok(self, r: int, what: str) -> None:
        if r:
            raise RuntimeError(f"{what}: CUresult {r}")

    @staticmethod
    def smem_bytes(w_slots: int, x_slots: int) -> int:
        return (w_slots * TILE_BYTES + x_slots * X_SLOT_BYTES) + 16 * (w_slots + x_slots)

    def blocks_per_sm(self, math: int, smem: int) -> int:
        func = self.funcs[math]
        self._ok(self.cu.cuFuncSetAttribute(func, 8, ctypes.c_int(smem)), "max dynamic smem")  # attribute 8
        n = ctypes.c_int()
        self._ok(self.cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), func, ctypes.c_int(THREADS),
                                                                    ctypes.c_size_t(smem)), "occupancy")
        return n.value

    def launch(self, blocks, w, table, n_phases, x, parts, tags, arrivals, w_slots, x_slots, math, xload, sync,
               trace=None):
        smem = self.smem_bytes(w_slots, x_slots)
        vals = [ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(table.data_ptr()), ctypes.c_int(n_phases),
                ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(parts.data_ptr()), ctypes.c_void_p(tags.data_ptr()),
                ctypes.c_void_p(arrivals.data_ptr()), ctypes.c_int(ROWS), ctypes.c_int(w_slots),
                ctypes.c_int(x_slots), ctypes.c_int(xload), ctypes.c_int(sync),
                ctypes.c_void_p(trace.data_ptr() if trace is not None else 0)]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.cu.cuLaunchKernel(self.funcs[math], blocks, 1, 1, THREADS, 1, 1, smem, stream, params, None),
                 "cuLaunchKernel")


TRACE = 5  # the kernel's stamps per block and phase
TILE_STAMPS = 16  # tiles per block and phase with stamps of their own (weights ready, activations ready, done)
KERNELS = ("chain_stream", "chain_mma", "chain_wgmma", "chain_wgmma2", "chain_mma_gx")  # by math mode


def _mid(x: torch.Tensor) -> float:
    return float(x.quantile(0.5))  # the mean of the two middle values (torch.median takes the lower)


def summarize_trace(stamps: torch.Tensor, names: list[str]) -> dict:
    """stamps [blocks, phases, TRACE] ns (the kernel's trace) -> per phase kind, the median us of each step
    (see the module doc) over layers past the first and over the blocks that have tiles of the phase."""
    t = stamps.double() / 1e3
    arrival = torch.where(t[:, :, 3] > 0, t[:, :, 3], t[:, :, 0])  # weightless / no tiles: warp 9 arrives
    done = arrival.max(0).values
    per_layer = len(names) // LAYERS
    rows: dict[str, dict[str, list]] = {}
    for p in range(per_layer, len(names)):
        has = t[:, p, 1] > 0
        r = rows.setdefault(names[p], {k: [] for k in ("seen", "ready", "math", "math_max", "tail", "span", "lead")})
        r["seen"].append(_mid(t[:, p, 0] - done[p - 1]))
        r["span"].append(float(done[p] - done[p - 1]))
        if bool(has.any()):
            b = t[has, p]
            r["ready"].append(_mid(b[:, 1] - b[:, 0]))
            r["math"].append(_mid(b[:, 2] - b[:, 1]))
            r["math_max"].append(float((b[:, 2] - b[:, 1]).max()))
            r["tail"].append(_mid(b[:, 3] - b[:, 2]))
            r["lead"].append(_mid(b[:, 1] - b[:, 4]))
    return {name: {k: statistics.median(v) for k, v in r.items() if v} for name, r in rows.items()}


def summarize_tiles(tiles: torch.Tensor, names: list[str]) -> dict:
    """tiles [blocks, phases, TILE_STAMPS, 3] ns (weights ready, activations ready, done; 0: no such tile) ->
    per phase kind, median us over layers past the first and blocks: w_gap = a tile's weights ready after the
    previous tile was done, x_gap = its activations after its weights, tile = done after the previous done."""
    t = tiles.double() / 1e3
    per_layer = len(names) // LAYERS
    out: dict[str, dict[str, list]] = {}
    for p in range(per_layer, len(names)):
        cur, prev = t[:, p, 1:], t[:, p, :-1]
        ok = (cur[..., 2] > 0) & (prev[..., 2] > 0)
        if not bool(ok.any()):
            continue
        r = out.setdefault(names[p], {"w_gap": [], "x_gap": [], "tile": []})
        r["w_gap"].append(_mid((cur[..., 0] - prev[..., 2])[ok]))
        r["x_gap"].append(_mid((cur[..., 1] - cur[..., 0])[ok]))
        r["tile"].append(_mid((cur[..., 2] - prev[..., 2])[ok]))
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in out.items()}


def _row(results: dict, name: str, ms: float, nbytes: int, **extra) -> None:
    results[name] = {"ms_per_flow_step": ms, "us_per_layer": ms * 1e3 / LAYERS, "tb_per_s": nbytes / ms / 1e9,
                     **extra}
    print(f"{name:34s} {ms * 1e3:8.0f} us per flow step  {ms * 1e3 / LAYERS:6.2f} us per layer  "
          f"{nbytes / ms / 1e9:5.2f} TB/s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/cuda_chain_probe_h200.json")
    p.add_argument("--variants", default=" ".join(DEFAULT_VARIANTS), help="variant names (see the module doc)")
    p.add_argument("--no-baselines", action="store_true")
    args = p.parse_args(argv)
    import persistent_probe as pp  # graph timing (and the launch-structure baseline)

    def graph_ms(fn):
        return pp.graph_time_ms(fn, reps=30)

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tmp = tempfile.mkdtemp()
    cubin, report = compile_cubin(tmp)
    print(report.strip().splitlines()[-1])
    kernel = ChainKernel(cubin)
    specs = {name: parse_variant(name) for name in args.variants.split()}
    tables = {}
    for weightless in (True, False):
        table, x_offsets = phase_table(LAYERS, sms, weightless)
        tables[weightless] = torch.tensor(table, dtype=torch.int64, device=dev).reshape(-1)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {name: (n, k) for name, n, k in LAYER_PHASES if n}
    nbytes = LAYERS * sum(2 * n * k for n, k in shapes.values())
    w_packed = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    weights = []  # [N, K] per layer and GEMM, for the baselines (the same values)
    at = 0
    for _ in range(LAYERS):
        layer = {}
        for name, (n, k) in shapes.items():
            w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
            w_packed[at:at + 2 * n * k] = pack_weight(w).view(torch.uint8)
            at += 2 * n * k
            layer[name] = w
        weights.append(layer)
    xs = {name: torch.randn(ROWS, k, device=dev, generator=gen).to(torch.bfloat16) for name, (n, k) in shapes.items()}
    tables["flat"] = torch.tensor(flat_table(nbytes), dtype=torch.int64, device=dev).reshape(-1)
    x_packed = torch.empty(sum(2 * ROWS * k for _, k in shapes.values()), dtype=torch.uint8, device=dev)
    for name, at in x_offsets.items():  # each GEMM's packed activations where the phase table points
        x_packed[at:at + 2 * ROWS * shapes[name][1]] = pack_x(xs[name]).view(torch.uint8)
    parts = torch.zeros(len(GEMMS) * sms * JMAX, ROWS, COLS, dtype=torch.float32, device=dev)
    tags = torch.full((len(GEMMS) * sms * JMAX,), -1, dtype=torch.int32, device=dev)
    arrivals = torch.zeros(LAYERS * len(LAYER_PHASES), dtype=torch.int32, device=dev)
    results, checks = {}, {}

    for name, spec in specs.items():
        w_slots, x_slots, math = spec["w_slots"], spec["x_slots"], spec["math"]
        table_t = tables["flat"] if spec["flat"] else tables[spec["weightless"]]
        n_phases = table_t.numel() // FIELDS
        smem = kernel.smem_bytes(w_slots, x_slots)
        fit = kernel.blocks_per_sm(math, smem)
        if fit < 1:
            results[name] = {"skipped": f"{smem} bytes of shared memory do not fit"}
            print(f"{name}: skipped ({smem} bytes of shared memory)")
            continue

        def run(s=spec, t=table_t, n=n_phases):
            arrivals.zero_()
            kernel.launch(sms, w_packed, t, n, x_packed, parts, tags, arrivals, s["w_slots"], s["x_slots"], s["math"],
                          s["xload"], s["sync"])

        tags.fill_(-1)
        parts.zero_()  # nothing of an earlier variant can pass for this one's products
        run()
        torch.cuda.synchronize()
        if not bool((arrivals[:n_phases] == sms).all()):
            raise SystemExit(f"{name}: the phase counters read {arrivals.tolist()[:8]}..., not {sms} each")
        if math and not spec["sync"] & 16:  # the last layer's partials against float64 torch
            worst = 0.0
            for g, name_g in enumerate(GEMMS):
                n, k = shapes[name_g]
                sl = slice(g * sms * JMAX, (g + 1) * sms * JMAX)
                got = reduce_partials(parts[sl], tags[sl], n)
                want = (xs[name_g].double() @ weights[-1][name_g].double().T).float()
                err = float((got - want).abs().max() / want.abs().max())
                worst = max(worst, err)
                if err > 1e-4:
                    raise SystemExit(f"{name}: {name_g} partials are off by {err:.2e} of the largest output")
            checks[name] = worst
        ms = graph_ms(run)
        _row(results, name, ms, nbytes, **spec, phases=n_phases, smem_bytes=smem, blocks=sms,
             max_rel_err=checks.get(name))
        if spec["trace"] and not spec["flat"]:
            per_phase = sms * n_phases
            buf = torch.zeros(per_phase * TRACE + per_phase * TILE_STAMPS * 3, dtype=torch.int64, device=dev)
            arrivals.zero_()
            kernel.launch(sms, w_packed, table_t, n_phases, x_packed, parts, tags, arrivals, w_slots, x_slots, math,
                          spec["xload"], spec["sync"], buf)
            torch.cuda.synchronize()
            buf = buf.cpu()
            stamps = buf[:per_phase * TRACE].reshape(sms, n_phases, TRACE)
            tiles = buf[per_phase * TRACE:].reshape(sms, n_phases, TILE_STAMPS, 3)
            names = [n for _ in range(LAYERS) for n, width, _ in LAYER_PHASES if width or spec["weightless"]]
            summary = summarize_trace(stamps, names)
            for kind, vals in summarize_tiles(tiles, names).items():
                summary.setdefault(kind, {}).update(vals)
            results[name]["trace_us"] = summary
            for kind, vals in summary.items():
                print(f"    {kind:10s} " + "  ".join(f"{k} {v:6.2f}" for k, v in vals.items()))

    if not args.no_baselines:
        from flashrt_core.models.pi05.engine_gemm import _kwargs, skinny_linear

        flat = w_packed.view(torch.bfloat16)  # the same bytes in another order: a stream reads every byte once
        bounds = pp.phase_bounds(LAYERS)
        assert bounds[-1] == flat.numel(), (bounds[-1], flat.numel())
        acc = torch.zeros(2 * sms, dtype=torch.float32, device=dev)
        _row(results, "triton_stream_launches", graph_ms(lambda: pp.run_launches(flat, bounds, acc, 2 * sms, 2, 4)),
             nbytes, grid=2 * sms, unroll=2, prefetch_tiles=4)

        def engine_chain():
            for layer in weights:
                for name_g in GEMMS:
                    skinny_linear(xs[name_g], layer[name_g], geglu=name_g == "gate_up", defer=name_g != "gate_up",
                                  **_kwargs(ENGINE_CONFIGS[name_g]))

        _row(results, "engine_gemms", graph_ms(engine_chain), nbytes,
             configs={k: list(v) for k, v in ENGINE_CONFIGS.items()})

        def cublas_chain():
            for layer in weights:
                for name_g in GEMMS:
                    torch.mm(xs[name_g], layer[name_g].T)

        _row(results, "cublas_gemms", graph_ms(cublas_chain), nbytes)
    workload = {"layers": LAYERS, "rows": ROWS, "phases_per_layer": [n for n, _, _ in LAYER_PHASES],
                "mb_per_layer": nbytes / LAYERS / 1e6, "tile": [COLS, KTILE], "blocks": sms,
                "ptxas": report.strip().splitlines()[-2:]}
    write_result(args.json, workload, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
