"""Precision per model part, as data: which weights an engine keeps in the model dtype and which in fewer bits.

A `Precision` names a format per part: `vision` (SigLIP + projector), `prefix` (the Gemma prefix) and `expert`
(the action expert). Presets:
  bf16    every part in the model dtype (bf16 on a GPU; the default)
  w4a16   the expert's GEMM weights in 4 bits (groups of 128 inputs, bf16 scales, `kernels.w4`), activations in
          the model dtype: the act stage streams a quarter of the weight bytes
  fp8     the Gemma prefix's GEMMs in fp8 e4m3 (`kernels.fp8`: weights per output channel, activations per token,
          scaled dynamically, by the norm or GeGLU kernel that writes them where there is one): the compute-bound
          observe stage on fp8 tensor cores (the expert stays bf16: no
          fp8 form of its 50-row GEMMs measured faster than bf16, docs/performance-history.md)
  fp8+w4a16  the fp8 prefix, the expert in 4 bits
  fp8+mxfp4  the fp8 prefix, the expert in OCP MXFP4 (`kernels.mx4`: e2m1 values, a power-of-two scale per 32
          inputs) with its activations in MX e4m3 (W4A8) through Triton's scaled dot: Blackwell's tensor cores
          (B200, Jetson AGX Thor) multiply it natively (block-scaled MMA); on a Hopper GPU Triton widens both
          operands, slower than bf16, so the dispatch table runs it on sm_100+ only. (NVFP4 proper, e4m3 scales
          per 16 inputs, is not built: the pinned Triton's interpreter reads such scales wrongly)
Quantized weights are made once when the engine is built (`quantize`): the fused engine keeps them packed (the
skinny GEMM dequantizes 4 bits in registers; fp8 runs cuBLAS's scaled GEMM); the reference engine multiplies
by the same weights dequantized (for fp8 without the activations' rounding to fp8, which the fused engine
adds). A quantized engine is checked at build against the unquantized reference on a
fixed input (`gate`) and refused with the numbers where it falls short of the preset's thresholds.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt_core.errors import PrecisionError
from flashrt_core.kernels.fp8 import quantize_fp8
from flashrt_core.kernels.mx4 import BLOCK as MX4_BLOCK, quantize_mx4
from flashrt_core.kernels.w4 import group_for, quantize_w4

PARTS = ("vision", "prefix", "expert")
FORMATS = {"vision": ("bf16",), "prefix": ("bf16", "fp8"), "expert": ("bf16", "w4a16", "mxfp4")}
PRESETS = {"bf16": {}, "fp8": {"prefix": "fp8"}, "w4a16": {"expert": "w4a16"},
           "fp8+w4a16": {"prefix": "fp8", "expert": "w4a16"}, "fp8+mxfp4": {"prefix": "fp8", "expert": "mxfp4"}}
# (cosine at least, relative L2 at most) of a decision's actions against the unquantized engine's, per format
# (a mix takes the loosest of its formats')
GATES = {"fp8": {"cosine": 0.998, "rel_l2": 0.05}, "w4a16": {"cosine": 0.995, "rel_l2": 0.1},
         "mxfp4": {"cosine": 0.995, "rel_l2": 0.1}}
_GEMMS = ("qkv_w", "o_w", "gate_up_w", "down_w")  # a Gemma layer's (the prefix's and the expert's)


@dataclass(frozen=True)
class Precision:
    vision: str = "bf16"
    prefix: str = "bf16"
    expert: str = "bf16"

    def __post_init__(self):
        for part in PARTS:
            if getattr(self, part) not in FORMATS[part]:
                raise ValueError(f"precision.{part}: one of {', '.join(FORMATS[part])}, got {getattr(self, part)!r}")

    @property
    def name(self) -> str:
        """The preset's name, or part=format pairs for a mix no preset names."""
        for name, parts in PRESETS.items():
            if self == Precision(**parts):
                return name
        return ",".join(f"{p}={getattr(self, p)}" for p in PARTS)

    @property
    def quantized(self) -> bool:
        return any(getattr(self, p) != "bf16" for p in PARTS)

    def gate(self) -> dict:
        """The default thresholds: the loosest of the quantized parts' formats ({} where nothing is quantized)."""
        formats = [getattr(self, p) for p in PARTS if getattr(self, p) != "bf16"]
        if not formats:
            return {}
        return {"cosine": min(GATES[f]["cosine"] for f in formats), "rel_l2": max(GATES[f]["rel_l2"] for f in formats)}


