"""`swiglu`: silu(gate) * up of a merged [..., 2F] gate|up GEMM output (Llama's MLP), with its torch reference.

Dispatch as every op of `flashrt_core.kernels` (backend None / "auto": Triton on CUDA, the reference elsewhere;
"triton"; "torch"); the Triton kernel (`kernels.swiglu_kernel`; a module named `swiglu` would shadow this op on the package) is imported on its first call.
"""
import torch.nn.functional as F

from flashrt_core import kernels as _K


def swiglu_ref(gate_up):
    """silu(gate) * up in fp32, returned in gate_up's dtype (gate columns first)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def swiglu(gate_up, *, out=None, backend=None):
    if _K._use_triton("swiglu", backend, gate_up.device):
        return _K._kernel("swiglu_kernel", "swiglu")(gate_up, out=out)
    return _K._into(out, swiglu_ref(gate_up))
