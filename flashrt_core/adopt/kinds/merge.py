"""Linears that read the same input tensor one after another (q/k/v, gate/up), merged into one GEMM.

Found by behaviour: the capture run saw them called consecutively on the very same tensor (same object and
version). The calling code is not changed, so the merge works through the members themselves: the first
member called computes the merged GEMM once and returns its slice; the others, called next with the same
unmodified tensor, return theirs without computing. A member called with any other tensor computes again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedGEMM:
    """The merged weight lives on member 0's fused module (so `.to()` moves it); this holds the pending slices."""

    def __init__(self, linears: list[nn.Linear]):
        self.widths = [lin.out_features for lin in linears]
        self.leader: MergeMember | None = None
        self._x = None
        self._version = -1
        self._pending: list = [None] * len(linears)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        pending = self._pending
        if self._x is x and self._version == x._version and pending[index] is not None:
            out, pending[index] = pending[index], None
            if all(p is None for p in pending):
                self._x = None  # release the input once every member took its slice
            return out
        leader = self.leader
        outs = list(F.linear(x, leader.merged_weight, leader.merged_bias).split(self.widths, dim=-1))
        out, outs[index] = outs[index], None
        self._x, self._version, self._pending = x, x._version, outs
        return out


class MergeMember(nn.Module):
    def __init__(self, group: MergedGEMM, index: int, linears: list[nn.Linear]):
        super().__init__()
        object.__setattr__(self, "group", group)
        self.index = index
        if index == 0:
            group.leader = self
            self.register_buffer("merged_weight", torch.cat([lin.weight.detach() for lin in linears]),
                                 persistent=False)
            bias = None
            if any(lin.bias is not None for lin in linears):
                bias = torch.cat([(lin.bias.detach() if lin.bias is not None else
                                   torch.zeros_like(lin.weight[:, 0])) for lin in linears])
            self.register_buffer("merged_bias", bias, persistent=False)
        object.__setattr__(self, "_watched", [p for lin in linears for p in lin.parameters()])

    def watched_parameters(self):
        return self._watched

    def forward(self, x):
        return self.group.output(self.index, x)


def merge_groups(model: nn.Module, linear_runs: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Groups of linears always seen together on one input, mergeable into one GEMM (same input width,
    dtype and device). A linear that appears in two different groups is left alone."""
    groups: dict[str, tuple[str, ...]] = {}
    conflicted: set[str] = set()
    for run in linear_runs:
        for name in run:
            if name in groups and groups[name] != run:
                conflicted.add(name)
            groups.setdefault(name, run)
    result = []
    for run in dict.fromkeys(groups.values()):
        if any(n in conflicted for n in run) or len(set(run)) != len(run):
            continue
        lins = [model.get_submodule(n) for n in run]
        keys = {(lin.in_features, lin.weight.dtype, lin.weight.device) for lin in lins}
        if len(keys) == 1 and all(type(lin).forward is nn.Linear.forward for lin in lins):
            result.append(run)
    return result