# Where each format runs (the hardware dispatch table): the kernel, and the least CUDA compute capability it
# needs on a GPU. On a CPU every format runs through the torch references (slow: tests, the tiny model).
DISPATCH = {
    "bf16": {"kernel": "cuBLAS + the skinny Triton GEMM (bf16)", "min_capability": (8, 0)},
    "fp8": {"kernel": "rows quantized by the Triton norm / GeGLU before each GEMM + cuBLAS scaled fp8 GEMM "
                      "(torch._scaled_mm, row-wise scales)",
            "min_capability": (8, 9)},
    "w4a16": {"kernel": "skinny Triton GEMM on 4-bit weights (dequantized in registers)",
              "min_capability": (8, 0)},
    # (on sm_90 Triton widens MXFP4 to bf16 in registers: measured slower than bf16 and than w4a16 on an H100,
    # docs/performance-history.md; Blackwell's tensor cores take it natively, not yet measured here)
    "mxfp4": {"kernel": "skinny Triton GEMM through tl.dot_scaled, activations in MX e4m3 (Blackwell's "
                        "block-scaled MMA)", "min_capability": (10, 0)},
}


_SCALED_MM: dict = {}  # device -> None (cuBLAS's row-wise scaled fp8 GEMM runs) or why not


def _scaled_mm_error(device) -> str | None:
    """Whether torch's row-wise scaled fp8 GEMM runs on this GPU (tried once on a 16 x 16 product: torch
    builds it for some GPUs only), None or the error."""
    key = str(device)
    if key not in _SCALED_MM:
        try:
            a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
            one = torch.ones(16, 1, device=device)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16)
            _SCALED_MM[key] = None
        except Exception as exc:  # (any failure means the format does not run here: the table says which)
            _SCALED_MM[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return _SCALED_MM[key]


def dispatch_table(device) -> list[dict]:
    """{format, kernel, runs, why} per format for `device` (what `flashrt doctor` prints): a format runs on a
    GPU of at least its compute capability where its kernel works (fp8: torch's scaled GEMM tried once)."""
    device = torch.device(device)
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    rows = []
    for fmt, entry in DISPATCH.items():
        if cap is None:
            runs, why = True, "CPU: the torch reference"
        else:
            runs = tuple(cap) >= entry["min_capability"]
            need = "sm_{}{}".format(*entry["min_capability"])
            why = f"sm_{cap[0]}{cap[1]} >= {need}" if runs else f"needs {need}, this GPU is sm_{cap[0]}{cap[1]}"
            if runs and fmt == "fp8" and _scaled_mm_error(device) is not None:
                runs, why = False, f"torch's scaled fp8 GEMM fails here ({_scaled_mm_error(device)})"
        rows.append({"format": fmt, "kernel": entry["kernel"], "runs": runs, "why": why})
    return rows


def for_device(precision: "Precision", device, dtype: torch.dtype = torch.bfloat16) -> tuple["Precision", list[str]]:
    """The precision that runs on `device` for a model in `dtype`: each part whose format this hardware lacks
    (or, for fp8 on a GPU, whose output dtype is not bf16: the row-wise scaled GEMM writes bf16) falls back to
    bf16, with a message naming the part, the format and why."""
    if not precision.quantized:  # (bf16 runs wherever the engine does: no probe of the other formats)
        return precision, []
    table = {r["format"]: r for r in dispatch_table(device)}
    changes, notes = {}, []
    for part in PARTS:
        fmt = getattr(precision, part)
        why = None if table[fmt]["runs"] else table[fmt]["why"]
        if why is None and fmt == "fp8" and torch.device(device).type == "cuda" and dtype != torch.bfloat16:
            why = f"needs a bfloat16 model on a GPU, this one is {str(dtype).replace('torch.', '')}"
        if why is not None:
            changes[part] = "bf16"
            notes.append(f"precision: {part} in {fmt} {why}: it runs in bf16")
    return (dataclasses.replace(precision, **changes) if changes else precision), notes


def parse_precision(value) -> Precision:
    """A preset name (`PRESETS`), a {part: format} mapping, a Precision, or None (bf16)."""
    if value is None or isinstance(value, Precision):
        return value or Precision()
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(f"precision: one of {', '.join(PRESETS)} (or a mapping of {', '.join(PARTS)}), "
                             f"got {value!r}")
        return Precision(**PRESETS[value])
    if isinstance(value, dict):
        unknown = set(value) - set(PARTS)
        if unknown:
            raise ValueError(f"precision: unknown parts {sorted(unknown)} (the parts: {', '.join(PARTS)})")
        return Precision(**value)
    raise ValueError(f"precision: a preset name or a mapping, got {type(value).__name__}")


def quantize(weights, precision: Precision, packed: bool):
    """A copy of an engine-layout weights dataclass (pi0.5's or pi0's) with the parts `precision` quantizes:
    the GEMM weights (q|k|v, o, gate|up, down) of the expert's layers as `kernels.w4.W4Weight` (w4a16) or
    `kernels.mx4.MX4Weight` (mxfp4), of the prefix's as `kernels.fp8.FP8Weight` (fp8); packed=True: so (the
    fused engine), False: dequantized back to the model dtype (the reference engine).
    A matrix whose inputs no 4-bit group size divides (mxfp4: not a multiple of 32) stays as it is.
    The input is not changed."""
    def layers(which, make):
        out = []
        for layer in getattr(weights, which):
            fields = {}
            for name in _GEMMS:
                q = make(getattr(layer, name))
                if q is not None:
                    fields[name] = q if packed else q.dequantize()
            out.append(dataclasses.replace(layer, **fields))
        return out

    def w4(w):
        group = group_for(w.shape[1])
        return None if group is None else quantize_w4(w, group)

    fields = {}
    if precision.expert == "w4a16":
        fields["expert_layers"] = layers("expert_layers", w4)
    elif precision.expert == "mxfp4":
        fields["expert_layers"] = layers("expert_layers",
                                         lambda w: None if w.shape[1] % MX4_BLOCK else quantize_mx4(w))
    if precision.prefix == "fp8":
        fields["vlm_layers"] = layers("vlm_layers", quantize_fp8)
    return dataclasses.replace(weights, **fields) if fields else weights


def fixed_inputs(config, device, seed: int = 1234) -> tuple:
    """A fixed observation and noise (images in [-1, 1], every camera present, a prompt of random tokens with
    a few padded, a state where the act stage reads one: `ACT_READS_STATE`) for the gate."""
    g = torch.Generator().manual_seed(seed)
    size, slots, length = config.vision.image_size, config.num_image_slots, config.tokenizer_max_length
    images = torch.rand(1, slots, 3, size, size, generator=g) * 2 - 1
    masks = torch.ones(1, slots, dtype=torch.bool)
    tokens = torch.randint(0, config.vocab_size, (1, length), generator=g)
    mask = torch.ones(1, length, dtype=torch.bool)
    mask[:, max(1, length - 3):] = False
    noise = torch.randn(1, config.chunk_size, config.action_dim, generator=g)
    obs = [t.to(device) for t in (images, masks, tokens, mask)]
    extra = [torch.randn(1, config.state_dim, generator=g).to(device)] if config.ACT_READS_STATE else []
    return obs, extra, noise.to(device)


def gate(engine, plain, config, precision: Precision, thresholds: dict | None = None) -> dict:
    """One decision of the quantized `engine` against `plain` (the unquantized reference engine) on a fixed
    input -> {"cosine", "rel_l2", "max_abs", thresholds}; PrecisionError with those numbers where the cosine is
    below or the relative L2 above the thresholds (default: the format's, `GATES`)."""
    limits = {**precision.gate(), **(thresholds or {})}
    device = engine.device if hasattr(engine, "device") else plain.weights.action_in_w.device
    obs, extra, noise = fixed_inputs(config, device)
    with torch.no_grad():
        got = engine.denoise(engine.encode_prefix(*obs), *extra, noise).float().flatten()
        want = plain.denoise(plain.encode_prefix(*obs), *extra, noise).float().flatten()
    cos = F.cosine_similarity(got, want, dim=0).item()
    rel = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    report = {"precision": precision.name, "cosine": cos, "rel_l2": rel, "max_abs": (got - want).abs().max().item(),
              "thresholds": limits}
    if not (cos >= limits.get("cosine", -1.0) and rel <= limits.get("rel_l2", float("inf"))):
        raise PrecisionError(f"precision {precision.name} refused: against the unquantized model on a fixed input, "
                             f"cosine {cos:.5f} (at least {limits.get('cosine')}), relative L2 {rel:.3g} (at most "
                             f"{limits.get('rel_l2')}); use precision bf16, or loosen the gate "
                             "(model.options.precision_gate, make_engine(..., gate=))")
    return report


def build_engine(module, reference, weights, precision=None, thresholds: dict | None = None):
    """`module.make_engine(weights, precision)` (the fused or the reference engine module) in the precision this
    device runs (`for_device`), checked by `gate` against `reference.make_engine(weights)` where it quantizes
    anything. The engine's `precision_report`: {"precision": the name that runs} and the gate's numbers, with
    "asked" and "fallbacks" where a part fell back."""
    asked = parse_precision(precision)
    precision, fallbacks = for_device(asked, weights.action_in_w.device, weights.action_in_w.dtype)
    for note in fallbacks:
        warnings.warn(note, stacklevel=3)
    engine = module.make_engine(weights, precision)
    report = {"precision": precision.name}
    if precision.quantized:
        report = gate(engine, reference.make_engine(weights), weights.config, precision, thresholds)
    if fallbacks:
        report.update(asked=asked.name, fallbacks=fallbacks)
    engine.precision_report = report
    return engine
