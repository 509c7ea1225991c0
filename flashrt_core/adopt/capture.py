"""One instrumented run of the example inputs: which submodules are called, with what, in which order.

Forward pre-hooks record a detached copy of the arguments of every interesting submodule (at most one call per
distinct signature, a few signatures per module, so memory stays bounded on a real policy). Linear layers also
record the identity of their input, which is how consecutive linears that read the same tensor (q/k/v, gate/up)
are found by behaviour rather than by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from flashrt_core.adopt.signature import call_signature, describe

MAX_SIGNATURES_PER_MODULE = 4


@dataclass
class CallRecord:
    args: tuple
    kwargs: dict
    signature: tuple
    output_form: object = None  # describe() of the output: tells e.g. a tensor from a (tensor, None) tuple


@dataclass
class Capture:
    calls: dict[str, list[CallRecord]] = field(default_factory=dict)  # qualified name -> distinct calls
    all_signatures: dict[str, set] = field(default_factory=dict)  # every signature seen, not only recorded
    linear_runs: list[tuple[str, ...]] = field(default_factory=list)  # consecutive linears on one input
    call_counts: dict[str, int] = field(default_factory=dict)


def _copy(value, shared: dict):
    # Copies keep the recorded inputs safe from later in-place updates; `shared` makes two calls that read the
    # same tensor object read the same copy again (needed to replay merged linears).
    if isinstance(value, torch.Tensor):
        key = id(value)
        if key not in shared:
            shared[key] = (value, value.detach().clone())  # the original is held so its id stays unique
        return shared[key][1]
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v, shared) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v, shared) for k, v in value.items()}
    return value


def run_with_capture(model: nn.Module, run, interesting) -> tuple[object, Capture]:
    """Runs `run()` once with hooks on every submodule for which `interesting(module)` holds."""
    cap = Capture()
    pending: dict[int, CallRecord] = {}
    # The open run of linears: the input they share (held so its id cannot be reused), its version, the names,
    # and the copies made for it so every member replays the same copied tensor object.
    run_state = {"x": None, "version": None, "names": [], "copies": {}}
    handles = []

    def close_run():
        if len(run_state["names"]) >= 2:
            cap.linear_runs.append(tuple(run_state["names"]))
        run_state.update(x=None, version=None, names=[], copies={})

    def pre_hook(name, is_linear):
        def hook(module, args, kwargs):
            cap.call_counts[name] = cap.call_counts.get(name, 0) + 1
            shared: dict = {}
            if is_linear and args and isinstance(args[0], torch.Tensor):
                x = args[0]
                same = run_state["x"] is x and run_state["version"] == x._version
                if not same or name in run_state["names"]:
                    close_run()
                    run_state.update(x=x, version=x._version)
                run_state["names"].append(name)
                shared = run_state["copies"]
            sig = call_signature(args, kwargs)
            seen = cap.all_signatures.setdefault(name, set())
            records = cap.calls.setdefault(name, [])
            if sig not in seen:
                seen.add(sig)
                if len(records) < MAX_SIGNATURES_PER_MODULE:
                    rec = CallRecord(_copy(args, shared), _copy(kwargs, shared), sig)
                    records.append(rec)
                    pending[id(module)] = rec
            return None

        return hook

    def post_hook(module, args, kwargs, output):
        rec = pending.pop(id(module), None)
        if rec is not None:
            rec.output_form = describe(output) if not hasattr(output, "to_tuple") else ("object", "ModelOutput")
        return None

    for name, module in model.named_modules():
        if name and interesting(module):
            is_linear = isinstance(module, nn.Linear)
            handles.append(module.register_forward_pre_hook(pre_hook(name, is_linear), with_kwargs=True))
            handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    try:
        output = run()
    finally:
        for h in handles:
            h.remove()
        close_run()
    return output, cap
