"""Where the action expert's attention spends its time, on CUDA (issue 3: ~13 us per call on the H200 for
50 queries x 8 heads over ~610 keys of head dim 256, where its bytes and FLOPs need ~2 us).

Everything at the W2 expert shape (cached prefix 2 x 256 image + 48 prompt tokens, 20 of them padding, then
the 50 action tokens' own keys), timed as a CUDA graph of --reps calls (per call, median of --iters replays),
with and without programmatic dependent launch:
  * the shipped kernel (`kernels.flash_attention`) with its heuristic and each engine tuning candidate;
  * ablations of the shipped kernel, built from its source at run time (nothing of them ships): mode 1 no
    merge of the key splits (partials and tickets only), 2 no tickets either, 3 no key loop (q load,
    partials, merge), 4 q in and out only;
  * the splits merged by a second kernel (config[5] = merge rows per program) instead of in the kernel;
  * torch SDPA backends over the concatenated keys (flash / efficient / cuDNN / math; masked and not);
  * an act-like chain per layer: the split/rotate kernel, then attention over that layer's prefix K/V (18
    layers), optionally with a 36 MB copy between layers standing in for the GEMMs' weight stream (which
    evicts the prefix K/V from L2, as in a real decision).
Each row that computes attention reports its relative L2 error against the fp32 reference.

    python benchmarks/attention_breakdown.py [--json benchmarks/results/attention_breakdown_h200.json]
                                             [--groups "shipped,chain x18"]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels.reference import attention_ref  # noqa: E402

# Source edits that turn the shipped kernel into the ablation variants (each must match exactly once).
PATCHES = [
    ("PDL: tl.constexpr):\n    \"\"\"ALIGN: every",
     "PDL: tl.constexpr, MODE: tl.constexpr):\n    \"\"\"ALIGN: every"),
    ("    acc, m_i, l_i = _attend(acc, m_i, l_i, q, K, V, k_base",
     "    if MODE < 3:\n      acc, m_i, l_i = _attend(acc, m_i, l_i, q, K, V, k_base"),
    ("    if NSPLIT > 1:\n", "    if NSPLIT > 1 and MODE != 4:\n"),
    ("        if not MERGE_APART:\n            tile = pid_m * tl.num_programs(1) + bh\n            if last_of_split",
     "        if MODE == 1:\n            if last_of_split(C, pid_m * tl.num_programs(1) + bh, NSPLIT):\n"
     "                reset_ticket(C, pid_m * tl.num_programs(1) + bh)\n"
     "        elif not MERGE_APART and MODE != 2:\n            tile = pid_m * tl.num_programs(1) + bh\n"
     "            if last_of_split"),
    ("num_warps=warps, num_stages=stages, **pdl_launch(q.device))",
     "num_warps=warps, num_stages=stages, MODE=mode, **pdl_launch(q.device))"),
    ("out=None, config=None, rope=None):", "out=None, config=None, rope=None, mode=0):"),
]


GROUPS = ["shipped", "ablation", "two kernels", "sdpa", "chain x18"]


def variant_module(directory: pathlib.Path):
    """The shipped attention kernel with the ablation switch (MODE), as a module."""
    src = (REPO / "flashrt_core" / "kernels" / "flash_attention.py").read_text()
    for old, new in PATCHES:
        if src.count(old) != 1:
            raise RuntimeError(f"flash_attention.py changed: update PATCHES (anchor {old[:50]!r} found "
                               f"{src.count(old)} times)")
        src = src.replace(old, new)
    path = directory / "_attention_variants.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("_attention_variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph_us(fn, pdl: bool, reps: int, iters: int) -> float:
    """us per call: `reps` calls captured in one CUDA graph (launched with or without PDL), median of replays."""
    from flashrt_core.bench import graph_ms

    with K.pdl_scope(pdl):
        return graph_ms(lambda _: fn(), [None] * reps, rounds=iters) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/attention_breakdown.json")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated subset of {', '.join(GROUPS)}")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("attention_breakdown: needs a CUDA GPU")
    from flashrt_core.kernels.flash_attention import attention
    from flashrt_core.models.pi05.engine_attention import CANDIDATES

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dt)

    s, t, h, d, layers = 560, 50, 8, 256, 18
    q, k, v, k2, v2 = rnd(1, t, h, d), rnd(1, 1, s, d), rnd(1, 1, s, d), rnd(1, 1, t, d), rnd(1, 1, t, d)
    mask = torch.ones(1, s, dtype=torch.bool, device=dev)
    mask[:, s - 20:] = False
    ref = attention_ref(q.float(), k.float(), v.float(), mask, k2.float(), v2.float())
    rows = []

    groups = {g.strip() for g in a.groups.split(",")}
    if groups - set(GROUPS):
        sys.exit(f"attention_breakdown: unknown groups {sorted(groups - set(GROUPS))}; known: {GROUPS}")

    def record(group, name, fn, check=True):
        if group not in groups:
            return
        try:
            err = None
            if check:
                out = fn()
                err = float((out.float() - ref).norm() / ref.norm())
            row = {"group": group, "name": name, "pdl_us": graph_us(fn, True, a.reps, a.iters),
                   "no_pdl_us": graph_us(fn, False, a.reps, a.iters), "rel_l2": err}
        except Exception as exc:  # noqa: BLE001 - a launch this GPU rejects is a result too
            torch.cuda.synchronize()
            row = {"group": group, "name": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        var = variant_module(pathlib.Path(tmp))
        for config in [None, *CANDIDATES]:
            record("shipped", f"config {config}", lambda c=config: attention(q, k, v, mask, k2, v2, config=c))
        for config in [None, (16, 64, 1, 4), (16, 64, 16, 4), (64, 64, 8, 4)]:
            for mode in (1, 2, 3, 4):
                record("ablation", f"config {config} mode {mode}",
                       lambda c=config, m=mode: var.attention(q, k, v, mask, k2, v2, config=c, mode=m), False)
        record("ablation", "no key mask", lambda: attention(q, k, v, None, k2, v2), False)
        record("ablation", "no second key set", lambda: attention(q, k, v, mask), False)
        for config in [(16, 32, 8, 8), (16, 32, 8, 4), (32, 64, 4, 4), (16, 64, 16, 4), (64, 64, 8, 4),
                       (64, 32, 16, 4), (64, 64, 4, 4)]:
            for block_r in (4, 8, 16):
                merged = (*config, 2, block_r)
                record("two kernels", f"config {merged}",
                       lambda c=merged: attention(q, k, v, mask, k2, v2, config=c))

        from torch.nn.attention import SDPBackend, sdpa_kernel
        kc, vc = torch.cat([k, k2], 2), torch.cat([v, v2], 2)
        keep = torch.cat([mask, torch.ones(1, t, dtype=torch.bool, device=dev)], 1)[:, None, None, :]
        qt = q.transpose(1, 2)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH):
            for masked in (True, False):
                def sdpa(backend=backend, masked=masked):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(
                            qt, kc.expand(1, h, s + t, d), vc.expand(1, h, s + t, d),
                            attn_mask=keep.expand(1, h, t, s + t) if masked else None).transpose(1, 2)
                record("sdpa", f"{backend.name} {'masked' if masked else 'unmasked (not the same result)'}",
                       sdpa, masked)

        kl, vl = [rnd(1, 1, s, d) for _ in range(layers)], [rnd(1, 1, s, d) for _ in range(layers)]
        qkv = rnd(1, t, (h + 2) * d)
        positions = torch.arange(s, s + t, device=dev)[None]
        cos, sin = torch.randn(1024, d // 2, device=dev), torch.randn(1024, d // 2, device=dev)
        big = torch.empty(36 * 2 ** 20 // 2, device=dev, dtype=dt)
        big2 = torch.empty_like(big)

        def chain(config, copy, attend=True):
            for i in range(layers):
                qi = K.qkv_rope_cache(qkv, positions, cos, sin, k2, v2, 0, num_q_heads=h, num_kv_heads=1)
                if attend:
                    attention(qi, kl[i], vl[i], mask, k2, v2, config=config)
                if copy:
                    big2.copy_(big)

        for copy in (False, True):
            tag = "with a 36 MB copy per layer" if copy else "L2-warm"
            record("chain x18", f"rotate only, {tag}", lambda cp=copy: chain(None, cp, False), False)
            for config in [None, (16, 128, 8, 8), (16, 64, 16, 4), (64, 32, 16, 4, 2, 4), (64, 64, 8, 4, 2, 4),
                           (16, 64, 16, 4, 2, 4)]:
                record("chain x18", f"rotate + attention config {config}, {tag}",
                       lambda c=config, cp=copy: chain(c, cp), False)

    print(f"\n{'group':12} {'name':64} {'PDL us':>8} {'no PDL':>8} {'rel L2':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['group']:12} {r['name'][:64]:64} {r['error'][:40]}")
        else:
            err = "" if r["rel_l2"] is None else f"{r['rel_l2']:.2e}"
            print(f"{r['group']:12} {r['name'][:64]:64} {r['pdl_us']:8.2f} {r['no_pdl_us']:8.2f} {err:>9}")
    write_result(a.json, workload={"shape": "pi05 expert attention, W2", "q": [1, t, h, d], "prefix_keys": s,
                                   "padded_prefix_keys": 20, "suffix_keys": t, "dtype": "bfloat16",
                                   "reps": a.reps, "iters": a.iters, "groups": sorted(groups)},
                 results={"rows": rows})
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
