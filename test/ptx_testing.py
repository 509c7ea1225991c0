"""Compile the project's Triton kernels for an H100 / H200 (sm_90) on a machine without a GPU, and report
what their PTX does: how wide the global loads are, whether tiles stream through cp.async, and what a kernel
reads before its PDL wait (`griddepcontrol.wait`). Speed needs the GPU; these structural facts do not.

    python test/ptx_testing.py            # JSON report of every case below
    python test/ptx_testing.py --engine   # every kernel of a W2-shaped decision (one layer per tower)
    python test/ptx_testing.py --preload  # registers / spills of the preloading GEMM candidates
    python test/ptx_testing.py --engine --arch 100   # the same engine scan for another target (sm_100a,
                                                     # sm_110a: Jetson Thor in CUDA 13's naming, ...)

It must run in a process of its own, without TRITON_INTERPRET (the kernels are then compiled, not
interpreted): Triton's active driver is replaced by a stand-in that names an sm_90 target, and every kernel
launch becomes a compile-only warm-up whose compiled kernel is kept. Inputs are CPU tensors: only their
shapes, strides, dtypes and 16-byte alignment reach the compiler. Used by `test_kernels_ptx.py`.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
    sys.exit("ptx_testing: run without TRITON_INTERPRET (kernels must compile, not interpret)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
if "--arch" in sys.argv:  # (chosen before anything compiles: Triton keeps one compiled kernel per device)
    _i = sys.argv.index("--arch")
    TARGET = GPUTarget("cuda", int(sys.argv[_i + 1]), 32)
    del sys.argv[_i:_i + 2]


class _Sm90:
    """The driver calls a compile-only warm-up makes."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


COMPILED: list = []  # (kernel name, compiled kernel) of every launch, in order
_launch = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _launch(self, *args, grid=grid, warmup=True, **kwargs)
    COMPILED.append((self.fn.__name__, kernel))
    return kernel


driver.set_active(_Sm90())
JITFunction.run = _compile_only
_PDL = {"PDL": True, "launch_pdl": True}

import importlib  # noqa: E402
import pkgutil  # noqa: E402

import flashrt_core.kernels as K  # noqa: E402
from flashrt_core.kernels import flash_attention as fa  # noqa: E402
from flashrt_core.kernels import skinny_gemm  # noqa: E402
from flashrt_core.engine import gemm as engine_gemm  # noqa: E402

# Every kernel is compiled as the H200 launches it (with PDL), and CPU tensors go to the compile-only kernels.
for _info in pkgutil.iter_modules(K.__path__):
    _module = importlib.import_module(f"flashrt_core.kernels.{_info.name}")
    if hasattr(_module, "pdl_launch"):
        _module.pdl_launch = lambda device: dict(_PDL)
K.available = lambda device=None: True

_OPS = re.compile(r"^\s*(?:@%p\d+\s+)?((?:ld|st)\.global[.\w]*|cp\.async\.c[ag][.\w]*|cp\.async\.bulk\.tensor[.\w]*|"
                  r"griddepcontrol\.wait)", re.M)


def summarize(ptx: str) -> dict:
    """Counts of global loads / stores and cp.async by their PTX form (e.g. ld.global.v4.b32 moves 16 bytes),
    in the whole kernel and before its first griddepcontrol.wait (all of it when there is none)."""
    ops = _OPS.findall(ptx)
    wait = ops.index("griddepcontrol.wait") if "griddepcontrol.wait" in ops else len(ops)

    def count(seq):
        out: dict[str, int] = {}
        for op in seq:
            if op != "griddepcontrol.wait":
                out[op] = out.get(op, 0) + 1
        return out
    return {"all": count(ops), "before_wait": count(ops[:wait]), "has_wait": wait < len(ops)}


