"""The kernels' compiled form for sm_90 (H100 / H200), checked without a GPU (`ptx_testing.py` compiles them in
a process of its own): properties that decide their speed on the GPU but that no CPU parity test can see.
Counts are per thread of one program, from the PTX (ld.global.v4.b32 moves 16 bytes)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Triton is not imported here: this process may run other tests' kernels in the interpreter (TRITON_INTERPRET
# must be set before Triton's first import), the compiles happen in a subprocess.
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs Triton", allow_module_level=True)
HERE = Path(__file__).resolve().parent


def _report(*args) -> dict:
    """ptx_testing.py's JSON for these arguments, from a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HERE / "ptx_testing.py"), *args], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def ptx():
    return _report()


def _loads(ops: dict, width: str) -> int:
    return sum(n for op, n in ops.items() if op.startswith("ld.global") and op.endswith(width))


def test_siglip_attention_loads_its_head_dim_72_in_16_byte_pieces(ptx):
    """q / k / v are strided views with a head stride of 72 elements, which Triton cannot prove 16-byte
    aligned by itself: the kernel's alignment hint and compile-time head dim must turn its tile loads into
    vectors streamed through cp.async (before both, every element was its own 2-byte load)."""
    ops = ptx["attention_siglip"]["all"]
    assert _loads(ops, ".b16") == 0 and _loads(ops, ".v4.b32") > 0, ops
    assert ops.get("cp.async.cg.shared.global", 0) > 0, ops


@pytest.mark.parametrize("case", ["attention_prefix", "attention_expert"])
def test_attention_streams_its_key_tiles_through_cp_async(ptx, case):
    ops = ptx[case]["all"]
    assert ops.get("cp.async.cg.shared.global", 0) >= 32, ops
    assert _loads(ops, ".b16") <= 8, ops  # at most the key mask's bytes, two at a time
    assert not ptx[case]["before_wait"]  # nothing is read before the previous kernel has finished


def test_the_act_stages_attention_reads_its_cached_prefix_tile_before_the_pdl_wait(ptx):
    """constant_kv (the act stage): the first key tile of the cached prefix (128 keys x 256 dims of K and of V,
    64 KB each, 8 warps: 16 loads of 16 bytes per thread each) and its pad mask are requested before
    griddepcontrol.wait; the queries and the suffix keys after it. No spills."""
    found = ptx["attention_expert_constant_kv"]
    early = found["before_wait"]
    assert found["has_wait"] and early.get("ld.global.v4.b32", 0) >= 32, early
    assert all(op.startswith("ld.global") for op in early), early
    assert found["stack_bytes"] == 0, found


def test_constant_positions_are_read_before_the_rotate_kernels_pdl_wait(ptx):
    """The split/rotate kernel with constant_positions: its position and its cos / sin rows are requested
    before griddepcontrol.wait (the qkv row it rotates after it); without, nothing comes before the wait."""
    assert not ptx["rope_positions_after_wait"]["before_wait"]
    early = ptx["rope_positions_before_wait"]
    assert early["has_wait"] and sum(early["before_wait"].values()) >= 3, early["before_wait"]
    assert all(op.startswith("ld.global") for op in early["before_wait"]), early["before_wait"]


def test_gemm_preload_requests_its_first_weight_tiles_before_the_pdl_wait(ptx):
    """preload=2 with BLOCK_N 32, BLOCK_K 256, 4 warps: 32 rows x 512 weights x 2 bytes = 32 KB per program,
    16 loads of 16 bytes per thread, all issued before griddepcontrol.wait; the plain K loop issues none
    (its weights come after the wait, through cp.async). GeGLU (BLOCK_K 128): gate and up tiles, 32 KB too."""
    assert ptx["gemm_qkv_loop"]["has_wait"] and not ptx["gemm_qkv_loop"]["before_wait"]
    for case in ("gemm_qkv_preload2", "gemm_up_preload2"):
        assert ptx[case]["has_wait"]
        assert ptx[case]["before_wait"] == {"ld.global.v4.b32": 16}, (case, ptx[case])


def test_one_step_gemm_requests_its_whole_weight_tile_before_the_pdl_wait(ptx):
    """BLOCK_N 64 x BLOCK_K 512 x 2 bytes = 64 KB per program over 8 warps: 16 loads of 16 bytes per thread."""
    assert ptx["gemm_o_one_step"]["before_wait"] == {"ld.global.v4.b32": 16}, ptx["gemm_o_one_step"]


def test_norm_reads_constant_modulation_before_the_pdl_wait(ptx):
    """constant_mod: the gate, scale and shift rows (3 x 1024 bf16, 4 warps: 3 x 16-byte loads per thread) are
    requested before griddepcontrol.wait; without it nothing is."""
    assert ptx["norm_mod_after_wait"]["has_wait"] and not ptx["norm_mod_after_wait"]["before_wait"]
    assert ptx["norm_mod_before_wait"]["before_wait"] == {"ld.global.v4.b32": 3}, ptx["norm_mod_before_wait"]
    assert _loads(ptx["norm_mod_before_wait"]["all"], "") == _loads(ptx["norm_mod_after_wait"]["all"], "")


