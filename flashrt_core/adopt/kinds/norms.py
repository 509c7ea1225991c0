"""Normalisation layers: RMSNorm (plain w and Gemma's 1 + w), AdaRMS (scale/shift/gate from a condition),
LayerNorm. Each is recognised by running it on a random input and fitting its output to the formulas."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashrt_core.adopt import ops
from flashrt_core.adopt.kinds.base import (
    Locator, NotRecognised, Plan, Replacement, best_fit, call_module, eps_of, first_tensor, output_tail,
    random_like, single_input, tensor_locators, with_tensor,
)


def _vector_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters(recurse=False))


def _is_affine_norm(module: nn.Module) -> bool:
    params = _vector_params(module)
    if "weight" not in params or set(params) - {"weight", "bias"} or list(module.children()):
        return False
    return all(p.dim() == 1 and p.shape == params["weight"].shape for p in params.values())


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class FusedRMSNorm(nn.Module):
    def __init__(self, original: nn.Module, loc: Locator, eps: float, offset: float, tail):
        super().__init__()
        object.__setattr__(self, "original", original)
        self.loc, self.eps, self.offset, self.tail = loc, eps, offset, tail
        self.register_buffer("folded_weight", offset + original.weight.detach().float(), persistent=False)

    def forward(self, *args, **kwargs):
        x = self.loc.pick(args, kwargs)
        y = ops.rms_norm(x, self.original.weight, self.folded_weight, self.eps, self.offset)
        return y if self.tail is None else (y, *self.tail)


class FusedLayerNorm(nn.Module):
    def __init__(self, original: nn.Module, loc: Locator, eps: float, tail):
        super().__init__()
        object.__setattr__(self, "original", original)
        self.loc, self.eps, self.tail = loc, eps, tail

    def forward(self, *args, **kwargs):
        x = self.loc.pick(args, kwargs)
        y = ops.layer_norm(x, self.original.weight, getattr(self.original, "bias", None), self.eps)
        return y if self.tail is None else (y, *self.tail)


def _recognise_affine_norm(module: nn.Module, calls) -> Plan:
    loc = single_input(calls)
    x = random_like(loc.pick(calls[0].args, calls[0].kwargs), seed=1)
    out = call_module(module, *with_tensor(calls[0], loc, x))
    y, tail = first_tensor(out), output_tail(out)
    if tail is not None and any(t is not None for t in tail):
        raise NotRecognised("returns extra non-None outputs beside the normalised tensor")
    w = module.weight.detach().float()
    b = getattr(module, "bias", None)
    eps = eps_of(module, 1e-6)
    formulas = {
        "rms_norm_gemma": lambda: _rms(x, eps) * (1.0 + w),
        "rms_norm": lambda: _rms(x, eps) * w,
    }
    if b is not None:
        formulas["layer_norm"] = lambda: F.layer_norm(x.float(), (x.shape[-1],), w, b.detach().float(), eps)
    else:
        formulas["layer_norm_no_bias"] = lambda: F.layer_norm(x.float(), (x.shape[-1],), w, None, eps)
    name, err = best_fit(y, formulas)
    if name.startswith("layer_norm"):
        return Plan(f"eps={eps:g}, fit {err:.1e}", lambda: FusedLayerNorm(module, loc, eps, tail), kind="layer_norm")
    offset = 1.0 if name == "rms_norm_gemma" else 0.0
    form = "gemma (1+w)" if offset else "plain w"
    return Plan(f"{form}, eps={eps:g}, fit {err:.1e}", lambda: FusedRMSNorm(module, loc, eps, offset, tail),
                kind="rms_norm")


def _rms_structure(module: nn.Module) -> bool:
    return _is_affine_norm(module) and getattr(module, "bias", None) is None


def _layer_norm_structure(module: nn.Module) -> bool:
    return _is_affine_norm(module) and getattr(module, "bias", None) is not None


# ------------------------------------------------------------------ AdaRMS
class FusedAdaRMSNorm(nn.Module):
    """(rms(x) * (1 + scale) + shift, gate) with (scale, shift, gate) = dense(cond), as pi0.5's action expert."""

    def __init__(self, original: nn.Module, x_loc: Locator, cond_loc: Locator, eps: float):
        super().__init__()
        object.__setattr__(self, "original", original)
        self.x_loc, self.cond_loc, self.eps = x_loc, cond_loc, eps

    def forward(self, *args, **kwargs):
        x, cond = self.x_loc.pick(args, kwargs), self.cond_loc.pick(args, kwargs)
        dense = self.original.dense
        scale, shift, gate = F.linear(cond, dense.weight, dense.bias).chunk(3, dim=-1)
        if x.dim() == 3 and cond.dim() == 2:
            gate = gate.unsqueeze(1)
        return ops.ada_rms_norm(x, scale, shift, self.eps), gate.to(x.dtype)


def _ada_structure(module: nn.Module) -> bool:
    dense = getattr(module, "dense", None)
    children = dict(module.named_children())
    return (isinstance(dense, nn.Linear) and set(children) == {"dense"} and dense.out_features % 3 == 0
            and not _vector_params(module))


def _recognise_ada(module: nn.Module, calls) -> Plan:
    dense = module.dense
    width = dense.out_features // 3
    x_loc = cond_loc = None
    for loc, t in tensor_locators(calls[0]):
        if t.shape[-1] == width and x_loc is None:
            x_loc = loc
        elif t.shape[-1] == dense.in_features:
            cond_loc = loc
    if x_loc is None or cond_loc is None or len(tensor_locators(calls[0])) != 2:
        raise NotRecognised("not called with (x [..., D], cond [..., cond_dim])")
    for call in calls:
        x, cond = x_loc.pick(call.args, call.kwargs), cond_loc.pick(call.args, call.kwargs)
        if cond.dim() != 2 or x.dim() not in (2, 3) or cond.shape[0] != x.shape[0]:
            raise NotRecognised(f"x {tuple(x.shape)} / cond {tuple(cond.shape)} is not [B, (T,) D] / [B, C]")
    x = random_like(x_loc.pick(calls[0].args, calls[0].kwargs), seed=2)
    args, kwargs = with_tensor(calls[0], x_loc, x)
    out = call_module(module, args, kwargs)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise NotRecognised("does not return (normalised, gate)")
    cond = cond_loc.pick(args, kwargs)
    eps = eps_of(module, 1e-6)
    with torch.no_grad():
        scale, shift, gate = F.linear(cond, dense.weight, dense.bias).float().chunk(3, dim=-1)
    if x.dim() == 3:
        scale, shift, gate = scale[:, None], shift[:, None], gate[:, None]
    _, err_y = best_fit(out[0], {"ada_rms": lambda: _rms(x, eps) * (1.0 + scale) + shift})
    _, err_g = best_fit(out[1], {"gate": lambda: gate.expand_as(out[1])})
    return Plan(f"AdaRMS, eps={eps:g}, fit {max(err_y, err_g):.1e}",
                lambda: FusedAdaRMSNorm(module, x_loc, cond_loc, eps))


RMS_NORM = Replacement("rms_norm", _rms_structure, _recognise_affine_norm)
LAYER_NORM = Replacement("layer_norm", _layer_norm_structure, _recognise_affine_norm)
ADA_RMS_NORM = Replacement("ada_rms_norm", _ada_structure, _recognise_ada)