def resources(kernel) -> dict:
    """Registers and stack (spill) bytes per thread and shared memory per program of a compiled kernel, from
    its cubin (`cuobjdump -res-usage`, shipped with Triton)."""
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return {"regs": int(regs.group(1)), "stack_bytes": int(stack.group(1)), "shared_bytes": kernel.metadata.shared}


def _last(name: str) -> dict:
    kernel_name, kernel = COMPILED[-1]
    assert kernel_name == name, (kernel_name, name)
    return {**summarize(kernel.asm["ptx"]), **resources(kernel)}


def attention_case(q_shape, kv_heads, keys, config, *, second=0, mask=False, cache=False, constant_kv=False) -> dict:
    """The attention kernel as the engine calls it: q token-major [B, T, Hq, Dh]; k, v [B, Hkv, S, Dh] either
    views of a token-major fused QKV output (SigLIP: q / k / v come out of one GEMM) or, with `cache`, the
    prefix K/V cache's own contiguous buffers (Gemma prefix and the expert); `second` own keys [B, Hkv, second,
    Dh] in buffers of their own (the expert's suffix K/V)."""
    b, t, hq, dh = q_shape
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, max(t, keys), hq + 2 * kv_heads, dh, generator=g).to(torch.bfloat16)
    q = qkv[:, :t, :hq]
    if cache:
        k, v = (torch.randn(b, kv_heads, keys, dh, generator=g).to(torch.bfloat16) for _ in range(2))
    else:
        k = qkv[:, :keys, hq:hq + kv_heads].transpose(1, 2)
        v = qkv[:, :keys, hq + kv_heads:].transpose(1, 2)
    key_mask = torch.ones(b, keys, dtype=torch.bool) if mask else None
    k2 = v2 = None
    if second:
        k2, v2 = (torch.randn(b, kv_heads, second, dh, generator=g).to(torch.bfloat16) for _ in range(2))
    fa.attention(q, k, v, key_mask, k2, v2, config=config, constant_kv=constant_kv)
    return _last("_attention_kernel")


def gemm_case(m, n, k, config, *, geglu=False, w4=False) -> dict:
    """The skinny GEMM with one `flashrt_core.engine.gemm.CONFIGS`-style configuration (w4: on 4-bit weights in
    groups of 128, `kernels.w4`)."""
    from flashrt_core.kernels.w4 import quantize_w4

    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn((2 if geglu else 1) * n, k, generator=g).to(torch.bfloat16)
    if w4:
        w = quantize_w4(w)
    skinny_gemm.skinny_linear(x, w, geglu=geglu, **engine_gemm._kwargs(config))
    return _last("_skinny_gemm_kernel")


def norm_case(constant_mod: bool) -> dict:
    """The expert's gated residual + AdaRMS (50 rows of 1024), modulation vectors from a precomputed table."""
    g = torch.Generator().manual_seed(2)
    x, h = (torch.randn(1, 50, 1024, generator=g).to(torch.bfloat16) for _ in range(2))
    table = torch.randn(3, 1024, generator=g).to(torch.bfloat16)
    K.gated_residual_ada_rms_norm(x, h, table[2], table[0], table[1], constant_mod=constant_mod, backend="triton")
    return _last("_ada_rms_norm_kernel")


