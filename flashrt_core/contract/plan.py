"""What a contract will run on a device, without loading weights: `flashrt run --dry-run`, `flashrt doctor`.

`describe_run(path, device=..., **overrides)` validates the contract with the same overrides the runtime
takes (checkpoint shapes included), then asks the model binding what it would build: the engine, dtypes,
the checkpoint's cameras by feature name, normalization, relative actions and the tokenizer file. Any
problem raises the same error the runtime would raise at configure.
"""
from __future__ import annotations

from typing import Any

import torch

from flashrt_core.contract.spec import configured_contract


def resolve_device(device: str | None) -> str:
    """"auto" -> cuda when available, else cpu; other names checked (ValueError) and that CUDA exists."""
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a device (cpu, cuda, cuda:N or auto): {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r}, but this torch has no CUDA device "
                         f"({'a CPU-only build' if torch.version.cuda is None else 'none visible'})")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r}, but there are {torch.cuda.device_count()} CUDA devices")
    return str(device)


def describe_run(path, device: str | None = "auto", tokenizer=None, prompt: str | None = None,
                 **overrides) -> dict[str, Any]:
    """-> {contract, model, checkpoint, device, dtype, stages, dims, ...what the binding adds}; `prompt`,
    when given, is checked as set_prompt checks it."""
    from flashrt_core.contract.bindings import resolve_binding

    device = resolve_device(device)
    contract = configured_contract(path, device=device, **overrides)
    binding = resolve_binding(contract.model.name)
    info: dict[str, Any] = {
        "contract": str(path), "model": contract.model.name,
        "checkpoint": contract.model.checkpoint or "none (built-in random weights)", "device": device,
        "dtype": contract.model.dtype,
        "stages": {s.name: s.describe_trigger() for s in contract.stages.values()},
    }
    if rate_warnings(contract):
        info["warnings"] = rate_warnings(contract)
    plan = getattr(binding, "plan", None)
    if plan is not None:
        info.update(plan(contract.model, contract.dims, torch.device(device), tokenizer, prompt=prompt))
    return info


def format_run(info: dict[str, Any], camera_topics=None) -> str:
    """The plan as aligned `key: value` lines; camera_topics (node order) are shown beside the features."""
    lines = []
    for key, value in info.items():
        if key == "warnings":  # (the caller tells them as warnings)
            continue
        if key == "cameras" and isinstance(value, list):
            topics = list(camera_topics or [])
            shown = []
            for i, name in enumerate(value):
                src = topics[i] if i < len(topics) else ("(missing: no topic)" if topics else "")
                shown.append(f"{name} <- {src}" if src else name)
            value = "; ".join(shown)
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            value = ", ".join(map(str, value))
        lines.append(f"{key + ':':<22}{value}")
    return "\n".join(lines)


def rate_warnings(contract) -> list[str]:
    """Stages that read the camera images less often than the contract's observation age limit allows: between
    the limit and the next refresh, decisions are refused (no actions)."""
    limit = contract.limits.max_observation_age_ms
    if limit is None:
        return []
    out = []
    for stage in contract.stages.values():
        rate = stage.trigger.rate_hz
        if rate and "images" in stage.reads and 1e3 / rate > limit:
            out.append(f"stage {stage.name} runs every {1e3 / rate:.0f} ms ({rate:g} Hz) but observations older than "
                       f"{limit:g} ms give no actions (max_observation_age_ms): part of every period publishes "
                       f"nothing; raise its rate above {1e3 / limit:g} Hz or the age limit")
    return out
