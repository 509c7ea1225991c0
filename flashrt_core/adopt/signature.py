"""Call signatures: the hashable form of a call that decides whether the fused path may run.

A fused replacement is only proven (parity- and latency-gated) for the calls it saw while adopting, so every
later call is reduced to a signature (tensor shapes, dtypes and devices; plain values as they are; anything
else by type) and the fused path runs only for a signature that was adopted.
"""
from __future__ import annotations

import inspect

import torch

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def describe(value):
    """Hashable description of one argument (no host sync: shapes and dtypes only)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type, value.device.index)
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(describe(v) for v in value))
    if isinstance(value, dict):  # by key, whatever the insertion order
        return ("dict", tuple(sorted(((str(k), describe(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    # Objects (caches, configs) are matched by type only; the parity gate decided they do not matter.
    return ("object", type(value).__qualname__)


def call_signature(args: tuple, kwargs: dict) -> tuple:
    return (tuple(describe(a) for a in args), tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def canonical_call(parameters: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """One form for every way of passing the same arguments (positionally or by name, defaults left out or
    given, keywords in any order): the call bound to `parameters` with defaults applied, as (args, kwargs)
    with the keywords sorted by name. None when the call does not bind (the method itself will say why); only
    the keywords sorted when the parameters are unknown."""
    if parameters is None:
        return tuple(args), dict(sorted(kwargs.items()))
    try:
        bound = parameters.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return tuple(bound.args), dict(sorted(bound.kwargs.items()))


def parameters_of(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C extensions have none
        return None


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor inside a (possibly nested) output: tensors, tuples, lists, dicts, dataclass-like outputs."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return tensors_in(value.to_tuple())
    return []


def only_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The single tensor argument of a call whose other arguments are all plain values, else None."""
    found = [v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)]
    others_plain = all(isinstance(v, _PLAIN) or isinstance(v, torch.Tensor) for v in list(args) + list(kwargs.values()))
    return found[0] if len(found) == 1 and others_plain else None