CASES = {
    # SigLIP: head dim 72, q / k / v strided views of the QKV output (head stride 72)
    "attention_siglip": lambda: attention_case((2, 256, 16, 72), 16, 256, (64, 64, 1, 4)),
    # Gemma prefix: 8 query heads over 1 kv head, head dim 256, padded keys
    "attention_prefix": lambda: attention_case((1, 560, 8, 256), 1, 560, (64, 64, 1, 4), mask=True, cache=True),
    # action expert: 50 queries over the cached prefix and their own keys, split keys merged in-kernel
    "attention_expert": lambda: attention_case((1, 50, 8, 256), 1, 560, (16, 128, 8, 4), second=50, mask=True,
                                               cache=True),
    # the same as the act stage launches it (its pick on the H200, the cached prefix read before the PDL wait)
    "attention_expert_constant_kv": lambda: attention_case((1, 50, 8, 256), 1, 560, (16, 128, 8, 8), second=50,
                                                           mask=True, cache=True, constant_kv=True),
    # expert QKV GEMM: K loop without and with its first two weight tiles requested before the PDL wait
    "gemm_qkv_loop": lambda: gemm_case(50, 2560, 1024, (32, 256, 1, 4, 3)),
    "gemm_qkv_preload2": lambda: gemm_case(50, 2560, 1024, (32, 256, 1, 4, 3, 2)),
    "gemm_up_preload2": lambda: gemm_case(50, 4096, 1024, (32, 128, 1, 4, 4, 2), geglu=True),
    # one BLOCK_K slice per program: the whole weight tile before the wait
    "gemm_o_one_step": lambda: gemm_case(50, 1024, 2048, (64, 512, 0, 8, 1)),
    # the expert's norms: modulation vectors read after / before the PDL wait
    "norm_mod_after_wait": lambda: norm_case(False),
    "norm_mod_before_wait": lambda: norm_case(True),
    # the one-stage attention candidates at the expert's shape (flashrt_core.engine.attention.CANDIDATES)
    "attention_expert_16x128_1stage": lambda: attention_case((1, 50, 8, 256), 1, 560, (16, 128, 8, 8, 1), second=50,
                                                             mask=True, cache=True),
    "attention_expert_32x128_1stage": lambda: attention_case((1, 50, 8, 256), 1, 560, (32, 128, 8, 8, 1), second=50,
                                                             mask=True, cache=True),
    # the expert's split/rotate kernel: positions and table rows after / before the PDL wait
    "rope_positions_after_wait": lambda: rope_case(False),
    "rope_positions_before_wait": lambda: rope_case(True),
}


def rope_case(constant_positions: bool) -> dict:
    """The expert's split/rotate kernel (50 tokens, 8 + 1 + 1 heads of 256) as the act stage calls it."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(1, 50, 10 * 256, generator=g).to(torch.bfloat16)
    cos, sin = K.rope_cos_sin(700, 256)
    positions = (530 + torch.arange(50))[None]
    k, v = (torch.empty(1, 1, 50, 256, dtype=torch.bfloat16) for _ in range(2))
    K.qkv_rope_cache(qkv, positions, cos, sin, k, v, 0, num_q_heads=8, num_kv_heads=1,
                     constant_positions=constant_positions, backend="triton")
    return _last("_qkv_rope_cache_kernel")


def report(names=None) -> dict:
    return {name: CASES[name]() for name in (names or CASES)}


# The action expert's GEMMs (M = 50 rows): (N, K, GeGLU)
EXPERT_GEMMS = {"qkv": (2560, 1024, False), "o": (1024, 2048, False), "gate_up": (4096, 1024, True),
                "down": (1024, 4096, False)}


def preload_resources() -> dict:
    """Registers / spills at each expert shape of every preloading GEMM candidate on bf16 weights and of every
    candidate on 4-bit weights (`flashrt_core.engine.gemm.W4_CONFIGS`): {"[w4 ]config shape": {...}}."""
    out = {}
    runs = [(c, False) for c in engine_gemm.CONFIGS if len(c) == 6 and c[5]] + [(c, True) for c in
                                                                                 engine_gemm.W4_CONFIGS]
    for config, w4 in runs:
        for shape, (n, k, geglu) in EXPERT_GEMMS.items():
            found = gemm_case(50, n, k, config, geglu=geglu, w4=w4)
            out[f"{'w4 ' if w4 else ''}{config} {shape}"] = {
                key: found[key] for key in ("regs", "stack_bytes", "shared_bytes")}
    return out


def precompile_check() -> dict:
    """`_common.precompile` over the preloading GEMM candidates at the expert's QKV shape (and one call that
    raises): how many distinct kernels Triton's cache holds afterwards, all finished compiles."""
    from flashrt_core.kernels import _common

    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 1024, generator=g).to(torch.bfloat16)
    w = torch.randn(2560, 1024, generator=g).to(torch.bfloat16)
    configs = [c for c in engine_gemm.CONFIGS if len(c) == 6 and c[5]]

    def broken():
        raise RuntimeError("a candidate that cannot be built")
    start = len(COMPILED)
    _common.precompile([lambda c=c: skinny_gemm.skinny_linear(x, w, **engine_gemm._kwargs(c)) for c in configs]
                       + [broken], workers=2)
    kernels = [k for name, k in COMPILED[start:] if name == "_skinny_gemm_kernel"]
    return {"configs": len(configs), "launches": len(kernels),
            "distinct_compiled": len({id(k.result()) for k in kernels}),
            "all_have_ptx": all("ptx" in k.result().asm for k in kernels),
            "compile_only_after": _common._COMPILE_ONLY.get()}


