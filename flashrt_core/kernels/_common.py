"""Shared launcher helpers: typed errors, tensor checks, block-size picks.

Launchers only read tensor metadata (shape, dtype, strides, device), never values, so checking inputs costs
no host sync and is safe inside CUDA-graph capture.
"""
import contextlib
import contextvars
import os

import torch

from flashrt_core.errors import FlashRTError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64)


class KernelInputError(FlashRTError, ValueError):
    """A kernel was called with a tensor of the wrong shape, dtype, layout or device."""


class KernelUnavailableError(FlashRTError, RuntimeError):
    """`backend="triton"` was asked for where Triton kernels cannot run."""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


# ---- semaphores for in-kernel split reductions ------------------------------------------------------------
# Split-K GEMMs and split-key attention let the *last* program of each output tile (an atomic ticket per
# tile) sum the partials and write the result, so no second "reduce" kernel is launched. The tickets live in
# an int32 buffer that every kernel leaves all-zero when it ends (the last program resets its tile's ticket),
# so kernels that run one after another on one stream can share it; kernels that may run concurrently
# (stage graphs on different streams) must not. A CUDA graph bakes the buffer's address in, so an engine
# gives each stage its own buffer with `semaphore_workspace`; without one, each call gets fresh zeros.
_SEMAPHORES: contextvars.ContextVar = contextvars.ContextVar("flashrt_semaphores", default=None)
SEMAPHORE_WORKSPACE = 8192  # tickets: enough for the largest tile grid of pi0.5's split kernels


def new_semaphore_workspace(device, size: int = SEMAPHORE_WORKSPACE) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int32, device=device)


@contextlib.contextmanager
def semaphore_workspace(buffer: torch.Tensor):
    """Kernels launched inside use `buffer` (int32, all zero, from `new_semaphore_workspace`) for their tickets."""
    token = _SEMAPHORES.set(buffer)
    try:
        yield buffer
    finally:
        _SEMAPHORES.reset(token)


def semaphores(n: int, device) -> torch.Tensor:
    """n zeroed int32 tickets: a prefix of the active workspace on the same device, else a fresh tensor."""
    buf = _SEMAPHORES.get()
    if buf is not None and buf.device == torch.device(device) and buf.numel() >= n:
        return buf[:n]
    return torch.zeros(n, dtype=torch.int32, device=device)


# ---- programmatic dependent launch (host side; device side in _pdl.py) ------------------------------------
_PDL: contextvars.ContextVar = contextvars.ContextVar("flashrt_pdl", default=True)
_PDL_SUPPORT: dict = {}


@contextlib.contextmanager
def pdl_scope(enabled: bool):
    """Kernels launched inside use PDL only if `enabled` (and the GPU and Triton support it)."""
    token = _PDL.set(bool(enabled))
    try:
        yield
    finally:
        _PDL.reset(token)


def pdl_supported(device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0+ (Hopper, Blackwell, Thor), a Triton with
    griddepcontrol support and launch_pdl, and FLASHRT_PDL not set to 0. Never under the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or os.environ.get("FLASHRT_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL_SUPPORT:
        ok = torch.cuda.get_device_capability(index)[0] >= 9
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            from triton.language.extra.cuda import gdc_wait  # noqa: F401
            ok = ok and "launch_pdl" in CUDAOptions.__dataclass_fields__
        except ImportError:
            ok = False
        _PDL_SUPPORT[index] = ok
    return _PDL_SUPPORT[index]


def pdl_launch(device) -> dict:
    """Launch keyword arguments of a kernel that starts with `_pdl.pdl_enter` (or trigger/wait)."""
    if _PDL.get() and pdl_supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


# ---- compiling candidates in parallel (the tuning pickers) ---------------------------------------------------
_COMPILE_ONLY: contextvars.ContextVar = contextvars.ContextVar("flashrt_compile_only", default=False)


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`, or inside `precompile` only its compile (nothing runs, nothing is
    written: the caller's outputs are garbage there, which precompile never reads)."""
    if _COMPILE_ONLY.get():
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def precompile(calls, workers: int | None = None) -> None:
    """Compile the Triton kernels that each of `calls` (argument-less callables, e.g. one per tuning candidate)
    would launch through `launch`, in `workers` threads (default: the CPU count, at most 16), without running
    them; the calls' later real launches then find them compiled. Triton's compiler releases the GIL, so the
    compiles overlap (a tuning is mostly compiles: ~2x on 2 cores for 40 skinny GEMM candidates). A call that
    fails to build is left to fail again, and be reported, where it is really launched. No-op under the
    interpreter or a Triton without asynchronous compiles."""
    if interpreting():
        return
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # pragma: no cover - older Triton: the picker compiles as it times
        return
    workers = workers or min(16, os.cpu_count() or 1)
    token = _COMPILE_ONLY.set(True)
    try:
        with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for call in calls:
                try:
                    call()
                except Exception:  # noqa: BLE001 (reported by the real launch, see above)
                    pass
    finally:
        _COMPILE_ONLY.reset(token)


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def check(op: str, name: str, t, *, ndim=None, dtypes=FLOAT_DTYPES, shape=None, contiguous=False,
          last_contiguous=True, device=None) -> torch.Tensor:
    """Validate one launcher argument; every message names the op and the argument."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise KernelInputError(f"{op}: `{name}` must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise KernelInputError(f"{op}: `{name}` has dtype {t.dtype}, expected one of {names}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise KernelInputError(
                    f"{op}: `{name}` has shape {tuple(t.shape)}, expected dim {i} = {want}")
        if len(shape) != t.dim():
            raise KernelInputError(f"{op}: `{name}` has shape {tuple(t.shape)}, expected {len(shape)} dims")
    if contiguous and not t.is_contiguous():
        raise KernelInputError(f"{op}: `{name}` must be contiguous (strides {t.stride()})")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise KernelInputError(f"{op}: `{name}` must have a unit stride in its last dim (strides {t.stride()})")
    if device is not None and t.device != device:
        raise KernelInputError(f"{op}: `{name}` is on {t.device}, expected {device} like the first input")
    return t


def check_out(op: str, name: str, out, like_shape, device, dtypes=FLOAT_DTYPES):
    """An optional preallocated output (static buffer) must match exactly and be contiguous."""
    if out is None:
        return None
    check(op, name, out, dtypes=dtypes, contiguous=True, device=device)
    if tuple(out.shape) != tuple(like_shape):
        raise KernelInputError(f"{op}: `{name}` has shape {tuple(out.shape)}, expected {tuple(like_shape)}")
    return out


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel: enough lanes to cover the row in a few vector loads."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    if block >= 512:
        return 4
    return 2
