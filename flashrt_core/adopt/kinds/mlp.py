"""Activations and MLPs: GELU (exact / tanh), gated MLPs (GeGLU, SwiGLU: down(act(gate(x)) * up(x))) and
plain two-layer MLPs (fc2(act(fc1(x)))). Which linear is the gate, and which activation is used, is decided
by fitting the module's output on a random input, not by attribute names."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from flashrt_core.adopt import ops
from flashrt_core.adopt.kinds.base import (
    Locator, NotRecognised, Plan, Replacement, best_fit, call_module, first_tensor, random_like,
    single_input, with_tensor,
)

ACTIVATIONS = {
    "gelu": lambda t: F.gelu(t),
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


def _probe(module: nn.Module, calls, seed: int):
    loc = single_input(calls)
    x = random_like(loc.pick(calls[0].args, calls[0].kwargs), seed=seed)
    out = call_module(module, *with_tensor(calls[0], loc, x))
    if not isinstance(out, torch.Tensor):
        raise NotRecognised(f"returns {type(out).__name__}, expected a tensor")
    return loc, x, out


# ------------------------------------------------------------------ GELU
class FusedGelu(nn.Module):
    def __init__(self, loc: Locator, approximate: str):
        super().__init__()
        self.loc, self.approximate = loc, approximate

    def forward(self, *args, **kwargs):
        return ops.gelu(self.loc.pick(args, kwargs), self.approximate)


def _gelu_structure(module: nn.Module) -> bool:
    return not list(module.parameters()) and not list(module.buffers()) and not list(module.children())


def _recognise_gelu(module: nn.Module, calls) -> Plan:
    loc = single_input(calls)
    x = random_like(loc.pick(calls[0].args, calls[0].kwargs), seed=3)
    xf = x.float() * 3.0  # a wide range separates exact and tanh GELU more clearly
    out = call_module(module, *with_tensor(calls[0], loc, xf.to(x.dtype)))
    name, err = best_fit(first_tensor(out), {
        "exact": lambda: F.gelu(xf), "tanh": lambda: F.gelu(xf, approximate="tanh")})
    approximate = "none" if name == "exact" else "tanh"
    return Plan(f"{name}, fit {err:.1e}", lambda: FusedGelu(loc, approximate))


# ------------------------------------------------------------------ gated MLP
def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}


class FusedGatedMLP(nn.Module):
    """One GEMM for gate|up, the activation and product fused (GeGLU kernel on CUDA), then down."""

    def __init__(self, original: nn.Module, loc: Locator, gate: str, up: str, down: str, activation: str):
        super().__init__()
        object.__setattr__(self, "original", original)
        self.loc, self.down, self.activation = loc, down, activation
        g, u = getattr(original, gate), getattr(original, up)
        self.register_buffer("gate_up_weight", torch.cat([g.weight.detach(), u.weight.detach()]), persistent=False)
        bias = None
        if g.bias is not None or u.bias is not None:
            zeros = lambda lin: torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device)
            bias = torch.cat([(g.bias if g.bias is not None else zeros(g)).detach(),
                              (u.bias if u.bias is not None else zeros(u)).detach()])
        self.register_buffer("gate_up_bias", bias, persistent=False)
        object.__setattr__(self, "_watched", [p for lin in (g, u) for p in lin.parameters()])

    def watched_parameters(self):
        return self._watched

    def forward(self, *args, **kwargs):
        x = self.loc.pick(args, kwargs)
        h = ops.gated_act(F.linear(x, self.gate_up_weight, self.gate_up_bias), self.activation)
        down = getattr(self.original, self.down)
        return F.linear(h, down.weight, down.bias)


def _gated_structure(module: nn.Module) -> bool:
    lins = list(_linears(module).values())
    if len(lins) != 3 or any(not isinstance(c, nn.Linear) and list(c.parameters()) for c in module.children()):
        return False
    for down in lins:
        rest = [lin for lin in lins if lin is not down]
        if all(lin.in_features == down.out_features and lin.out_features == down.in_features for lin in rest):
            return True
    return False


def _recognise_gated(module: nn.Module, calls) -> Plan:
    lins = _linears(module)
    loc, x, out = _probe(module, calls, seed=4)
    width = x.shape[-1]
    ups = [n for n, lin in lins.items() if lin.in_features == width]
    downs = [n for n, lin in lins.items() if lin.out_features == width and lin.in_features != width]
    if len(ups) != 2 or len(downs) != 1:
        raise NotRecognised(f"expected two {width}->I linears and one I->{width}, found {sorted(lins)}")
    down = downs[0]
    formulas = {}
    with torch.no_grad():
        for (gate, up), act in itertools.product(itertools.permutations(ups), ACTIVATIONS):
            def formula(gate=gate, up=up, act=act):
                h = ACTIVATIONS[act](lins[gate](x).float()) * lins[up](x).float()
                return lins[down](h.to(x.dtype)).float()
            formulas[f"{act}:{gate}:{up}"] = formula
        name, err = best_fit(out, formulas)
    act, gate, up = name.split(":")
    return Plan(f"{act}({gate}) * {up} -> {down}, merged gate|up GEMM, fit {err:.1e}",
                lambda: FusedGatedMLP(module, loc, gate, up, down, act))


# ------------------------------------------------------------------ plain MLP
class FusedMLP(nn.Module):
    """fc1 GEMM with the bias + activation fused into one epilogue kernel, then fc2."""

    def __init__(self, original: nn.Module, loc: Locator, fc1: str, fc2: str, approximate: str):
        super().__init__()
        object.__setattr__(self, "original", original)
        self.loc, self.fc1, self.fc2, self.approximate = loc, fc1, fc2, approximate

    def forward(self, *args, **kwargs):
        x = self.loc.pick(args, kwargs)
        fc1, fc2 = getattr(self.original, self.fc1), getattr(self.original, self.fc2)
        h = ops.gelu(F.linear(x, fc1.weight), self.approximate, bias=fc1.bias)
        return F.linear(h, fc2.weight, fc2.bias)


def _mlp_structure(module: nn.Module) -> bool:
    lins = list(_linears(module).values())
    return len(lins) == 2 and lins[0].out_features == lins[1].in_features and all(
        isinstance(c, nn.Linear) or not list(c.parameters()) for c in module.children())


def _recognise_mlp(module: nn.Module, calls) -> Plan:
    lins = _linears(module)
    loc, x, out = _probe(module, calls, seed=5)
    first = [n for n, lin in lins.items() if lin.in_features == x.shape[-1]]
    if len(first) != 1:
        raise NotRecognised("no unique first linear reading the input")
    fc1 = first[0]
    fc2 = next(n for n in lins if n != fc1)
    with torch.no_grad():
        formulas = {act: (lambda act=act: lins[fc2](ACTIVATIONS[act](lins[fc1](x).float()).to(x.dtype)).float())
                    for act in ("gelu", "gelu_tanh")}
        name, err = best_fit(out, formulas)
    approximate = "none" if name == "gelu" else "tanh"
    return Plan(f"{fc2}({name}({fc1})), fused bias+gelu epilogue, fit {err:.1e}",
                lambda: FusedMLP(module, loc, fc1, fc2, approximate))


GELU = Replacement("gelu", _gelu_structure, _recognise_gelu)
GATED_MLP = Replacement("gated_mlp", _gated_structure, _recognise_gated)
MLP = Replacement("mlp", _mlp_structure, _recognise_mlp)