def engine_scan() -> dict:
    """Every kernel a W2-shaped pi0.5 decision (bf16; w4a16: 4-bit expert weights; on sm_100+ also fp8+mxfp4: the
    scaled dot, the prefix's fp8 GEMMs are cuBLAS's), a pi0 decision and a SmolVLA decision launch
    (full widths and head dims, one layer per tower, a small vocabulary; skinny GEMMs with CONFIGS[0]), each
    distinct compiled form once, with the PTX target it was compiled for: {kernel: [summaries]}."""
    import dataclasses

    from flashrt_bench import harness as bench
    from flashrt_core.models import pi0, pi05
    from flashrt_core.models.pi0.engine import Pi0Engine
    from flashrt_core.models.pi05.engine import Pi05Engine

    full = pi05.Pi05Config.full()
    out: dict[str, list] = {}
    runs = [("pi05", pi05.convert, Pi05Engine, "bf16"), ("pi05", pi05.convert, Pi05Engine, "w4a16"),
            ("pi0", pi0.convert, Pi0Engine, "bf16")]
    if TARGET.arch >= 100:  # (MXFP4 is dispatched to sm_100+ only: models.precision.DISPATCH)
        runs.insert(2, ("pi05", pi05.convert, Pi05Engine, "fp8+mxfp4"))
    for kind, convert, engine_class, precision in runs:
        config = dataclasses.replace(full.as_kind(kind), num_image_slots=2, tokenizer_max_length=48, vocab_size=512,
                                     vision=dataclasses.replace(full.vision, layers=1),
                                     vlm=dataclasses.replace(full.vlm, depth=1),
                                     expert=dataclasses.replace(full.expert, depth=1))
        engine = engine_class(convert(config, bench.random_state(config, 0, "cpu")), device="cpu",
                              dtype=torch.bfloat16, backend="triton", graphs=False, gemm="triton", tuning_cache=None,
                              precision=precision)
        inputs = bench.random_inputs(config, 0, "cpu")
        start = len(COMPILED)
        engine.sample_actions(*bench.decision_args(inputs))
        for name, kernel in COMPILED[start:]:
            ptx = kernel.asm["ptx"]
            summary = {**summarize(ptx), **resources(kernel), "target": re.search(r"\.target (\S+)", ptx).group(1)}
            if summary not in out.setdefault(name, []):
                out[name].append(summary)
    # SmolVLA's engine at full widths (SigLIP base/16 at 512 px, SmolLM2-360M's heads, the 0.75x expert), one vision
    # layer and two VLM / expert layers (one self-attention, one cross-attention expert layer), a small vocabulary
    from flashrt_core.models.smolvla import SmolVLAConfig, convert as smolvla_convert, expected_keys
    from flashrt_core.models.smolvla.engine import SmolVLAEngine

    sv = SmolVLAConfig.full_size()
    sv = dataclasses.replace(sv, vocab_size=512, num_image_slots=2, vision=dataclasses.replace(sv.vision, layers=1),
                             vlm=dataclasses.replace(sv.vlm, depth=2), expert=dataclasses.replace(sv.expert, depth=2))
    g = torch.Generator().manual_seed(5)
    state = {k: torch.randn(shape, generator=g) * 0.02 for k, shape in expected_keys(sv).items()}
    engine = SmolVLAEngine(smolvla_convert(sv, state), device="cpu", dtype=torch.bfloat16, backend="triton",
                           graphs=False, gemm="triton", tuning_cache=None)
    n = sv.tokenizer_max_length
    images = torch.rand(1, 2, 3, sv.image_size, sv.image_size, generator=g) * 2 - 1
    start = len(COMPILED)
    engine.sample_actions(images, torch.tensor([[True, False]]), torch.randint(0, 512, (1, n), generator=g),
                          torch.arange(n)[None] < 12, torch.randn(1, sv.max_state_dim, generator=g),
                          torch.randn(1, sv.chunk_size, sv.max_action_dim, generator=g))
    for name, kernel in COMPILED[start:]:
        ptx = kernel.asm["ptx"]
        summary = {**summarize(ptx), **resources(kernel), "target": re.search(r"\.target (\S+)", ptx).group(1)}
        if summary not in out.setdefault(name, []):
            out[name].append(summary)
    # the fp8 prefix's row quantization (on a CPU the engine takes its torch reference) at the widest input (the
    # attention output into o), and its norms and GeGLU writing e4m3 rows (the W2 prefix: 560 rows)
    from flashrt_core import kernels as K
    from flashrt_core.kernels import fp8

    start = len(COMPILED)
    fp8.quantize_rows(torch.randn(560, full.vlm.mlp, dtype=torch.bfloat16), backend="triton")
    x, norm = torch.randn(560, full.vlm.width, dtype=torch.bfloat16), torch.randn(full.vlm.width, dtype=torch.bfloat16)
    K.rms_norm(x, norm, fp8=True, backend="triton")
    K.add_rms_norm(x, x.clone(), norm, fp8=True, backend="triton")
    K.geglu(torch.randn(560, 2 * full.vlm.mlp, dtype=torch.bfloat16), fp8=True, backend="triton")
    for name, kernel in COMPILED[start:]:
        ptx = kernel.asm["ptx"]
        out.setdefault(name, []).append({**summarize(ptx), **resources(kernel),
                                         "target": re.search(r"\.target (\S+)", ptx).group(1)})
    return out


