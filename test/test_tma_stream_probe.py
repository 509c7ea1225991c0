"""The Gluon weight-stream probe (benchmarks/tma_stream_probe.py) without a GPU: its phases split into whole
TMA tiles, and its kernel compiles for sm_90 (H100 / H200) with what makes it the structure being probed: a
ring of STAGES shared-memory slots filled by TMA tensor copies (one per slot up front, one refill per
consumed tile), mbarrier waits, a grid-barrier atomic, and no register spills; its warp-specialized form
has a producer warp's copies, the consumers' mbarrier hand-backs and registers moved between the two. Whether it reads every byte
once is checked on the GPU, where the probe compares its sums with the weights' (Gluon kernels do not run in
Triton's interpreter)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs Triton", allow_module_level=True)
HERE = Path(__file__).resolve().parent


def _run(code: str) -> str:
    """Python code in a process of its own, without TRITON_INTERPRET (Gluon compiles, never interprets)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_phases_split_into_whole_tiles():
    out = _run("import sys; sys.path[:0] = ['benchmarks', '.']\n"
               "import json, tma_stream_probe as p\n"
               "b = p.phase_bounds(2)\n"
               "t = p.tile_bounds(b)\n"
               "try:\n    p.tile_bounds([0, p.TILE + 1024])\n    bad = 'accepted'\n"
               "except ValueError as e:\n    bad = str(e)\n"
               "print(json.dumps({'bounds': b, 'tiles': t, 'tile': p.TILE, 'bad': bad}))")
    got = json.loads(out)
    assert [x * got["tile"] for x in got["tiles"]] == got["bounds"]
    assert got["tiles"][-1] * got["tile"] * 2 == 2 * 34603008  # two layers of the expert's weights
    assert "multiple of" in got["bad"]


def test_the_stream_kernel_compiles_for_sm_90_as_a_tma_ring():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HERE / "ptx_testing.py"), "--tma-stream"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    ws = report.pop("ws")
    # the producer warp's one copy site, the consumers' hand-back, registers moved between the partitions
    assert ws["tensor_copies"] >= 1 and ws["mbarrier_arrives"] >= 1 and ws["register_reallocations"] >= 1, ws
    assert ws["stack_bytes"] == 0 and ws["shared_bytes"] >= 4 * 8192, ws
    for stages, r in report.items():
        s = int(stages)
        assert r["tensor_copies"] == s + 1, r  # the STAGES copies up front, one refill in the loop
        assert r["mbarrier_waits"] >= 1 and r["atomics"] >= 1, r
        assert r["stack_bytes"] == 0, r
        assert r["shared_bytes"] >= s * 8192, r  # the ring of 8 KB slots (+ its mbarriers)
