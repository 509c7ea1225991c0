"""May a captured graph's edge into a cuBLAS GEMM be made programmatic (PDL)? (issue 3, GPU round)

The observe stage's ~400 launches leave ~0.4 ms of gaps (results/profile_pi05_w2*.json): its cuBLAS GEMMs
are launched without PDL, so each waits for the kernel before it to finish before it even starts. After
capture, a graph's edges can be retyped as programmatic (driver API: cuGraphRemoveDependencies_v2 /
cuGraphAddDependencies_v2). That is only correct if the cuBLAS kernel itself waits for its producer
(griddepcontrol.wait) before reading its input. This probe checks it with a producer that releases its
dependents at once and writes its output late (a few us of arithmetic first): a chain of `--chain`
(producer -> GEMM) pairs, captured, one graph with the default edges and one with the edges into the GEMMs
made programmatic (from the producer's programmatic port, and from its launch-order port); each replayed 20
times against the default graph's output, and both timed. Prints a table, writes JSON.

    python benchmarks/cublas_pdl_probe.py [--json benchmarks/results/cublas_pdl_probe_h200.json]
"""
import argparse
import ctypes
import pathlib
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_core.bench import time_cuda  # noqa: E402

cu = None  # the CUDA driver library, loaded by main()
P = ctypes.c_void_p


class Edge(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", P), ("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint),
                ("params", P), ("extra", P), ("kern", P), ("ctx", P)]


def ok(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def kernel_name(node):
    p = KParams()
    ok(cu.cuGraphKernelNodeGetParams_v2(P(node), ctypes.byref(p)), "params")
    name = ctypes.c_char_p()
    if p.func:
        ok(cu.cuFuncGetName(ctypes.byref(name), P(p.func)), "cuFuncGetName")
    elif p.kern:
        ok(cu.cuKernelGetName(ctypes.byref(name), P(p.kern)), "cuKernelGetName")
    return name.value.decode() if name.value else "?"


def edges(graph):
    n = ctypes.c_size_t(0)
    ok(cu.cuGraphGetEdges_v2(P(graph), None, None, None, ctypes.byref(n)), "edges count")
    fr, to, data = (P * n.value)(), (P * n.value)(), (Edge * n.value)()
    ok(cu.cuGraphGetEdges_v2(P(graph), fr, to, data, ctypes.byref(n)), "edges")
    return [(fr[i], to[i], data[i]) for i in range(n.value)]


def node_type(node):
    t = ctypes.c_int()
    ok(cu.cuGraphNodeGetType(P(node), ctypes.byref(t)), "type")
    return t.value


def make_programmatic(graph, want, port):
    """Every default edge kernel -> kernel whose downstream name matches want() becomes programmatic."""
    changed = 0
    for f, t, d in edges(graph):
        if d.type != 0 or node_type(f) != 0 or node_type(t) != 0 or not want(kernel_name(t)):
            continue
        old = Edge()
        ok(cu.cuGraphRemoveDependencies_v2(P(graph), (P * 1)(f), (P * 1)(t), (Edge * 1)(old), 1), "remove")
        new = Edge(from_port=port, to_port=0, type=1)
        ok(cu.cuGraphAddDependencies_v2(P(graph), (P * 1)(f), (P * 1)(t), (Edge * 1)(new), 1), "add")
        changed += 1
    return changed


@triton.jit
def late_writer(X, Y, N, SPIN: tl.constexpr, BLOCK: tl.constexpr):
    gdc_launch_dependents()  # dependents may launch now
    gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
    acc = x
    for _ in range(SPIN):  # a few us of dependent math before the write
        acc = acc * 0.999999 + 1e-7
    tl.store(Y + offs, (acc - x * 0.0).to(Y.dtype.element_ty), mask=offs < N)


def build(x, a, b, out, spin, chain):
    def body():
        src = x
        for i in range(chain):
            late_writer[(triton.cdiv(a.numel(), 1024),)](src, a, a.numel(), SPIN=spin, BLOCK=1024, num_warps=4,
                                                         launch_pdl=True)
            torch.mm(a, b, out=out[i])
            src = out[i]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        body()
    return g


def timed(g) -> float:
    """us per replay of graph g: p50 of `flashrt_core.bench.time_cuda`."""
    return time_cuda(g.replay, warmup=5, iters=45)["p50_ms"] * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/cublas_pdl_probe.json")
    p.add_argument("--chain", type=int, default=8)
    p.add_argument("--spin", type=int, default=2000, help="the producer's arithmetic steps before it writes")
    a_ = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cublas_pdl_probe: needs a CUDA GPU")
    global cu
    cu = ctypes.CDLL("libcuda.so.1")
    torch.manual_seed(0)
    rows = []
    for m, k in ((560, 2048), (512, 1152)):  # the prefix's and SigLIP's row counts and widths
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        a = torch.empty_like(x)
        b = torch.randn(k, k, device="cuda", dtype=torch.bfloat16) * 0.02
        out = torch.empty(a_.chain, m, k, device="cuda", dtype=torch.bfloat16)
        base = build(x, a, b, out, a_.spin, a_.chain)
        gemms = sorted({kernel_name(t) for f, t, d in edges(base.raw_cuda_graph()) if node_type(t) == 0} -
                       {"late_writer"})
        base.instantiate()
        base.replay()
        torch.cuda.synchronize()
        want = out.clone()
        for port, label in ((1, "programmatic"), (2, "launch-order")):
            g = build(x, a, b, out, a_.spin, a_.chain)
            changed = make_programmatic(g.raw_cuda_graph(), lambda nm: nm != "late_writer", port)
            g.instantiate()
            wrong = 0
            for _ in range(20):
                out.zero_()
                a.zero_()
                g.replay()
                torch.cuda.synchronize()
                wrong += int(not torch.equal(out, want))
            rows.append({"m": m, "k": k, "gemm_kernels": gemms, "port": label, "edges_changed": changed,
                         "wrong_replays": wrong, "replays": 20, "default_us": timed(base), "programmatic_us": timed(g)})
    print(f"{'GEMM [m x k x k]':18} {'edge from port':15} {'edges':>5} {'wrong':>7} {'default us':>10} "
          f"{'programmatic us':>15}  cuBLAS kernel")
    for r in rows:
        print(f"{r['m']}x{r['k']}x{r['k']:<8} {r['port']:15} {r['edges_changed']:5d} {r['wrong_replays']:4d}/20 "
              f"{r['default_us']:10.1f} {r['programmatic_us']:15.1f}  {', '.join(r['gemm_kernels'])}")
    write_result(a_.json, workload={"chain": a_.chain, "spin": a_.spin, "dtype": "bfloat16",
                                    "torch": torch.__version__}, results={"rows": rows})
    print(f"wrote {a_.json}")


if __name__ == "__main__":
    main()
