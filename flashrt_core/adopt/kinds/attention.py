"""Self-attention blocks with q/k/v/o projections computed as matmul-softmax-matmul or SDPA.

Recognised when the module, called on a random [B, T, D] input alone, matches
o(softmax(q k^T * scale) v) for some assignment of its linears, head size and causality. Blocks that need
more than the hidden states (RoPE tables, a KV cache) do not match and are left to the linear merge, which
still fuses their q/k/v GEMMs. The fused block runs one merged QKV GEMM, one attention kernel and o.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from flashrt_core.adopt import ops
from flashrt_core.adopt.kinds.base import (
    Locator, NotRecognised, Plan, Replacement, best_fit, call_module, first_tensor, output_tail, random_like,
    single_input, with_tensor,
)


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}


def _roles(module: nn.Module) -> list[tuple[str, list[str]]]:
    """Every (output linear, three input linears) split that fits by shapes: the inputs read D, the output
    writes D. With square projections all four splits fit; the probe decides."""
    lins = _linears(module)
    if len(lins) != 4:
        return []
    found = []
    for out_name, out in lins.items():
        ins = [n for n in lins if n != out_name and lins[n].in_features == out.out_features]
        if len(ins) == 3 and any(lins[n].out_features == out.in_features for n in ins):
            found.append((out_name, ins))
    return found


def _structure(module: nn.Module) -> bool:
    return bool(_roles(module)) and not list(module.parameters(recurse=False))


def _head_dims(module: nn.Module, q_width: int, kv_width: int) -> list[int]:
    found = []
    config = getattr(module, "config", None)
    for owner in (module, config):
        dh = getattr(owner, "head_dim", None)
        if isinstance(dh, int):
            found.append(dh)
        for attr in ("num_heads", "num_attention_heads", "n_heads"):
            heads = getattr(owner, attr, None)
            if isinstance(heads, int) and heads > 0 and q_width % heads == 0:
                found.append(q_width // heads)
    if not found:  # no hint: every plausible head size that divides both widths
        found = [d for d in range(8, min(q_width, kv_width) + 1) if q_width % d == 0 and kv_width % d == 0]
    return [d for d in dict.fromkeys(found) if q_width % d == 0 and kv_width % d == 0]


def _scale(module: nn.Module, head_dim: int) -> float:
    for attr in ("scaling", "scale"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return 1.0 / math.sqrt(head_dim)


def _reference(lins, q, k, v, o, x, head_dim, scale, causal):
    b, t, _ = x.shape
    qh = lins[q](x).float().view(b, t, -1, head_dim).transpose(1, 2)
    kh = lins[k](x).float().view(b, t, -1, head_dim).transpose(1, 2)
    vh = lins[v](x).float().view(b, t, -1, head_dim).transpose(1, 2)
    group = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ vh).transpose(1, 2).reshape(b, t, -1)
    return lins[o](att.to(x.dtype)).float()


class FusedAttention(nn.Module):
    def __init__(self, original, loc: Locator, q, k, v, o, head_dim: int, scale: float, causal: bool, tail):
        super().__init__()
        object.__setattr__(self, "original", original)
        self.loc, self.o, self.head_dim, self.scale, self.causal, self.tail = loc, o, head_dim, scale, causal, tail
        lins = [getattr(original, n) for n in (q, k, v)]
        self.widths = [lin.out_features for lin in lins]
        self.register_buffer("qkv_weight", torch.cat([lin.weight.detach() for lin in lins]), persistent=False)
        bias = None
        if any(lin.bias is not None for lin in lins):
            bias = torch.cat([(lin.bias.detach() if lin.bias is not None else
                               torch.zeros_like(lin.weight[:, 0])) for lin in lins])
        self.register_buffer("qkv_bias", bias, persistent=False)
        object.__setattr__(self, "_watched", [p for lin in lins for p in lin.parameters()])

    def watched_parameters(self):
        return self._watched

    def forward(self, *args, **kwargs):
        x = self.loc.pick(args, kwargs)
        b, t, _ = x.shape
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(self.widths, dim=-1)
        dh = self.head_dim
        out = ops.attention(q.view(b, t, -1, dh), k.view(b, t, -1, dh), v.view(b, t, -1, dh),
                            self.scale, self.causal)
        out_lin = getattr(self.original, self.o)
        y = F.linear(out.reshape(b, t, -1), out_lin.weight, out_lin.bias)
        return y if self.tail is None else (y, *self.tail)


def _recognise(module: nn.Module, calls) -> Plan:
    lins = _linears(module)
    loc = single_input(calls)
    for call in calls:
        if loc.pick(call.args, call.kwargs).dim() != 3:
            raise NotRecognised("input is not [B, T, D]")
    x = random_like(loc.pick(calls[0].args, calls[0].kwargs), seed=6)
    out = call_module(module, *with_tensor(calls[0], loc, x))
    y, tail = first_tensor(out), output_tail(out)
    formulas = {}
    with torch.no_grad():
        for o, ins in _roles(module):
            q_width = lins[o].in_features
            for q, k, v in itertools.permutations(ins):
                if lins[q].out_features != q_width or lins[k].out_features != lins[v].out_features:
                    continue
                for dh in _head_dims(module, q_width, lins[k].out_features):
                    if (q_width // dh) % (lins[k].out_features // dh):
                        continue
                    for causal in (False, True):
                        formulas[f"{q}:{k}:{v}:{o}:{dh}:{int(causal)}"] = (
                            lambda q=q, k=k, v=v, o=o, dh=dh, causal=causal:
                            _reference(lins, q, k, v, o, x, dh, _scale(module, dh), causal))
        if not formulas:
            raise NotRecognised("no head size fits the q/k/v widths")
        name, err = best_fit(y, formulas)
    q, k, v, o, dh, causal = name.split(":")
    q_width = lins[o].in_features
    dh, causal = int(dh), bool(int(causal))
    # Extra outputs (attention weights of an eager implementation) are replaced by None: the end-to-end gate
    # checks that the caller does not use them.
    drops = tail is not None and any(t is not None for t in tail)
    tail = None if tail is None else tuple(None for _ in tail)
    heads = f"{q_width // dh}/{lins[k].out_features // dh} heads x {dh}"
    return Plan(f"{heads}, {'causal' if causal else 'bidirectional'}, merged {q}|{k}|{v} GEMM, fit {err:.1e}"
                + (", attention weights not returned" if drops else ""),
                lambda: FusedAttention(module, loc, q, k, v, o, dh, _scale(module, dh), causal, tail),
                main_output_only=drops)


ATTENTION = Replacement("attention", _structure, _recognise)
