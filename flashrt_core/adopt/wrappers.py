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
from operator import attrgetter

import torch
from torch import nn

from flashrt_core.adopt.signature import call_signature

_WEIGHT_STATE = attrgetter("_version", "dtype", "device")
_grad_enabled = torch.is_grad_enabled
Tensor = torch.Tensor


def _one_tensor_key(signature: tuple):
    """The fast-path key of a signature whose call is one positional tensor, else None (matched generally)."""
    args, kwargs = signature
    if kwargs or len(args) != 1 or args[0][0] != "tensor":
        return None
    _, shape, dtype, dev_type, dev_index = args[0]
    return torch.Size(shape), dtype, torch.device(dev_type, dev_index)


@dataclass
class UnitStats:
    """Live counters of one adopted unit; the report reads them, so they count calls made after adoption."""

    fused_calls: int = 0
    fallback_calls: int = 0

    def reset(self) -> None:
        self.fused_calls = 0
        self.fallback_calls = 0


class AdoptedModule(nn.Module):
    """Stands in for `original`; `fused` is an nn.Module whose forward takes the original's call arguments.

    The check before every call is on the hot path of a launch-bound model (hundreds of wrapped modules, each
    called many times per inference), so it is kept to a few C-level attribute reads: the common call (one
    positional tensor) is matched by a (shape, dtype, device) key against keys precomputed from the adopted
    signatures, and the watched parameters by one tuple of (version, dtype, device) built with `map`. Other
    call forms go through the general `call_signature` match.
    """

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
        # The fused forward called directly: nn.Module.__call__ of the wrapper already ran the hook logic once,
        # and nobody registers hooks on the private fused child.
        object.__setattr__(self, "_fused_forward", fused.forward)
        self.adopted_kind = kind
        self.adopted_signatures = frozenset(signatures)
        object.__setattr__(self, "_one_tensor_keys", frozenset(
            k for k in map(_one_tensor_key, self.adopted_signatures) if k is not None))
        self.stats = stats
        self.training = original.training
        params = [p for p in fused.watched_parameters()] if hasattr(fused, "watched_parameters") else []
        params = params or list(original.parameters())
        object.__setattr__(self, "_watched", tuple(params))
        object.__setattr__(self, "_watched_state", tuple(map(_WEIGHT_STATE, params)))

    @property
    def original(self) -> nn.Module:
        return self._original

    def train(self, mode: bool = True):
        """The mode reaches the original too (it runs every call in training mode: dropout and the like must
        see it), not only the wrapper and the children it shares with the original."""
        super().train(mode)
        self._original.train(mode)
        return self

    def _weights_usable(self) -> bool:
        """No gradient wanted through them, and not written, converted or moved since adoption (derived
        tensors such as merged weights would be stale)."""
        if _grad_enabled() and any(p.requires_grad for p in self._watched):
            return False
        return tuple(map(_WEIGHT_STATE, self._watched)) == self._watched_state

    def fused_allowed(self, args: tuple, kwargs: dict) -> bool:
        if self.training:
            return False
        if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):
            x = args[0]
            if (x.shape, x.dtype, x.device) not in self._one_tensor_keys:
                return False
        elif call_signature(args, kwargs) not in self.adopted_signatures:
            return False
        return self._weights_usable()

    def forward(self, *args, **kwargs):
        # The one-positional-tensor call inlined (it is nearly every call); fused_allowed() is the same test.
        if not kwargs and len(args) == 1 and not self.training:
            x = args[0]
            if (isinstance(x, Tensor) and (x.shape, x.dtype, x.device) in self._one_tensor_keys
                    and (not _grad_enabled() or not any(p.requires_grad for p in self._watched))
                    and tuple(map(_WEIGHT_STATE, self._watched)) == self._watched_state):
                self.stats.fused_calls += 1
                return self._fused_forward(x)
            if isinstance(x, Tensor):
                self.stats.fallback_calls += 1
                return self._original(x)
        if self.fused_allowed(args, kwargs):
            self.stats.fused_calls += 1
            return self._fused_forward(*args, **kwargs)
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
