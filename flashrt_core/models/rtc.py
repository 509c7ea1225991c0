"""Real-time chunking (RTC) guidance for the flow-matching action experts, with LeRobot 0.6.1's semantics.

While a chunk is being computed the robot keeps executing the previous one, so the first `inference_delay`
actions of the new chunk are already decided: the rest of the previous chunk (`prev_chunk_left_over`, the
actions not yet executed when inference started, in model space) guides the new chunk's flow towards it,
with per-action prefix weights that are 1 over the delay, fall off to 0 at the execution horizon
(schedule "linear" / "exp"; "zeros": 1 over the delay only; "ones": 1 up to the horizon) and are 0 after it.

LeRobot 0.6.1 (`RTCProcessor.denoise_step`, wrapped around every Euler step of `euler_integrate`) computes,
at flow time `time` (1 -> 0, tau = 1 - time):
    v        = denoiser(x_t)                       (x_t not yet requiring grad)
    x1       = x_t - time * v
    err      = (prev - x1) * w                     (prev zero padded to [chunk, action_dim])
    corr     = autograd.grad(x1, x_t, err)         (v was computed before x_t required grad: dx1/dx_t = I,
                                                    so corr == err exactly; no pass through the denoiser)
    g        = min(c * inv_r2, max_guidance_weight),  c = (1 - tau) / tau,
               inv_r2 = ((1 - tau)^2 + tau^2) / (1 - tau)^2  (tau = 0 at the first step: g = max)
    v_guided = v - g * corr
and the Euler update x_t += dt * v_guided. Because corr == err, the guided step is
    x_t <- x_t + dt * v - dt * g * w * (prev - x_t + time * v)
        =  x_t + a * v + b * (prev - x_t),   a = dt * (1 - g * w * time),  b = -dt * g * w
per flow step (g, time) and action row (w): `step_coefficients` gives a and b, which the engines apply after
each step's velocity, the reference in plain torch and the fused engine as part of its act graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashrt_core.errors import InputError

SCHEDULES = ("zeros", "ones", "linear", "exp")


@dataclass(frozen=True)
class RTCOptions:
    """LeRobot's `RTCConfig` (enabled, prefix_attention_schedule, max_guidance_weight, execution_horizon)."""

    execution_horizon: int = 10
    max_guidance_weight: float = 10.0
    schedule: str = "linear"

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"rtc schedule: one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not (isinstance(self.max_guidance_weight, (int, float)) and math.isfinite(self.max_guidance_weight)
                and self.max_guidance_weight > 0):
            raise ValueError(f"rtc max_guidance_weight must be a positive number, got {self.max_guidance_weight!r}")
        if not isinstance(self.execution_horizon, int) or self.execution_horizon < 1:
            raise ValueError(f"rtc execution_horizon must be a positive integer, got {self.execution_horizon!r}")


def options_from_lerobot(config: dict) -> RTCOptions | None:
    """The `rtc_config` of a LeRobot config.json (PI05Config / PI0Config as `save_pretrained` writes it) as
    RTCOptions; None where it is absent, null or not enabled (LeRobot then ignores a previous chunk)."""
    rtc = config.get("rtc_config")
    if rtc is None or rtc is False or not rtc.get("enabled", True):  # ({} is LeRobot's RTCConfig(): enabled)
        return None
    try:
        return RTCOptions(execution_horizon=int(rtc.get("execution_horizon", 10)),
                          max_guidance_weight=float(rtc.get("max_guidance_weight", 10.0)),
                          schedule=str(rtc.get("prefix_attention_schedule", "linear")).lower())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.json rtc_config: {exc}") from None


def prefix_weights(start: int, end: int, total: int, schedule: str) -> torch.Tensor:
    """[total] fp32 weights of the previous chunk's actions (LeRobot's `get_prefix_weights`): 1 over the first
    `start` (the inference delay), a fall-off to the `end` (the execution horizon), 0 after it."""
    start = min(start, end)
    if schedule == "zeros":
        w = torch.zeros(total)
        w[:start] = 1.0
        return w
    if schedule == "ones":
        w = torch.ones(total)
        w[end:] = 0.0
        return w
    steps = total - max(total - end, 0) - start
    ramp = torch.linspace(1, 0, steps + 2)[1:-1] if end > start and steps > 0 else torch.zeros(0)
    if schedule == "exp":
        ramp = ramp * torch.expm1(ramp).div(math.e - 1)
    parts = [torch.ones(min(start, total)) if start > 0 else torch.zeros(0), ramp]
    if total - end > 0:
        parts.append(torch.zeros(total - end))
    return torch.cat(parts)


