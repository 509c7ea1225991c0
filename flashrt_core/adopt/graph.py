"""CUDA graph capture of a whole method (`forward`, `sample_actions`, ...) with static inputs.

The graphed method is set as an instance attribute of the module (so `detach` finds and removes it, and
nothing else on the module changes). A call whose signature matches the captured one copies its tensors into
the static inputs and replays; any other call runs the method eagerly and is counted. Calls are compared in
one canonical form (bound to the method's parameters, defaults applied), so passing an argument by position
or by name, or leaving a default out, makes no difference.

Policies often create small constant tensors from Python values inside the method
(`torch.tensor([0, 0, 1], device=cuda)`); such host-to-device uploads cannot be captured. They are hoisted:
a warm-up run records every upload with its host value, and during capture each upload is answered by the
device tensor recorded for it, after checking the host value is the same as at warm-up.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from flashrt_core.adopt.signature import call_signature, canonical_call, parameters_of
from flashrt_core.adopt.wrappers import UnitStats
from flashrt_core.engine.graphs import capture, warm_up

_UPLOADERS = {torch.tensor, torch.as_tensor, torch.Tensor.to, torch.Tensor.cuda}


class CaptureError(RuntimeError):
    """The method cannot be captured as it is (its message says where)."""


def _targets_cuda(args, kwargs) -> bool:
    for t in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(t, torch.Tensor):
            return t.device.type == "cuda"
        if isinstance(t, (str, torch.device)) and torch.device(t).type == "cuda":
            return True
    return False


def _is_upload(func, args, kwargs) -> bool:
    """A call that copies host data (a Python value or a CPU tensor) to the GPU."""
    if func in (torch.tensor, torch.as_tensor):
        if args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            return False
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cuda"
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type != "cpu":
        return False
    return func is torch.Tensor.cuda or _targets_cuda(args, kwargs)


def _host_value(func, args, kwargs) -> torch.Tensor:
    """The value an upload call would produce, computed on the host (no device work)."""
    if func in (torch.tensor, torch.as_tensor):
        return func(*args, **{**kwargs, "device": "cpu"})
    src, dtype = args[0], kwargs.get("dtype")
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            dtype = a.dtype
    return src.to(dtype=dtype or src.dtype)


class _HoistUploads(TorchFunctionMode):
    """Warm-up (recorded=None): note every upload. Capture: answer each with the recorded device tensor."""

    def __init__(self, recorded: list | None):
        super().__init__()
        self.recording = recorded is None
        self.recorded = [] if recorded is None else recorded
        self.position = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _UPLOADERS or not _is_upload(func, args, kwargs):
            return func(*args, **kwargs)
        if self.recording:
            out = func(*args, **kwargs)
            self.recorded.append((_host_value(func, args, kwargs), out))
            return out
        if self.position >= len(self.recorded):
            raise CaptureError("more host-to-device uploads during capture than during warm-up")
        host, device_tensor = self.recorded[self.position]
        self.position += 1
        value = _host_value(func, args, kwargs)
        if value.shape != host.shape or value.dtype != host.dtype or not torch.equal(value, host):
            raise CaptureError(f"host-to-device upload #{self.position} changed between warm-up and capture")
        return device_tensor


@contextlib.contextmanager
def _no_grad_hoisting(uploads: list):
    with torch.no_grad(), _HoistUploads(uploads):
        yield


class GraphedMethod:
    """One CUDA graph of `owner.<name>(*args, **kwargs)`; outputs are cloned so callers may keep them."""

    def __init__(self, owner, name: str, args: tuple, kwargs: dict, warmups: int = 2):
        self.name = name
        self.eager = getattr(owner, name)
        self.stats = UnitStats()
        self._parameters = parameters_of(self.eager)
        canonical = canonical_call(self._parameters, args, kwargs)
        if canonical is None:
            raise CaptureError(f"the example arguments do not fit {name}{self._parameters}")
        args, kwargs = canonical
        self.signature = call_signature(args, kwargs)
        self.static_args, self.static_kwargs = tree_map(
            lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (tuple(args), dict(kwargs)))
        # The call's tensors in a fixed order; a call whose nesting differs (another dict layout, a list of
        # another length) has another tree structure and runs eagerly.
        self._static_leaves, self._tree = tree_flatten((self.static_args, self.static_kwargs))
        hoist = _HoistUploads(None)

        def warm():
            for _ in range(max(0, warmups - 1)):
                self.eager(*self.static_args, **self.static_kwargs)
            with hoist:
                self.eager(*self.static_args, **self.static_kwargs)
        warm_up(warm, context=torch.no_grad)
        self._uploads = hoist.recorded  # kept alive: the graph reads these device tensors
        out = []
        self.graph = capture(lambda: out.append(self.eager(*self.static_args, **self.static_kwargs)),
                             context=lambda: _no_grad_hoisting(self._uploads))
        self.static_out = out[0]

    @property
    def uploads_hoisted(self) -> int:
        return len(self._uploads)

    def __call__(self, *args, **kwargs):
        canonical = canonical_call(self._parameters, args, kwargs)
        leaves, tree = tree_flatten(canonical) if canonical is not None else (None, None)
        if canonical is None or tree != self._tree or call_signature(*canonical) != self.signature:
            self.stats.fallback_calls += 1
            return self.eager(*args, **kwargs)
        self.stats.fused_calls += 1
        for static, value in zip(self._static_leaves, leaves):
            if isinstance(static, torch.Tensor) and static is not value:
                static.copy_(value)
        self.graph.replay()
        return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, self.static_out)
