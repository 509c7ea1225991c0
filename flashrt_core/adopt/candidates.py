"""Units to try: which modules a replacement (or a linear merge) would swap, with the captured calls to replay.

A candidate is found by structure, confirmed by behaviour (`Replacement.recognise`), and carries everything
the gates need: the originals, the calls to replay in capture order, and a builder for the wrappers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from flashrt_core.adopt.capture import CallRecord, Capture
from flashrt_core.adopt.kinds import NotRecognised, Replacement
from flashrt_core.adopt.kinds.merge import MergedGEMM, MergeMember, merge_groups
from flashrt_core.adopt.report import UnitReport
from flashrt_core.adopt.wrappers import AdoptedModule, UnitStats


@dataclass
class Candidate:
    report: UnitReport
    originals: dict[str, nn.Module]  # qualified name -> original module
    calls: list[tuple[str, CallRecord]]  # replay order (merged linears: members of one input together)
    build: Callable[[UnitStats], dict[str, nn.Module]]  # qualified name -> wrapper
    wrappers: dict[str, nn.Module] = field(default_factory=dict)
    main_output_only: bool = False  # unit parity on the first output only; the end-to-end gate covers the rest


def _overlaps(name: str, taken: set[str]) -> bool:
    return any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken)


def module_candidates(model: nn.Module, cap: Capture, rep: Replacement, taken: set[str], quiet: bool):
    """Candidates (and `not recognised` rows) of one single-module replacement."""
    found, misses = [], []
    for name, module in model.named_modules():
        calls = cap.calls.get(name)
        if not name or not calls or _overlaps(name, taken) or isinstance(module, AdoptedModule):
            continue
        if not rep.structure(module):
            continue
        try:
            plan = rep.recognise(module, calls)
        except NotRecognised as exc:
            if not quiet:
                misses.append(UnitReport(name, rep.kind, reason=f"not recognised: {exc}"))
            continue
        kind = plan.kind or rep.kind
        signatures = {c.signature for c in calls}

        def build(stats, module=module, plan=plan, kind=kind, signatures=signatures, name=name):
            return {name: AdoptedModule(module, plan.make(), signatures, stats, kind)}

        unit = UnitReport(name, kind, detail=plan.detail, signatures=len(signatures))
        found.append(Candidate(unit, {name: module}, [(name, c) for c in calls], build,
                               main_output_only=plan.main_output_only))
    return found, misses


def _group_name(names: tuple[str, ...]) -> str:
    parents = {n.rpartition(".")[0] for n in names}
    if len(parents) == 1:
        parent = parents.pop()
        return f"{parent}[{','.join(n.rpartition('.')[2] for n in names)}]"
    return "+".join(names)


def merge_candidates(model: nn.Module, cap: Capture, taken: set[str]):
    found, misses = [], []
    for names in merge_groups(model, cap.linear_runs):
        if any(_overlaps(n, taken) for n in names):
            continue
        records = [cap.calls.get(n, []) for n in names]
        aligned = len({len(r) for r in records}) == 1 and all(
            all(rec.args[0] is records[0][i].args[0] for rec in (r[i] for r in records))
            for i in range(len(records[0])))
        if not aligned or not records[0]:
            misses.append(UnitReport(_group_name(names), "linear_merge",
                                     reason="not recognised: members were not always called on one input"))
            continue
        linears = [model.get_submodule(n) for n in names]
        calls = [(n, records[j][i]) for i in range(len(records[0])) for j, n in enumerate(names)]

        def build(stats, names=names, linears=linears, records=records):
            group = MergedGEMM(linears)
            return {n: AdoptedModule(lin, MergeMember(group, j, linears), {c.signature for c in records[j]},
                                     stats, "linear_merge")
                    for j, (n, lin) in enumerate(zip(names, linears))}

        widths = "+".join(str(lin.out_features) for lin in linears)
        unit = UnitReport(_group_name(names), "linear_merge",
                          detail=f"{len(names)} linears {linears[0].in_features}->{widths} as one GEMM",
                          signatures=len(records[0]))
        found.append(Candidate(unit, dict(zip(names, linears)), calls, build))
    return found, misses