def mx4_mma() -> dict:
    """The tensor-core instructions of the skinny GEMM on MXFP4 weights (W4A8, `kernels.mx4`) at the expert's
    gate|up shape: {"target", "mma": [instructions]}."""
    from flashrt_core.kernels.mx4 import quantize_mx4

    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 1024, generator=g).to(torch.bfloat16)
    w = quantize_mx4(torch.randn(8192, 1024, generator=g), torch.bfloat16)
    skinny_gemm.skinny_linear(x, w, geglu=True, block_n=32, block_k=128, split_k=1)
    name, kernel = COMPILED[-1]
    ptx = kernel.asm["ptx"]
    return {"kernel": name, "target": re.search(r"\.target (\S+)", ptx).group(1),
            "mma": sorted(set(re.findall(r"(tcgen05\.mma\S*|wgmma\.mma_async\S*|mma\.sync\S*)", ptx)))}


if __name__ == "__main__":
    if sys.argv[1:] == ["--mx4"]:
        print(json.dumps(mx4_mma(), indent=1))
    elif sys.argv[1:] == ["--engine"]:
        print(json.dumps(engine_scan(), indent=1))
    elif sys.argv[1:] == ["--preload"]:
        print(json.dumps(preload_resources(), indent=1))
    elif sys.argv[1:] == ["--precompile"]:
        print(json.dumps(precompile_check(), indent=1))
    else:
        print(json.dumps(report(sys.argv[1:] or None), indent=1))
