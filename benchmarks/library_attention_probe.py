"""Would a library attention kernel beat the engine's own at pi0.5's three W2 shapes? (issue 3, H200)

The engine runs `kernels.flash_attention` everywhere (tuned per shape, `engine_attention`). Its measured
cost at W2 on the H200 (2026-12-04): SigLIP 8.4 us per call (x27), the prefix 18.6 us (x17), the expert
10-13 us (x180 per act). This times, per call in a CUDA graph of --reps calls (median of --iters replays),
the engine's kernel (its heuristic and its tuned pick) against the torch library routes at the same shapes:
  * siglip: q [2, 256, 16, 72], no mask (so every route computes the same thing);
  * prefix: q [1, 560, 8, 256] over one K/V head of 560 keys, 20 of them padding (the pad mask);
  * expert: q [1, 50, 8, 256] over the 560 cached keys (same mask) + its own 50 keys.
Library routes: SDPA flash / efficient / cuDNN (masked where the shape has a mask; K/V expanded to the query
heads where the route has no GQA), and FlashAttention-2's variable-length entry
(`aten._flash_attention_forward` with `seqused_k`, GQA native): it takes a device count of valid keys, so a
CUDA graph could keep it across prompts if the valid keys were stored first (a compacted cache); its rows
here are timed on such a layout, so they show what that redesign could gain, not a drop-in.
Each row reports its relative L2 error against the fp32 reference of its own layout.

    python benchmarks/library_attention_probe.py [--json benchmarks/results/library_attention_probe_h200.json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402
from attention_breakdown import graph_us  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashrt_core.kernels.reference import attention_ref  # noqa: E402

# The engine's tuned picks at W2 on the H200 (results/pi05_w2.json attention_choices, 5dfb0f8), and a few
# key-split forms for the prefix that the engine does not offer.
PICKS = {"siglip": [(64, 64, 1, 4)],
         "prefix": [(64, 64, 1, 4), (64, 64, 2, 4), (64, 32, 2, 8), (64, 64, 2, 8), (32, 64, 2, 4)],
         "expert": [(16, 128, 8, 8)]}


def shapes(dev, dt, g):
    """name -> (q, k, v, key_mask or None, k2, v2): the engine's layouts (q [B, T, H, D], k/v [B, Hkv, S, D])."""
    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dt)

    mask = torch.ones(1, 560, dtype=torch.bool, device=dev)
    mask[:, 540:] = False
    return {"siglip": (rnd(2, 256, 16, 72), rnd(2, 16, 256, 72), rnd(2, 16, 256, 72), None, None, None),
            "prefix": (rnd(1, 560, 8, 256), rnd(1, 1, 560, 256), rnd(1, 1, 560, 256), mask, None, None),
            "expert": (rnd(1, 50, 8, 256), rnd(1, 1, 560, 256), rnd(1, 1, 560, 256), mask,
                       rnd(1, 1, 50, 256), rnd(1, 1, 50, 256))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="benchmarks/results/library_attention_probe.json")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--iters", type=int, default=15)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("library_attention_probe: needs a CUDA GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashrt_core.kernels.flash_attention import attention

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []

    def record(shape, name, fn, ref, pdl_too=True):
        try:
            out = fn()
            err = float((out.float() - ref).norm() / ref.norm())
            row = {"shape": shape, "name": name, "us": graph_us(fn, True, a.reps, a.iters), "rel_l2": err}
            if pdl_too:
                row["no_pdl_us"] = graph_us(fn, False, a.reps, a.iters)
        except Exception as exc:  # noqa: BLE001 - a route this GPU or build rejects is a result too
            torch.cuda.synchronize()
            row = {"shape": shape, "name": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)

    g = torch.Generator(device=dev).manual_seed(0)
    for shape, (q, k, v, mask, k2, v2) in shapes(dev, dt, g).items():
        ref = attention_ref(q.float(), k.float(), v.float(), mask, None if k2 is None else k2.float(),
                            None if v2 is None else v2.float())
        for config in [None, *PICKS[shape]]:
            record(shape, f"engine kernel {config or 'heuristic'}",
                   lambda c=config: attention(q, k, v, mask, k2, v2, config=c), ref)
        # SDPA over [B, H, S, D] views; keys concatenated where there is a second set; K/V expanded to the heads
        h = q.shape[2]
        kc, vc = (k, v) if k2 is None else (torch.cat([k, k2], 2), torch.cat([v, v2], 2))
        keep = None
        if mask is not None:
            keep = mask if k2 is None else torch.cat([mask, torch.ones(1, k2.shape[2], dtype=torch.bool,
                                                                        device=dev)], 1)
            keep = keep[:, None, None, :].expand(q.shape[0], h, q.shape[1], kc.shape[2])
        ke, ve = kc.expand(-1, h, -1, -1), vc.expand(-1, h, -1, -1)
        qt = q.transpose(1, 2)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            for masked in ((True, False) if keep is not None else (False,)):
                def sdpa(backend=backend, masked=masked):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(qt, ke, ve, attn_mask=keep if masked else None
                                                              ).transpose(1, 2)
                tag = "masked" if masked else ("unmasked" if keep is None else "unmasked (not the same result)")
                record(shape, f"sdpa {backend.name} {tag}", sdpa,
                       ref if masked or keep is None else attention_ref(q.float(), kc.float(), vc.float(), None),
                       False)
        # FlashAttention-2 varlen: valid keys first (the pad keys dropped, the second set right after them),
        # their count on the device (seqused_k); K/V [S, Hkv, D] with GQA
        valid = kc[0, :, keep[0, 0, 0]] if keep is not None else kc[0]
        valid_v = vc[0, :, keep[0, 0, 0]] if keep is not None else vc[0]
        n = valid.shape[1]
        kbuf = torch.zeros(q.shape[0], kc.shape[2], k.shape[1], q.shape[3], device=dev, dtype=dt)
        vbuf = torch.zeros_like(kbuf)
        kbuf[0, :n], vbuf[0, :n] = valid.transpose(0, 1), valid_v.transpose(0, 1)
        if q.shape[0] > 1:  # siglip: every batch entry has all its keys
            kbuf, vbuf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            n = kbuf.shape[1]
        b, t, s = q.shape[0], q.shape[1], kbuf.shape[1]
        cu_q = torch.arange(0, (b + 1) * t, t, device=dev, dtype=torch.int32)
        cu_k = torch.arange(0, (b + 1) * s, s, device=dev, dtype=torch.int32)
        used = torch.full((b,), n, device=dev, dtype=torch.int32)
        ref_c = attention_ref(q.float(), kbuf[:, :n].transpose(1, 2).float(), vbuf[:, :n].transpose(1, 2).float(),
                              None)

        def fa2():
            out = torch.ops.aten._flash_attention_forward(
                q.reshape(b * t, h, -1), kbuf.reshape(b * s, k.shape[1], -1), vbuf.reshape(b * s, k.shape[1], -1),
                cu_q, cu_k, t, s, 0.0, False, False, seqused_k=used)[0]
            return out.view(q.shape)
        record(shape, "fa2 varlen seqused_k, valid keys first", fa2, ref_c, False)

    print(f"\n{'shape':8} {'name':62} {'PDL us':>8} {'no PDL':>8} {'rel L2':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:8} {r['name'][:62]:62} {r['error'][:60]}")
        else:
            print(f"{r['shape']:8} {r['name'][:62]:62} {r['us']:8.2f} {r.get('no_pdl_us', float('nan')):8.2f} "
                  f"{r['rel_l2']:9.2e}")
    write_result(a.json, workload={"what": "pi05 W2 attention shapes: engine kernel vs library routes",
                                   "dtype": "bfloat16", "reps": a.reps, "iters": a.iters},
                 results={"rows": rows, "torch": torch.__version__})
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