def test_one_stage_attention_candidates_halve_the_shared_memory_without_spills(ptx):
    """flashrt_core.engine.attention's one-stage forms of the one-key-tile configurations: two programs fit an SM's
    228 KB (the two-stage (16, 128, 8, 4) takes 140 KB), and no register spills (stack 0)."""
    two_stage = ptx["attention_expert"]["shared_bytes"]
    for case in ("attention_expert_16x128_1stage", "attention_expert_32x128_1stage"):
        r = ptx[case]
        assert 2 * r["shared_bytes"] <= 228 * 1024 < 2 * two_stage and r["stack_bytes"] == 0, (case, r)
    assert ptx["attention_expert"]["stack_bytes"] == 0  # W2's pick so far: no spills with the one key loop


def test_gemm_preload_and_4bit_candidates_do_not_spill_at_the_expert_shapes():
    found = _report("--preload")
    # every preloading candidate (8) and every 4-bit one (15) at the four expert shapes
    assert len(found) >= 4 * 8 + 4 * 15
    assert sum(case.startswith("w4 ") for case in found) >= 4 * 15
    assert not {case: r for case, r in found.items() if r["stack_bytes"]}


def test_every_kernel_of_a_w2_decision_compiles_for_sm_90_without_scalar_bf16_loads():
    """The whole decision at W2's widths and head dims (one layer per tower; SmolVLA's at its full widths too):
    every Triton kernel compiles for sm_90 with PDL, none moves bf16 data one element at a time (at most a key
    mask's bytes in pairs), and none spills registers with the launch choices the engine makes before any tuning."""
    kernels = _report("--engine")
    assert {"_layer_norm_kernel", "_attention_kernel", "_bias_gelu_kernel", "_rms_norm_kernel",
            "_qkv_rope_cache_kernel", "_skinny_gemm_kernel", "_ada_rms_norm_kernel",
            "_swiglu_kernel"} <= set(kernels)  # (the last: SmolVLA's SwiGLU)
    for name, forms in kernels.items():
        for form in forms:
            assert form["has_wait"], name  # launched with PDL: every kernel waits for the one before
            assert _loads(form["all"], ".b16") <= 8, (name, form)
            assert form["stack_bytes"] == 0, (name, form)  # no register spills (untuned launch choices)


def test_precompile_builds_every_candidate_without_running_any():
    """`_common.precompile` (the pickers compile all candidates in parallel threads before timing them): every
    candidate's launch became a finished compile (two of the ten QKV forms are the same kernel at K = 1024),
    a call that raises is left for its real launch to report, and compile-only mode ends with it."""
    r = _report("--precompile")
    assert r["launches"] == r["configs"] >= 8 and r["all_have_ptx"], r
    assert r["configs"] - 2 <= r["distinct_compiled"] <= r["configs"], r
    assert r["compile_only_after"] is False


# Targets past sm_90 that the engine must build for: sm_100a (B200 / GB200) and sm_110a (Jetson AGX Thor in
# CUDA 13's naming, sm_101 in CUDA 12.8 / 12.9, which the pinned Triton's ptxas does not know).
BLACKWELL = {100: "sm_100a", 110: "sm_110a"}


def _arch_report(arch: int, mode: str = "--engine") -> dict:
    """ptx_testing.py `mode` for `arch`; a skip naming the reason where this Triton / ptxas cannot build it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HERE / "ptx_testing.py"), mode, "--arch", str(arch)], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode and ("is not defined for option 'gpu-name'" in done.stderr
                            or "not supported" in done.stderr.lower()):
        pytest.skip(f"sm_{arch}: this Triton / ptxas cannot build it: {done.stderr.strip().splitlines()[-1][:300]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("arch", sorted(BLACKWELL))
def test_every_engine_kernel_compiles_for_blackwell_and_thor(arch):
    """Every kernel of a pi0.5 and a pi0 decision (bf16, PDL, one layer per tower at full widths) compiles for
    the target, to PTX of that target and a cubin, with no register spills: the same kernels as for sm_90."""
    kernels = _arch_report(arch)
    assert set(kernels) == set(_report("--engine"))
    for name, forms in kernels.items():
        for form in forms:
            assert form["target"] == BLACKWELL[arch], (name, form["target"])
            assert form["has_wait"], name
            assert form["stack_bytes"] == 0, (name, form)


@pytest.mark.parametrize("arch", sorted(BLACKWELL))
def test_mxfp4_gemm_takes_blackwells_block_scaled_mma(arch):
    """The skinny GEMM on MXFP4 weights with its activations in MX e4m3 (W4A8) compiles for Blackwell / Thor to
    the tensor cores' native block-scaled product (no widening to bf16 first), where the pinned Triton can
    build the target."""
    r = _arch_report(arch, "--mx4")
    assert r["kernel"] == "_skinny_gemm_kernel" and r["target"] == BLACKWELL[arch]
    assert r["mma"] and all("kind::mxf8f6f4.block_scale" in m for m in r["mma"]), r["mma"]
