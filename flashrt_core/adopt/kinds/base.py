"""What a replacement is, and the probing helpers every kind uses to recognise modules by behaviour.

A `Replacement` has three parts: a cheap structural test (which parameters and children a module has), a
behavioural recognition that runs the module on random inputs shaped like its captured calls and checks the
output against candidate formulas (so a class name alone never decides), and the resulting `Plan`, which
builds the fused module. Extra replacements passed to `accelerate(..., extra=[...])` use the same shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from flashrt_core.adopt.capture import CallRecord


class NotRecognised(Exception):
    """The structure matched but the behaviour did not; the message says how it differed."""


@dataclass(frozen=True)
class Plan:
    detail: str  # e.g. "gemma (1+w), eps=1e-06": shown in the report
    make: Callable[[], nn.Module]  # builds the fused module; its forward takes the original's call arguments
    kind: str | None = None  # set when behaviour says more than structure (a bias-free LayerNorm, say)
    main_output_only: bool = False  # the fused form returns None for extra outputs (eager attention weights)


@dataclass(frozen=True)
class Replacement:
    kind: str
    structure: Callable[[nn.Module], bool]
    recognise: Callable[[nn.Module, list[CallRecord]], Plan]  # raises NotRecognised


@dataclass(frozen=True)
class Locator:
    """Where a tensor argument sits in a call: positional index or keyword name."""

    position: int | None = None
    keyword: str | None = None

    def pick(self, args: tuple, kwargs: dict):
        return args[self.position] if self.keyword is None else kwargs[self.keyword]


def tensor_locators(call: CallRecord) -> list[tuple[Locator, torch.Tensor]]:
    found = [(Locator(position=i), a) for i, a in enumerate(call.args) if isinstance(a, torch.Tensor)]
    found += [(Locator(keyword=k), v) for k, v in call.kwargs.items() if isinstance(v, torch.Tensor)]
    return found


def single_input(calls: list[CallRecord]) -> Locator:
    """The locator of the one tensor argument, the same in every captured call (else NotRecognised)."""
    locs = set()
    for call in calls:
        found = tensor_locators(call)
        if len(found) != 1:
            raise NotRecognised(f"called with {len(found)} tensor arguments, expected 1")
        locs.add(found[0][0])
    if len(locs) != 1:
        raise NotRecognised("the tensor argument moves between calls")
    return locs.pop()


def random_like(t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Random normal values shaped like t (never zeros), reproducible, on t's device and dtype."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)


def with_tensor(call: CallRecord, loc: Locator, value: torch.Tensor) -> tuple[tuple, dict]:
    args, kwargs = list(call.args), dict(call.kwargs)
    if loc.keyword is None:
        args[loc.position] = value
    else:
        kwargs[loc.keyword] = value
    return tuple(args), kwargs


def first_tensor(out):
    """The main output of a module: the tensor itself, or the first element of a returned tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise NotRecognised(f"returns {type(out).__name__}, not a tensor or a tuple starting with one")


def output_tail(out) -> tuple | None:
    """None for a tensor output; for a tuple, what follows the main tensor, which the fused form mimics."""
    if isinstance(out, torch.Tensor):
        return None
    return tuple(out[1:])


def recognition_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: small for the right formula, O(1) for a wrong one."""
    a, e = actual.float(), expected.float()
    if a.shape != e.shape:
        return float("inf")
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-12))


def recognition_tolerance(dtype: torch.dtype) -> float:
    # Loose enough for the rounding of a half-precision module, tight enough to tell formulas apart (the best
    # fitting formula is chosen first; this only rejects modules that fit none).
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def best_fit(actual: torch.Tensor, formulas: dict[str, Callable[[], torch.Tensor]]) -> tuple[str, float]:
    """The formula whose output is closest to `actual`; NotRecognised if none is within tolerance."""
    errors = {}
    for name, formula in formulas.items():
        try:
            errors[name] = recognition_error(actual, formula())
        except (RuntimeError, ValueError) as exc:  # a formula that cannot apply to these shapes
            errors[name] = float("inf")
            del exc
    name = min(errors, key=errors.get)
    if errors[name] > recognition_tolerance(actual.dtype):
        closest = sorted(errors, key=errors.get)[:3]
        shown = ", ".join(f"{k}: {errors[k]:.2e}" for k in closest)
        raise NotRecognised(f"output matches no known formula (closest of {len(errors)}: {shown})")
    return name, errors[name]


def eps_of(module: nn.Module, default: float) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return default


def call_module(module: nn.Module, args: tuple, kwargs: dict):
    try:
        with torch.no_grad():
            return module(*args, **kwargs)
    except Exception as exc:  # a module that needs more context than its captured arguments
        raise NotRecognised(f"probe call failed: {type(exc).__name__}: {exc}") from None