def guidance_weight(time: float, max_guidance_weight: float) -> float:
    """LeRobot's clipped guidance weight at flow time `time` (its torch.nan_to_num steps: an infinite c or
    product is the clip, a NaN product 0): the clip at the first step (time 1), then falling."""
    tau = 1.0 - time
    one_minus = (1.0 - tau) ** 2
    c = (1.0 - tau) / tau if tau != 0 else math.inf
    if math.isinf(c):
        c = float(max_guidance_weight)
    inv_r2 = (one_minus + tau ** 2) / one_minus if one_minus != 0 else math.inf
    g = c * inv_r2
    if math.isnan(g):
        g = 0.0
    elif math.isinf(g):
        g = float(max_guidance_weight)
    return min(g, float(max_guidance_weight))


@dataclass
class RTCInputs:
    """One act call's guidance: `prev` [B, chunk, action_dim] fp32 (the previous chunk's unexecuted actions,
    zero padded), `weights` [chunk] fp32 (`prefix_weights`) and the guidance weight's clip."""

    prev: torch.Tensor
    weights: torch.Tensor
    max_guidance_weight: float


def rtc_inputs(prev_chunk_left_over: torch.Tensor, inference_delay: int, execution_horizon: int | None,
               options: RTCOptions, chunk: int, action_dim: int, batch: int) -> RTCInputs:
    """Check and pad LeRobot's RTC arguments: prev_chunk_left_over [B, T_prev <= chunk, A <= action_dim] (or
    [T_prev, A]), inference_delay >= 0, execution_horizon (None: the options'), clipped to T_prev as LeRobot
    clips it. InputError names what is wrong."""
    if not isinstance(prev_chunk_left_over, torch.Tensor) or not prev_chunk_left_over.is_floating_point():
        raise InputError("prev_chunk_left_over: expected a float tensor [B, T, action_dim]")
    prev = prev_chunk_left_over[None] if prev_chunk_left_over.ndim == 2 else prev_chunk_left_over
    if prev.ndim != 3 or prev.shape[0] != batch or prev.shape[1] > chunk or prev.shape[2] > action_dim \
            or prev.shape[1] < 1:
        raise InputError(f"prev_chunk_left_over: expected [{batch}, 1..{chunk}, <= {action_dim}], got "
                         f"{tuple(prev_chunk_left_over.shape)}")
    if not isinstance(inference_delay, int) or isinstance(inference_delay, bool) or inference_delay < 0:
        raise InputError(f"inference_delay: a non-negative integer, got {inference_delay!r}")
    horizon = options.execution_horizon if execution_horizon is None else execution_horizon
    if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 0:
        raise InputError(f"execution_horizon: a non-negative integer, got {horizon!r}")
    horizon = min(horizon, prev.shape[1])
    padded = torch.zeros(batch, chunk, action_dim, dtype=torch.float32, device=prev.device)
    padded[:, :prev.shape[1], :prev.shape[2]] = prev
    weights = prefix_weights(inference_delay, horizon, chunk, options.schedule).to(prev.device)
    return RTCInputs(prev=padded, weights=weights, max_guidance_weight=float(options.max_guidance_weight))


def step_factors(num_steps: int, max_guidance_weight: float) -> tuple:
    """(dt, ca, cb), ca and cb [num_steps] fp32: at flow step s a row of prefix weight w takes the guided step
    x <- x + a v + b (prev - x) with a = dt + ca[s] w, b = cb[s] w (module docstring: a = dt (1 - g w t),
    b = -dt g w), LeRobot's times t = 1 + s dt, dt = -1 / num_steps."""
    dt = -1.0 / num_steps
    times = [1.0 + s * dt for s in range(num_steps)]
    g = torch.tensor([guidance_weight(t, max_guidance_weight) for t in times], dtype=torch.float32)
    return dt, -dt * g * torch.tensor(times, dtype=torch.float32), -dt * g


def step_coefficients(weights: torch.Tensor, num_steps: int, max_guidance_weight: float) -> tuple:
    """(a, b) [num_steps, chunk] fp32 of the prefix weights `weights` [chunk] (`step_factors`)."""
    dt, ca, cb = step_factors(num_steps, max_guidance_weight)
    w = weights.float().cpu()[None]
    return (dt + ca[:, None] * w).to(weights.device), (cb[:, None] * w).to(weights.device)


def guided_step(x_t: torch.Tensor, v: torch.Tensor, rtc: RTCInputs, time: float, dt: float) -> torch.Tensor:
    """One Euler step with LeRobot's guidance, as LeRobot writes it (the reference engines use this):
    x_t + dt * (v - g * (prev - (x_t - time * v)) * w)."""
    g = guidance_weight(time, rtc.max_guidance_weight)
    err = (rtc.prev - (x_t - time * v)) * rtc.weights[None, :, None]
    return x_t + dt * (v - g * err)


__all__ = ["RTCInputs", "RTCOptions", "SCHEDULES", "guidance_weight", "guided_step", "options_from_lerobot",
           "prefix_weights", "rtc_inputs", "step_coefficients", "step_factors"]
