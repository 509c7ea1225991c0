"""The model options of a contract that configure the engine rather than the sizes: real-time chunking
(`model.options.rtc`) and precision (`model.options.precision`, `precision_gate`), checked into their
`flashrt_core.models` forms (ContractError names a bad key or value)."""
from __future__ import annotations

import dataclasses

from flashrt_core.errors import ContractError
from flashrt_core.models import rtc
from flashrt_core.models.precision import parse_precision


@dataclasses.dataclass(frozen=True)
class ContractRTC:
    """`model.options.rtc` checked: LeRobot's options, the inference delay in actions ("auto": the act stage's
    measured latency over the action period, rounded up, e.g. 1 for a 6 ms act at 50 Hz; or a fixed count,
    which a deterministic replay needs) and the robot's action rate."""

    options: rtc.RTCOptions
    inference_delay: int | str = "auto"
    action_rate_hz: float = 50.0


_RTC_KEYS = {"execution_horizon", "max_guidance_weight", "schedule", "inference_delay", "action_rate_hz"}


def precision_options(model) -> tuple:
    """(Precision, gate thresholds or None) of `model.options.precision` / `precision_gate`."""
    try:
        precision = parse_precision(model.options.get("precision"))
    except ValueError as exc:
        raise ContractError(f"model.options.{exc}") from None
    gate = model.options.get("precision_gate")
    if gate is not None:
        if not isinstance(gate, dict) or set(gate) - {"cosine", "rel_l2"} or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in gate.values()):
            raise ContractError("model.options.precision_gate: a mapping of cosine and / or rel_l2 to numbers, got "
                                f"{gate!r}")
        gate = {k: float(v) for k, v in gate.items()}
    return precision, gate


def rtc_options(model) -> ContractRTC | None:
    """`model.options.rtc`: null / false / absent = off; a mapping of _RTC_KEYS (each optional: LeRobot's
    defaults, delay auto, 50 Hz) = on. ContractError names a bad key or value."""
    value = model.options.get("rtc")
    if value in (None, False):
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ContractError(f"model.options.rtc: a mapping of {', '.join(sorted(_RTC_KEYS))} (or null), got {value!r}")
    unknown = sorted(set(value) - _RTC_KEYS)
    if unknown:
        raise ContractError(f"model.options.rtc.{unknown[0]}: unknown key (expected: {', '.join(sorted(_RTC_KEYS))})")
    try:
        options = rtc.RTCOptions(**{k: value[k] for k in ("execution_horizon", "max_guidance_weight", "schedule")
                                    if k in value})
    except ValueError as exc:
        raise ContractError(f"model.options.{exc}") from None
    delay, rate = value.get("inference_delay", "auto"), value.get("action_rate_hz", 50.0)
    if delay != "auto" and (not isinstance(delay, int) or isinstance(delay, bool) or delay < 0):
        raise ContractError(f"model.options.rtc.inference_delay: auto or a non-negative integer (actions), "
                            f"got {delay!r}")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= 1000:
        raise ContractError(f"model.options.rtc.action_rate_hz: a rate in (0, 1000] Hz, got {rate!r}")
    return ContractRTC(options, delay, float(rate))
