"""What every prefix + flow-expert engine shares, whatever its model: the flow state's static buffers (noise,
actions, the real-time-chunking guidance), weights quantized once at build, observation staging into the
static buffers, prefix sharing with a caller (a contract's persistent buffers), and the RTC-guided Euler step.

A model's engine subclasses `FlowEngine` with:
- `Buffers`: a dataclass with `FlowBuffers`' fields plus its own (camera images, prompt, prefix K/V, ...),
  whose `allocate(weights, batch, device, dtype, vision_dtype)` makes them once per batch size;
- `OBSERVATION`: the buffers `set_observation` fills, in argument order (slicing past the given camera
  slots / prompt tokens clears the rest: `_staging_views`);
- `PREFIX`: PrefixCache field -> buffer name, for `share_prefix` / `set_prefix`;
- `check_observation(...)` / `check_prefix(prefix) -> batch`: its input checks (nothing is written before
  they pass);
- its stages (`_observe_body`, `_act_body`: `flashrt_core.engine.staged`).
Graphs, hooks and launch settings: `StagedEngine`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from flashrt_core.engine.staged import StagedEngine, _same
from flashrt_core.errors import InputError
from flashrt_core.models.precision import parse_precision, quantize
from flashrt_core.models.rtc import RTCInputs, step_coefficients


@dataclass
class FlowBuffers:
    """The flow state of a decision: noise in, actions out, and the "act+rtc" graph's guidance: the previous
    chunk's unexecuted actions (zero padded) and the guided Euler step's coefficients
    x <- x + a[step, row] v + b[step, row] (prev - x) (`models.rtc`)."""

    noise: torch.Tensor  # [B, chunk, action_dim] fp32
    actions: torch.Tensor  # [B, chunk, action_dim] fp32
    rtc_prev: torch.Tensor  # [B, chunk, action_dim] fp32
    rtc_a: torch.Tensor  # [num_steps, chunk] fp32
    rtc_b: torch.Tensor  # [num_steps, chunk] fp32

    @staticmethod
    def flow_fields(batch: int, chunk: int, action_dim: int, num_steps: int, device) -> dict:
        shape = (batch, chunk, action_dim)
        zeros = dict(dtype=torch.float32, device=device)
        return dict(noise=torch.zeros(shape, **zeros), actions=torch.zeros(shape, **zeros),
                    rtc_prev=torch.zeros(shape, **zeros), rtc_a=torch.zeros(num_steps, chunk, **zeros),
                    rtc_b=torch.zeros(num_steps, chunk, **zeros))


class FlowEngine(StagedEngine):
    """The model-neutral half of a prefix + flow-expert engine (see the module docstring)."""

    Buffers = FlowBuffers
    OBSERVATION: tuple[str, ...] = ()  # set_observation's buffers, in argument order: [B, slots|tokens, ...]
    PREFIX: dict[str, str] = {}  # PrefixCache field -> buffer

    def __init__(self, weights, device=None, dtype: torch.dtype | None = None, *,
                 vision_dtype: torch.dtype | None = None, batch: int = 1, precision=None, **launch):
        """weights: the model's engine layout, moved to `device` / `dtype` when given (default: where they
        are). vision_dtype: the vision tower's dtype (default: the weights' own where `Weights.to(vision_dtype=)`
        set one apart from the matrices, else `dtype`). batch: the batch size the buffers are allocated for (a
        call with another batch reallocates them). precision: a `models.precision` preset or Precision
        (default bf16: every weight in `dtype`); quantized weights are made here, once. `launch`: backend,
        graphs, gemm, pdl, tune_attention, tuning_cache (`StagedEngine`)."""
        device = torch.device(device) if device is not None else weights.action_in_w.device
        dtype = dtype or weights.action_in_w.dtype
        if vision_dtype is None:  # a vision tower the weights keep in another dtype stays so
            own = weights.vision_dtype
            vision_dtype = own if own != weights.action_in_w.dtype else dtype
        self.vision_dtype = vision_dtype
        w = weights.to(device=device, dtype=dtype, vision_dtype=self.vision_dtype)
        self.precision = parse_precision(precision)
        t0 = time.perf_counter()
        w = quantize(w, self.precision, packed=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.quantize_s = time.perf_counter() - t0  # (made at every build: bench_precision reports it)
        super().__init__(device, **launch)
        self.weights, self.config, self.dtype = w, w.config, dtype
        # the Euler step's gate: dt per action dim (a static buffer the act graphs read)
        self._dt = torch.full((w.action_out_w.shape[0],), float(w.dt), dtype=torch.float32, device=device)
        self.buffers = self.Buffers.allocate(w, batch, device, dtype, self.vision_dtype)
        self._staging: dict[tuple, tuple] = {}  # set_observation's views of `buffers` (_staging_views)

    @property
    def batch(self) -> int:
        return self.buffers.noise.shape[0]

    # ---- the model's input checks -------------------------------------------------------------------
    def check_observation(self, *observation) -> None:
        raise NotImplementedError

    def check_prefix(self, prefix) -> int:
        raise NotImplementedError

    # ---- real-time chunking -------------------------------------------------------------------------
    def set_rtc(self, rtc: RTCInputs) -> None:
        """The guidance of the next `act(rtc=True)`: the padded previous chunk and the per-step coefficients of
        `rtc.weights` (`models.rtc.step_coefficients`) into the RTC buffers."""
        buf, c = self.buffers, self.config
        if tuple(rtc.prev.shape) != tuple(buf.rtc_prev.shape):
            raise InputError(f"rtc.prev: expected {tuple(buf.rtc_prev.shape)}, got {tuple(rtc.prev.shape)}")
        a, b = step_coefficients(rtc.weights, c.num_steps, rtc.max_guidance_weight)
        torch._foreach_copy_([buf.rtc_prev, buf.rtc_a, buf.rtc_b], [rtc.prev, a, b])

    def _guided_update(self, x_t: torch.Tensor, v: torch.Tensor, step: int) -> None:
        """x_t <- x_t + a[step] v + b[step] (prev - x_t), in place (fp32): LeRobot's RTC-guided Euler step."""
        buf = self.buffers
        d = buf.rtc_prev - x_t
        x_t.addcmul_(v.float(), buf.rtc_a[step][None, :, None]).addcmul_(d, buf.rtc_b[step][None, :, None])

    # ---- staged API (copies into the static buffers) ------------------------------------------------
    def _resize(self, batch: int) -> None:
        if batch != self.batch:  # a new batch size needs new buffers and therefore new graphs
            self.buffers = self.Buffers.allocate(self.weights, batch, self.device, self.dtype, self.vision_dtype)
            self._graphs.clear()
            self._staging.clear()

    def set_observation(self, *observation) -> None:
        """Copy one observation into the buffers (`OBSERVATION`, in order: [B, slots or tokens, ...] each);
        what is past the given slots / tokens is masked. Everything is checked before anything is written
        (`check_observation`): a refused call leaves the buffers as they were."""
        self.check_observation(*observation)
        self._write_observation(*observation)

    def _write_observation(self, *observation) -> None:
        """set_observation's copies, after its checks: two multi-tensor calls (the copies, then the masks and
        tails past them cleared) over views made once per (buffers, shapes). The host time of these calls is
        part of every decision (the graph launch waits for it): 55 us p50 on the H200 machine against 82 for
        separate slicings and copies (benchmarks/results/set_observation_host_h200.json)."""
        self._resize(observation[0].shape[0])
        dst, tails = self._staging_views(tuple(t.shape[1] for t in observation))
        torch._foreach_copy_(dst, list(observation))
        if tails:
            torch._foreach_zero_(tails)

    def _staging_views(self, widths: tuple[int, ...]) -> tuple[list, list]:
        """([the first `width` rows (dim 1) of each OBSERVATION buffer], [the views past them that a write
        clears: every buffer but the first, whose unused slots are masked by the others]), kept until
        `_resize` replaces the buffers."""
        if widths not in self._staging:
            bufs = [getattr(self.buffers, n) for n in self.OBSERVATION]
            dst = [b[:, :w] for b, w in zip(bufs, widths)]
            tails = [b[:, w:] for b, w in zip(bufs[1:], widths[1:]) if b[:, w:].numel()]
            self._staging[widths] = (dst, tails)
        return self._staging[widths]

    def share_prefix(self, prefix) -> None:
        """Make the tensors of `prefix` (a caller's persistent buffers, e.g. a contract's: same shapes, dtypes
        and device as the engine's) the engine's own prefix buffers: observe writes into them and act reads
        them, with no copy either way. Graphs captured before are dropped (they hold the old addresses)."""
        b = self.check_prefix(prefix)
        if b != self.batch:
            raise InputError(f"prefix: batch {b} but the engine holds batch {self.batch}")
        buf = self.buffers
        for field, name in self.PREFIX.items():
            src, dst = getattr(prefix, field), getattr(buf, name)
            if src.dtype != dst.dtype or src.device != dst.device or src.shape != dst.shape:
                raise InputError(f"prefix.{field}: {tuple(src.shape)} {src.dtype} on {src.device}, the engine's is "
                                 f"{tuple(dst.shape)} {dst.dtype} on {dst.device}")
        self.buffers = dataclasses.replace(buf, **{name: getattr(prefix, f) for f, name in self.PREFIX.items()})
        self._graphs.clear()
        self._staging.clear()

    def set_prefix(self, prefix) -> None:
        """Make `prefix` the cached prefix (a no-op when it already views the engine's buffers). Every field is
        checked (shape, dtype) before anything is copied."""
        b = self.check_prefix(prefix)
        if b != self.batch:
            raise InputError(f"prefix: batch {b} but the engine holds batch {self.batch}")
        self._copy_prefix(prefix)

    def _copy_prefix(self, prefix) -> None:
        for field, name in self.PREFIX.items():
            src, dst = getattr(prefix, field), getattr(self.buffers, name)
            if not _same(src, dst):
                dst.copy_(src)
