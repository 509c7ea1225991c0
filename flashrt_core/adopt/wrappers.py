"""Swapped-in modules: run the fused path for adopted calls, the remembered original for anything else.

A wrapper takes the place of the original submodule in its parent. It registers the original's own
parameters, buffers and children under the same names (the same objects, not copies), so `state_dict()` keys,
`.to()` and attribute reads such as `layer.mlp.up_proj.weight.dtype` behave as before; other attributes are
read through to the original. Derived tensors of the fused path (merged weights, 1 + w) are non-persistent
buffers of the fused child. The fused path runs only when the call signature is one that was adopted, the
module is in eval mode, no gradient is wanted, and the watched parameters were not written since adoption
(a reloaded checkpoint would make derived tensors stale); every other call runs the original and is counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashrt_core.adopt.signature import call_signature


@dataclass
class UnitStats:
    """Live counters of one adopted unit; the report reads them, so they count calls made after adoption."""

    fused_calls: int = 0
    fallback_calls: int = 0

    def reset(self) -> None:
        self.fused_calls = 0
        self.fallback_calls = 0


class AdoptedModule(nn.Module):
    """Stands in for `original`; `fused` is an nn.Module whose forward takes the original's call arguments."""

    def __init__(self, original: nn.Module, fused: nn.Module, signatures, stats: UnitStats, kind: str):
        super().__init__()
        for name, param in original.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in original.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in original._non_persistent_buffers_set)
        for name, child in original.named_children():
            self.add_module(name, child)
        # Set after the registrations above (attribute reads fall through to it); kept out of _modules so
        # state_dict keys stay the same.
        object.__setattr__(self, "_original", original)
        self.fused_impl = fused.train(original.training)
        self.adopted_kind = kind
        self.adopted_signatures = frozenset(signatures)
        self.stats = stats
        self.training = original.training
        params = [p for p in fused.watched_parameters()] if hasattr(fused, "watched_parameters") else []
        params = params or list(original.parameters())
        self._watched = params
        self._watched_versions = tuple(p._version for p in params)
        self._watched_key = tuple((p.dtype, p.device) for p in params)

    @property
    def original(self) -> nn.Module:
        return self._original

    def fused_allowed(self, args: tuple, kwargs: dict) -> bool:
        if self.training or call_signature(args, kwargs) not in self.adopted_signatures:
            return False
        if torch.is_grad_enabled() and any(p.requires_grad for p in self._watched):
            return False
        watched = self._watched
        return (
            tuple(p._version for p in watched) == self._watched_versions
            and tuple((p.dtype, p.device) for p in watched) == self._watched_key
        )

    def forward(self, *args, **kwargs):
        if self.fused_allowed(args, kwargs):
            self.stats.fused_calls += 1
            return self.fused_impl(*args, **kwargs)
        self.stats.fallback_calls += 1
        return self._original(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)

    def extra_repr(self) -> str:
        return f"adopted={self.adopted_kind}, original={type(self._original).__name__}"


def set_submodule(root: nn.Module, qualname: str, module: nn.Module) -> None:
    parent_name, _, child = qualname.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and child.isdigit():
        parent[int(child)] = module
    else:
        setattr(parent, child, module)
