"""Host time of Pi05Engine.set_observation on CUDA: the current form (two multi-tensor calls over cached
views) against the seven slicings and copies it replaced (91ad3c5), interleaved, same engine and inputs
(the tiny built-in model; 2 of its 3 camera slots, a full prompt). The host time is part of every decision:
the decision graph's launch waits for it.

    python benchmarks/set_observation_host.py [--json benchmarks/results/set_observation_host_h200.json]
"""
import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_result  # noqa: E402

from flashrt_core.models import pi05  # noqa: E402
from flashrt_core.models.pi05.engine import Pi05Engine  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--json", default="benchmarks/results/set_observation_host.json")
p.add_argument("--iters", type=int, default=200)
a = p.parse_args()
if not torch.cuda.is_available():
    sys.exit("set_observation_host: needs a CUDA GPU")

config, state = pi05.build_tiny(0)
e = Pi05Engine(pi05.convert(config, state), device="cuda", dtype=torch.bfloat16)
c = config
size, n = c.vision.image_size, c.tokenizer_max_length
images = torch.rand(1, 2, 3, size, size, device="cuda") * 2 - 1
masks = torch.ones(1, 2, dtype=torch.bool, device="cuda")
tokens = torch.randint(1, c.vocab_size, (1, n), device="cuda")
lm = torch.ones(1, n, dtype=torch.bool, device="cuda")

def old():  # 91ad3c5's _write_observation, on the same buffers
    b, s = images.shape[:2]; k = tokens.shape[1]; e._resize(b); buf = e.buffers
    buf.images[:, :s].copy_(images); buf.image_masks[:, :s].copy_(masks); buf.image_masks[:, s:].fill_(False)
    buf.lang_tokens[:, :k].copy_(tokens); buf.lang_tokens[:, k:].zero_(); buf.lang_mask[:, :k].copy_(lm)
    buf.lang_mask[:, k:].fill_(False)

def new():
    e.set_observation(images, masks, tokens, lm)

res = {"old": [], "new": []}
for _ in range(a.iters):
    for name, f in (("old", old), ("new", new)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        res[name].append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
out = {name: {"p50_us": statistics.median(v[5:]), "min_us": min(v)} for name, v in res.items()}
print(f"{'set_observation host time':40} {'p50 us':>8} {'min us':>8}")
for name, label in (("old", "seven slicings and copies (91ad3c5)"), ("new", "two multi-tensor calls")):
    print(f"{label:40} {out[name]['p50_us']:8.1f} {out[name]['min_us']:8.1f}")
write_result(a.json, workload={"model": "pi05 tiny built-in", "slots": "2 of 3", "prompt": "full",
                               "iters": a.iters, "timing": "perf_counter around the call, synchronized"},
             results=out)
print(f"wrote {a.json}")
