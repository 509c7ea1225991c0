"""Parity- and latency-gated acceleration of unmodified torch modules.

    from flashrt_core.adopt import accelerate, detach
    model, report = accelerate(model, example_inputs)   # in place; print(report); report.to_json()
    detach(model)                                        # the original modules back, bit-exact

Known submodules (RMSNorm in plain and Gemma (1 + w) form, AdaRMS, LayerNorm, GELU, gated and plain MLPs,
self-attention with q/k/v/o projections, linears that read one input) are recognised by structure and by
behaviour on random inputs, swapped for fused forms (the project's Triton kernels where they run, fused torch
otherwise), and kept only if they pass parity and a paired A/B timing, both per unit and end to end (a kept
set whose whole model is not faster is cut to the best-measured subset that is, or reverted).
"""
from flashrt_core.adopt.api import AdoptError, accelerate, detach
from flashrt_core.adopt.gates import DefaultTimer, GraphTimer, TimedCall
from flashrt_core.adopt.kinds import KINDS, NotRecognised, Plan, Replacement
from flashrt_core.adopt.report import AdoptReport, EndToEnd, UnitReport

__all__ = [
    "accelerate", "detach", "AdoptError", "AdoptReport", "UnitReport", "EndToEnd", "Replacement", "Plan",
    "NotRecognised", "KINDS", "DefaultTimer", "GraphTimer", "TimedCall",
]
