"""Warming the L2 cache from inside a kernel with data that a *later* kernel reads (sm_90+).

In a latency-bound chain (the action expert: 50 tokens, one small kernel after another) each GEMM waits
for its weights to come from HBM, and HBM sits idle while the attention and norm kernels between the GEMMs
run. A glue kernel can instead start the next GEMMs' weight stream itself: `l2_prefetch` issues bulk L2
prefetches (`cp.async.bulk.prefetch.L2.global`, fire-and-forget: nothing waits for them, no register or
shared memory holds the data) for up to two byte ranges, spread over all the kernel's programs in
PREFETCH_CHUNK pieces. Results never change (a prefetch only moves data closer); only the timing does.

Device side: call `l2_prefetch(A0, N0, A1, N1, PREFETCH)` once per program, after `pdl_enter` (a range
that is prefetched while the *previous* kernel still streams its own weights would slow that one down).
Host side: `prefetch_args(op, device, tensors)` gives the launch keywords; it is off (PREFETCH=False, the
ranges unused) on CPU, under the interpreter (inline PTX cannot run there), before sm_90, with
FLASHRT_L2_PREFETCH=0, or when no tensor is given.
"""
import os

import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import KernelInputError, check, interpreting

PREFETCH_CHUNK = tl.constexpr(16384)  # bytes per prefetch instruction (a multiple of 16, as required)
PREFETCH_LANES = tl.constexpr(128)  # chunks issued at once per program (one per thread at 4 warps)
MAX_RANGES = 2
_SUPPORT: dict = {}


@triton.jit
def _bulk_prefetch(addr, size):
    # The dummy result only satisfies inline_asm_elementwise; is_pure=False keeps the unused op alive.
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                                     "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_range(A, N, pid, programs, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program `pid` of `programs` prefetches its share of the chunks of bytes [A, A + N)."""
    lane = tl.arange(0, LANES)
    n_chunks = (N + CHUNK - 1) // CHUNK
    for first in range(pid * LANES, n_chunks, programs * LANES):
        c = first + lane
        ok = c < n_chunks
        offset = c.to(tl.int64) * CHUNK
        size = tl.minimum(N - offset, CHUNK)
        # Lanes past the end re-prefetch the first 16 bytes: harmless, and no branch per lane.
        _bulk_prefetch(A + tl.where(ok, offset, 0), tl.where(ok, size, 16).to(tl.int32))


@triton.jit
def l2_prefetch(A0, N0, A1, N1, PREFETCH: tl.constexpr):
    """Prefetch bytes [A0, A0 + N0) and [A1, A1 + N1) (16-byte aligned addresses and sizes, from
    `prefetch_args`) into L2, shared out over every program of the grid. A no-op unless PREFETCH."""
    if PREFETCH:
        n0 = tl.num_programs(0)
        n1 = tl.num_programs(1)
        pid = tl.program_id(0) + n0 * (tl.program_id(1) + n1 * tl.program_id(2))
        programs = n0 * n1 * tl.num_programs(2)
        _prefetch_range(A0, N0, pid, programs, PREFETCH_CHUNK, PREFETCH_LANES)
        _prefetch_range(A1, N1, pid, programs, PREFETCH_CHUNK, PREFETCH_LANES)


def prefetch_supported(device) -> bool:
    """Bulk L2 prefetch needs a CUDA device of compute capability 9.0+ (Hopper, Blackwell, Thor), compiled
    kernels (not the interpreter), and FLASHRT_L2_PREFETCH not set to 0."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or os.environ.get("FLASHRT_L2_PREFETCH", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SUPPORT:
        _SUPPORT[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _SUPPORT[index]


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """(address, size) of a contiguous tensor's bytes, widened to 16-byte boundaries (the caching
    allocator's blocks are 512-byte aligned, so the widened range stays inside the allocation)."""
    start = t.data_ptr() & ~15
    end = (t.data_ptr() + t.numel() * t.element_size() + 15) & ~15
    return start, end - start


def prefetch_args(op: str, device, tensors) -> dict:
    """Launch keywords PF_A0, PF_N0, PF_A1, PF_N1, PREFETCH of a kernel that calls `l2_prefetch`, for up
    to MAX_RANGES contiguous tensors on `device` that later kernels will read (None or () for none)."""
    tensors = [] if tensors is None else list(tensors)
    if len(tensors) > MAX_RANGES:
        raise KernelInputError(f"{op}: `prefetch` takes at most {MAX_RANGES} tensors, got {len(tensors)}")
    for i, t in enumerate(tensors):
        check(op, f"prefetch[{i}]", t, dtypes=None, contiguous=True, device=torch.device(device))
    on = bool(tensors) and prefetch_supported(device)
    ranges = [byte_range(t) for t in tensors] if on else []
    ranges += [(0, 0)] * (MAX_RANGES - len(ranges))
    return {"PF_A0": ranges[0][0], "PF_N0": ranges[0][1], "PF_A1": ranges[1][0], "PF_N1": ranges[1][1],
            "PREFETCH": on}
