"""The Runtime: a contract, a model binding and its buffers, stepped by a clock the caller supplies.

`step(now_ns)` plans the due stages from host-side bookkeeping only (no device reads), runs their host
parts (tokenize, stage inputs, draw noise), then their device parts as CUDA graphs (per stage or per plan)
or eagerly on CPU, and returns the action chunk if the output stage ran. The only host sync of a decision
is at its end, to hand the actions back. Deferred stages (contract `deferred: true`, e.g. pi0.5's observe)
are launched after that copy: the step returns without waiting for them, the next step's stages queue behind
them on the same stream, and their outputs count from the next step (the scheduler plans them that way).
"""
from __future__ import annotations

import atexit
import gc
import hashlib
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from flashrt_core.contract import host_state, inputs
from flashrt_core.contract.buffers import host_copy, TORCH_DTYPES, BufferSet
from flashrt_core.contract.graphs import GraphCache
from flashrt_core.contract.schedule import Scheduler
from flashrt_core.contract.spec import Contract, configured_contract
from flashrt_core.errors import InputError

# Runtimes whose warmup froze the collector's heap (gc.freeze) and that are not closed yet: the last one to
# close leaves the heap unfrozen (see Runtime.warmup / close).
_GC_FROZEN: "weakref.WeakSet[Runtime]" = weakref.WeakSet()


@atexit.register
def _unfreeze_at_exit() -> None:
    """At interpreter exit, the heap a warm-up froze is collected before the modules are torn down: frozen, its
    Triton objects would outlive their bindings, which nanobind reports as ~30 lines of leaks (every Ctrl-C)."""
    if _GC_FROZEN:
        gc.unfreeze()
        gc.collect()


@dataclass
class StepResult:
    actions: np.ndarray | None  # [horizon, action_dim] float32, or None (see reason)
    ran: list[str]
    decision_id: int | None  # 1-based count of decisions, when this step made one
    observation_age_ms: float | None  # now - stamp of the observation behind the (would-be) actions
    latency_ms: float  # host wall time of the step, including the final sync (and deferred launches)
    reason: str | None = None
    stage_latency_ms: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    now_ns: int = 0
    observation_stamp_ns: int | None = None  # stamp of the observation behind the (would-be) actions
    prefix_id: int | None = None  # version of the observation stage's outputs the actions were made from
    deferred: list[str] = field(default_factory=list)  # stages launched after the actions (their outputs
    # count from the next step); their stage_latency_ms is host time only. Their device time is reported in
    # deferred_latency_ms: on CUDA by a later step (the first one that synchronizes), on CPU by this one.
    deferred_latency_ms: dict[str, float] = field(default_factory=dict)
    actions_ms: float | None = None  # host wall time until the actions were on the host (the critical path)
    host_latency_ms: dict[str, float] = field(default_factory=dict)  # host part of each stage that ran
    # (inputs staged, tokenize, noise; included in its stage_latency_ms entry)

    def completed_stage_ms(self) -> dict[str, float]:
        """Latency of every stage (or graph group) that completed by the end of this step: those it ran in
        order, and deferred ones whose device time it read back. A stage this step deferred is left out
        (its entry here is its host part only); a later step reports it. For latency statistics."""
        deferred = set(self.deferred)
        out = {k: v for k, v in self.stage_latency_ms.items() if deferred.isdisjoint(k.split("+"))}
        for k, v in self.deferred_latency_ms.items():
            out[k] = out.get(k, 0.0) + v
        return out


class StageIO:
    """What a binding's host part may touch: host buffers, input host copies, device staging, the RNG."""

    def __init__(self, buffers: BufferSet, generator: torch.Generator):
        self._b = buffers
        self.generator = generator
        self.now_ns = 0  # the step's clock (`Runtime.step(now_ns)`), for host parts that depend on time
        self.stage_ms: dict[str, float] = {}  # each stage's latest measured latency (ms), for host parts that adapt

    def host(self, name: str) -> torch.Tensor:
        """A host-placed buffer or the host copy of an input (read or write in place)."""
        return self._b.host_view(name)

    def to_device(self, name: str, value: torch.Tensor) -> None:
        """Copy a CPU tensor into a device buffer, asynchronously on CUDA."""
        dst = self._b.tensors[name]
        if dst.device.type == "cpu":
            dst.copy_(value)
        else:
            self._b.h2d.copy(name, dst, value)


class Runtime:
    def __init__(self, contract: Contract, binding_cls=None, device="cpu", seed: int = 0, tokenizer=None,
                 debug_graphs: bool = False, capsule_budget_mb: Mapping | None = None, capsule_eviction: str = "none",
                 capsule_dir=None):
        from flashrt_core.capsule.options import capsule_options

        # checked before anything is built; the store itself is made at warmup (or at the first capsule verb)
        self.capsule_options = capsule_options(capsule_budget_mb, capsule_eviction, capsule_dir)
        if binding_cls is None:
            from flashrt_core.contract.bindings import resolve_binding

            binding_cls = resolve_binding(contract.model.name)
        self.contract = contract
        self.device = torch.device(device)
        self.seed = int(seed)
        self.dtype = TORCH_DTYPES[contract.model.dtype]
        self.binding = binding_cls(contract.model, contract.dims, self.device, self.dtype, self.seed, tokenizer)
        self.buffers = BufferSet(contract, self.device)
        self.binding.attach_buffers(self.buffers.tensors)  # (an engine that works in the contract's buffers)
        self.scheduler = Scheduler(contract)
        self.generator = torch.Generator().manual_seed(self.seed)  # host RNG: same noise on CPU and CUDA
        # A binding whose engine replays its own CUDA graphs (the fused pi0.5 engine) runs its stages
        # eagerly here: a graph launch inside another graph's capture is not something to rely on.
        own = getattr(self.binding, "owns_graphs", False)
        self.graphs = GraphCache(self.buffers, enabled=contract.graphs != "off" and not own, debug=debug_graphs)
        if own:
            self.binding.debug_graphs(debug_graphs)
        self.capsules = None  # created lazily by flashrt_core.capsule (snapshot/restore/fork verbs)
        self._io = StageIO(self.buffers, self.generator)
        self._device_parts = {s: self.binding.device_part(s) for s in contract.stages}
        # The stage upstream of the output that reads observation inputs (observe): its output version is
        # the id of the prefix that actions were made from.
        out = contract.output_stage()
        self._observation_stage = next(
            (n for n in contract.stages if (n in contract.upstream(out) or n == out)
             and any(contract.buffers[b].is_input for b in contract.stages[n].reads)
             and contract.stages[n].trigger.rate_hz is not None), None)
        self._prompt: str | None = None
        self._last_stamp: int | None = None
        self._weights_digest: str | None = None
        self._lock = threading.RLock()  # ROS callbacks may set inputs while a timer steps
        self._deferred_events: list = []  # CUDA events of deferred stages not read yet
        self._in_on_actions: int | None = None  # the thread inside an on_actions callback, if any
        self._warmed = False  # an engine that owns its graphs has captured them (warmup)
        self.warmup_s: float | None = None  # seconds the last warmup() took
        # restores keep the observation inputs live (not rewound) and re-stage every device input copy
        self._live_inputs = frozenset(n for n, b in contract.buffers.items() if b.is_input and n != "prompt")
        self._restage = dict.fromkeys(self.buffers.device_version, -1)

    @classmethod
    def from_config(cls, path, device="cpu", seed: int = 0, checkpoint=None, dtype=None, tokenizer=None, *,
                    rates: Mapping[str, float] | None = None, max_observation_age_ms: float | None = None,
                    num_cameras: int | None = None, limits: Mapping[str, Any] | None = None,
                    options: Mapping[str, Any] | None = None, deferred: Mapping[str, bool] | None = None,
                    binding=None, debug_graphs: bool = False, capsule_budget_mb: Mapping | None = None,
                    capsule_eviction: str = "none", capsule_dir=None):
        """Load and validate a contract, apply overrides (e.g. ROS parameters), build the model and buffers.

        `rates` {stage: hz}, `max_observation_age_ms`, `limits` and `options` (model options; `num_cameras`
        is options["views"]) and `deferred` {stage: bool} override the file; the result is validated again
        as a whole. Capsules: `capsule_budget_mb` {tier: MB or None} bounds the device / host / disk tiers
        (defaults in capsule.options: 1024 / 2048 / 10240 MB); `capsule_eviction` 'none' refuses a capsule
        that does not fit, 'oldest' drops the tier's oldest capsules for it; `capsule_dir` keeps the disk
        tier in a folder that outlives the runtime (the capsules found there are listed again)."""
        contract = configured_contract(path, checkpoint, dtype, rates=rates,
                                       max_observation_age_ms=max_observation_age_ms, num_cameras=num_cameras,
                                       limits=limits, options=options, deferred=deferred, binding=binding,
                                       device=device)
        return cls(contract, binding, device=device, seed=seed, tokenizer=tokenizer, debug_graphs=debug_graphs,
                   capsule_budget_mb=capsule_budget_mb, capsule_eviction=capsule_eviction, capsule_dir=capsule_dir)

    # ---- inputs ------------------------------------------------------------------------------------------
    def _not_in_on_actions(self, what: str) -> None:
        """The step that called on_actions has not committed yet: re-entering would corrupt its ledger."""
        if self._in_on_actions == threading.get_ident():
            raise RuntimeError(f"Runtime.{what} cannot be called from inside an on_actions callback "
                               "(the step is not finished: call it after step returns)")

    def set_prompt(self, text: str) -> None:
        self._not_in_on_actions("set_prompt")
        spec = self.contract.buffers.get("prompt")
        if spec is None:
            raise InputError("prompt: this contract has no prompt input")
        data = inputs.encode_prompt(text, spec.shape[0])
        with self._lock:
            if text == self._prompt:
                return  # the same command again is not a change; nothing re-encodes
            check = getattr(self.binding, "check_prompt", None)  # the model's own limits (token count)
            if check is not None:
                check(text)
            self.buffers.host_view("prompt").copy_(torch.from_numpy(data))
            self.buffers.ledger.write_input("prompt", None)
            self._prompt = text

    def set_observation(self, images=None, state=None, stamp_ns: int = 0) -> None:
        self._not_in_on_actions("set_observation")
        b = self.contract.buffers
        writes: dict[str, np.ndarray] = {}
        for name, given in (("images", images), ("state", state)):
            if name in b and given is None:
                raise InputError(f"{name}: required by this contract")
            if name not in b and given is not None:
                raise InputError(f"{name}: this contract has no {name} input")
        if "images" in b:
            writes["images"], mask = inputs.check_images(images, b["images"].shape)
            if "image_mask" in b:
                writes["image_mask"] = mask
        if "state" in b:
            writes["state"] = inputs.check_state(state, b["state"].shape)
        with self._lock:
            stamp = inputs.check_stamp(stamp_ns, self._last_stamp)
            for name, arr in writes.items():
                host_copy(self.buffers.host_view(name), arr)
                self.buffers.ledger.write_input(name, stamp)
            self._last_stamp = stamp

    # ---- stepping ----------------------------------------------------------------------------------------
    def step(self, now_ns: int, on_actions=None) -> StepResult:
        """Run the stages due at `now_ns` (see the module doc). `on_actions(result)`, when given, is called as
        soon as the actions are on the host, before the deferred stages' work is launched (publish there:
        an observe tick then hands its actions over after about one act). In that call the actions,
        decision id, ages, stamps and prefix id are final; `latency_ms` is the time to the actions, and the
        fields about deferred stages may still change (the returned result is the same object, completed).
        An exception from on_actions is raised after the step has finished its work. Inside on_actions the
        runtime may not be stepped, fed or rewound (RuntimeError)."""
        self._not_in_on_actions("step")
        with self._lock, torch.no_grad():
            return self._step(int(now_ns), on_actions)

    def _step(self, now_ns: int, on_actions) -> StepResult:
        t_start = time.perf_counter()
        ledger = self.buffers.ledger
        plan = self.scheduler.plan(now_ns, ledger)
        self._io.now_ns = now_ns
        cuda = self.device.type == "cuda"
        stage_ms: dict[str, float] = {}
        host_ms: dict[str, float] = {}
        self._host_parts([s for s in plan.runs if s not in plan.deferred], stage_ms, host_ms)
        device_stages = [s for s in plan.runs if self._device_parts[s] is not None]
        inline = [s for s in device_stages if s not in plan.deferred]
        events = self._launch(inline, stage_ms)
        out_stage = self.scheduler.output_stage
        if out_stage in plan.deferred:  # the contract validation makes this impossible; never copy stale actions
            raise RuntimeError(f"stage {out_stage} writes the output but was planned as deferred")
        actions = None
        if out_stage in plan.runs:
            actions = self.buffers.tensors[self.contract.output].to("cpu", copy=True).numpy()
        elif cuda and inline:
            torch.cuda.current_stream().synchronize()  # so latency covers the work launched
        # Everything launched before the sync above is complete now, deferred stages of earlier steps too.
        deferred_ms = self._collect_done()
        for key, start, end in events:
            stage_ms[key] = stage_ms.get(key, 0.0) + start.elapsed_time(end)
        reason = None
        if actions is None:
            reason = plan.skipped.get(out_stage) or f"{out_stage} is not due at this tick"
        prefix_id = None
        observed = self.contract.stages[self._observation_stage].writes[0] if self._observation_stage else None
        if observed is not None and actions is not None:  # the prefix the actions were made from
            prefix_id = plan.output_versions[observed]
        to_actions_ms = (time.perf_counter() - t_start) * 1e3
        self._io.stage_ms.update({s: stage_ms[s] for s in inline if s in stage_ms})
        result = StepResult(actions=actions, ran=list(plan.runs),
                            decision_id=ledger.decisions + 1 if actions is not None else None,  # once committed
                            observation_age_ms=plan.age_ms(out_stage), latency_ms=to_actions_ms, reason=reason,
                            stage_latency_ms=stage_ms, skipped=dict(plan.skipped), now_ns=now_ns,
                            observation_stamp_ns=plan.stamps.get(out_stage), prefix_id=prefix_id,
                            deferred=list(plan.deferred), deferred_latency_ms=deferred_ms,
                            actions_ms=to_actions_ms if actions is not None else None, host_latency_ms=host_ms)
        callback_error = None
        if on_actions is not None and actions is not None:
            self._in_on_actions = threading.get_ident()
            try:
                on_actions(result)
            except Exception as exc:  # noqa: BLE001 (raised again once the step is consistent)
                callback_error = exc
            finally:
                self._in_on_actions = None
        # Deferred stages go last: off the critical path, behind the actions' copy. On CUDA they run on the
        # same stream, so the next step's stages wait for them without a host sync. A deferred host part that
        # fails takes its stage out of the plan before the commit (it did not run; it stays due), and the
        # step still returns the actions it made.
        for s in list(plan.deferred):
            if s in plan.deferred:
                try:
                    self._host_parts([s], stage_ms, host_ms)
                except Exception as exc:  # noqa: BLE001 (any failure: the stage did not run; say why)
                    self.scheduler.drop(plan, s, f"failed in its host part: {type(exc).__name__}: {exc}")
        self.scheduler.commit(plan, ledger)
        later = [s for s in plan.deferred if self._device_parts[s] is not None]  # those whose host part ran
        later_ms: dict[str, float] = {}  # on CPU the deferred device parts finish here: report them now
        self._deferred_events += self._launch(later, later_ms)
        for key, ms in later_ms.items():
            deferred_ms[key] = deferred_ms.get(key, 0.0) + ms
        if actions is not None and self.capsules is not None:
            from flashrt_core.capsule.runtime_verbs import record_decision

            record_decision(self)  # the optional time-travel ring of recent decisions (after deferred writes)
        if observed is not None and actions is None:
            result.prefix_id = ledger.buffers[observed].version
        result.ran, result.deferred, result.skipped = list(plan.runs), list(plan.deferred), dict(plan.skipped)
        result.latency_ms = (time.perf_counter() - t_start) * 1e3
        if callback_error is not None:
            raise callback_error
        return result

    def _host_parts(self, stages: list[str], stage_ms: dict[str, float], host_ms: dict[str, float]) -> None:
        """Stage inputs and run the host parts (they never read device results) of `stages`, in order."""
        for s in stages:
            t = time.perf_counter()
            self.buffers.refresh_inputs(self.contract.stages[s].reads)
            self.binding.host(s, self._io)
            stage_ms[s] = host_ms[s] = (time.perf_counter() - t) * 1e3

    def _launch(self, stages: list[str], stage_ms: dict[str, float]) -> list:
        """Run the device parts of `stages` (grouped per stage or per plan, as CUDA graphs where enabled).
        On CUDA returns (key, start, end) events still to be read; on CPU adds wall ms to stage_ms."""
        if not stages:
            return []
        cuda = self.device.type == "cuda"
        bufs = self.buffers.tensors
        groups = [stages] if self.contract.graphs == "plan" else [[s] for s in stages]
        events = []
        for group in groups:
            fns = self._group_parts(group)
            key = "+".join(group)
            start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                start.record()
            self.graphs.run(tuple(group), lambda fns=fns: [fn(bufs) for fn in fns])
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events.append((key, start, end))
            else:
                stage_ms[key] = stage_ms.get(key, 0.0) + (time.perf_counter() - start) * 1e3
        return events

    def _fused_part(self, group: list[str]):
        """The binding's own device callable for a plan group of two or more stages (`ModelBinding.device_plan`),
        or None."""
        return self.binding.device_plan(group) if len(group) > 1 else None

    def _group_parts(self, group: list[str]) -> list:
        """The device callables of one plan group: the binding's own for the whole group where it has one,
        else each stage's part in turn."""
        fused = self._fused_part(group)
        return [fused] if fused is not None else [self._device_parts[s] for s in group]

    def _collect_done(self) -> dict[str, float]:
        """GPU ms of the deferred stages of earlier steps that have completed (the rest stay pending)."""
        out: dict[str, float] = {}
        pending = []
        for key, start, end in self._deferred_events:
            if end.query():
                out[key] = out.get(key, 0.0) + start.elapsed_time(end)
            else:
                pending.append((key, start, end))
        self._deferred_events = pending
        return out

    def warmup(self, freeze_gc: bool = True) -> None:
        """Capture the graphs of the usual plans now (configure time) rather than at their first tick, and
        make the capsule store ready (weights digest, spare slabs, copy paths: capsule.runtime_verbs.prepare)
        so that the first snapshot is as fast as the later ones. `warmup_s` says how long it took (Triton
        compiles and kernel tuning of a first start on a GPU).

        freeze_gc (default): last, one full garbage collection and then `gc.freeze()`, so that the objects
        alive now (torch, Triton, the weights, graphs, buffers: hundreds of thousands in a GPU process) are
        never walked by Python's cyclic collector again. Otherwise a generation-2 collection, which CPython
        starts on its own when enough objects survived, walks all of them inside some tick (tens of ms on a
        full-size model's process). Frozen objects are still freed by reference counting as usual; only a
        reference cycle among them would wait for `close()`, which unfreezes the heap (and collects) when the
        last runtime that froze it closes. This is process-wide: objects made after the warm-up (a tick's,
        the capsules') are collected as before."""
        started = time.perf_counter()
        stages = [s for s in self.contract.stages if self._device_parts[s] is not None]
        bufs = self.buffers.tensors
        if self.contract.graphs != "plan":
            plans = [[s] for s in stages]
        else:  # every stage (first tick), the output alone, and with deferred stages: those around them
            inline = [s for s in stages if not self.contract.stages[s].deferred]
            later = [s for s in stages if self.contract.stages[s].deferred]
            plans = []
            for group in (stages, [self.scheduler.output_stage], inline, later):
                if group and group not in plans:
                    plans.append(group)
        with self._lock, torch.no_grad():
            for group in plans:
                fns = self._group_parts(group)
                if tuple(group) not in self.graphs and self.graphs.enabled:
                    saved = self.buffers.clone_all()
                    self.graphs.run(tuple(group), lambda fns=fns: [fn(bufs) for fn in fns])
                    self.buffers.load_all(saved)  # the capture's replay ran on zeros; undo it
            if getattr(self.binding, "owns_graphs", False) and not self._warmed:
                # An engine that captures its own graphs does so (and tunes its kernels) at a stage's first
                # run: run every stage once now, on the buffers as they are, and put them back.
                saved = self.buffers.clone_all()
                for s in stages:
                    self._device_parts[s](bufs)
                if self.contract.graphs == "plan":  # the plans the binding runs as one (its own graph)
                    for fused in filter(None, map(self._fused_part, plans)):
                        fused(bufs)
                self.buffers.load_all(saved)
                self._warmed = True
            from flashrt_core.capsule import runtime_verbs

            runtime_verbs.prepare(self)
            if freeze_gc:
                gc.collect()  # (garbage made so far is freed, not frozen)
                gc.freeze()
                _GC_FROZEN.add(self)
        self.warmup_s = time.perf_counter() - started

    # ---- state for capsules ----------------------------------------------------------------------------
    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """Every persistent buffer, as the live tensors (copy them; write into them only to restore)."""
        return self.buffers.persistent()

    def runtime_meta(self) -> dict:
        """Host-side state that goes with the persistent buffers at a decision boundary (contract.host_state)."""
        return host_state.runtime_meta(self)

    def check_meta(self, meta: Mapping) -> None:
        """Raise CapsuleError naming the field if `apply_meta(meta)` could fail or mix another contract's
        state into this one; capsule restores call it before the first byte moves (contract.host_state)."""
        host_state.check_meta(self, meta)

    def apply_meta(self, meta: Mapping, rewind_time: bool = True) -> None:
        """Restore host-side state from `runtime_meta()` output (the capsule restores the buffers). Observation
        inputs stay live; rewind_time=False also keeps the rate clocks and the input watermark as they are
        now (a live restore; see contract.host_state)."""
        host_state.apply_meta(self, meta, rewind_time)

    def fingerprint_fields(self) -> dict:
        """model identity, weights digest, precision and persistent-buffer layout (see capsule.fingerprint)."""
        if self._weights_digest is None:
            self._weights_digest = weights_digest(self.binding.weights())
        layout = {n: (tuple(b.shape), b.dtype) for n, b in self.contract.buffers.items() if b.persistent}
        return {"model": self.binding.identity(), "weights_digest": self._weights_digest,
                "precision": self.contract.model.dtype, "layout": layout}

    # ---- description -----------------------------------------------------------------------------------
    def stage_rates(self) -> dict[str, float]:
        """Rate of every rate-triggered stage (Hz)."""
        return {n: s.trigger.rate_hz for n, s in self.contract.stages.items() if s.trigger.rate_hz is not None}

    def set_timer_slack(self, slack_ms: float) -> None:
        """Let a step up to `slack_ms` before a stage's due time run that stage (for wakes by real timers,
        which fire with jitter); 0 (the default, and the simulated clock's) means exactly on the grid."""
        if slack_ms < 0:
            raise ValueError(f"timer slack must be >= 0 ms, not {slack_ms}")
        self.scheduler.slack_ns = int(slack_ms * 1e6)

    def describe(self) -> str:
        c = self.contract
        rates = ", ".join(f"{n} {hz:g} Hz" for n, hz in self.stage_rates().items())
        graphs = c.graphs if torch.device(self.device).type == "cuda" else "none (CPU)"
        return (f"{c.model.name} ({c.model.checkpoint or 'built-in weights'}) {c.model.dtype} on {self.device}, "
                f"{rates}, graphs {graphs}")

    def reset_clock(self) -> None:
        """The clock that steps and stamps count in jumped back (a simulation reset under use_sim_time, a
        stepped system clock). The rate stages are anchored again at the next step (each due then), and the
        next observation may carry any stamp. Buffers, prefix K/V, counters and capsules are kept; outputs
        computed from observations stamped on the old clock are refused for age (stamped in the future) until
        new ones arrive."""
        self._not_in_on_actions("reset_clock")
        with self._lock:
            for clock in self.scheduler.clocks.values():
                clock.t0, clock.n = None, 0
            self._last_stamp = None

    def has_observation(self) -> bool:
        """Whether every observation input has been set at least once."""
        led = self.buffers.ledger.buffers
        return all(led[n].version > 0 for n, b in self.contract.buffers.items() if b.is_input and n != "prompt")

    def close(self) -> None:
        """Drop graphs, buffers, weights and capsules (a temporary capsule folder is removed) so device memory
        can be freed."""
        with self._lock:
            if self.capsules is not None:
                self.capsules.close()
                self.capsules = None
            self.graphs = GraphCache(self.buffers, enabled=False)
            self.buffers.tensors.clear()
            self.binding = None
            self._device_parts = {}
            if self in _GC_FROZEN:  # the warm-up froze the heap (see warmup): cycles among what was dropped
                _GC_FROZEN.discard(self)  # here are found again; a runtime still warm keeps it frozen
                gc.unfreeze()
                gc.collect()
                if _GC_FROZEN:
                    gc.freeze()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    # ---- capsule verbs (implemented in flashrt_core.capsule.runtime_verbs) -------------------------------
    # Disk I/O (the disk tier, export, import) runs outside the runtime's lock: a step on another thread never
    # waits for it. Snapshot and restore hold the lock only while they copy from or into the live buffers.
    def snapshot(self, name: str, tier: str = "device") -> str:
        return self.begin_snapshot(name, tier)()

    def begin_snapshot(self, name: str, tier: str = "device"):
        """Copy the live buffers now, between two steps; -> the call that finishes the capsule and returns its id
        (for the disk tier it writes the files, holding nothing: a control loop runs that call off its thread)."""
        self._not_in_on_actions("snapshot")
        from flashrt_core.capsule import runtime_verbs

        with self._lock:
            return runtime_verbs.begin_snapshot(self, name, tier)

    def load_capsule(self, capsule_id: str):
        """A disk capsule's buffers read and verified (no lock held), for `restore(..., loaded=)`; None for a
        capsule in a memory tier."""
        from flashrt_core.capsule import runtime_verbs

        return runtime_verbs.load(self, capsule_id)

    def restore(self, capsule_id: str, rewind_time: bool = False, loaded=None) -> dict:
        """Live (default): the model state rewinds, the rate grid and input watermark go on from now.
        rewind_time=True: they return to the snapshot's too (re-fed observations replay it exactly).
        loaded: what `load_capsule` read for a disk capsule (else it is read here, under the lock)."""
        self._not_in_on_actions("restore")
        from flashrt_core.capsule import runtime_verbs

        with self._lock:
            meta = runtime_verbs.restore(self, capsule_id, rewind_time=rewind_time, loaded=loaded)
            self.binding.restored(self.buffers.tensors, rewind_time)
            return meta

    def fork(self, capsule_id: str, name: str) -> str:
        from flashrt_core.capsule import runtime_verbs

        return runtime_verbs.fork(self, capsule_id, name)  # (the store's own lock: no live buffer is touched)

    def configure_capsules(self, capsule_budget_mb: Mapping | None = None, capsule_eviction: str = "none",
                           capsule_dir=None) -> None:
        """Replace the capsule options (see from_config) while no capsule is held, and make the store ready."""
        from flashrt_core.capsule import runtime_verbs
        from flashrt_core.capsule.options import capsule_options

        with self._lock:
            runtime_verbs.reconfigure(self, capsule_options(capsule_budget_mb, capsule_eviction, capsule_dir))

    def list_capsules(self) -> list[dict]:
        from flashrt_core.capsule import runtime_verbs

        return runtime_verbs.list_capsules(self)

    def drop_capsule(self, capsule_id: str) -> None:
        from flashrt_core.capsule import runtime_verbs

        runtime_verbs.drop_capsule(self, capsule_id)  # (the store's lock: a disk capsule's folder goes, no step waits)

    def export_capsule(self, capsule_id: str, path) -> None:
        from flashrt_core.capsule import runtime_verbs

        runtime_verbs.export_capsule(self, capsule_id, path)  # (the store's lock while it copies, not the files')

    def import_capsule(self, path, tier: str = "host") -> str:
        from flashrt_core.capsule import runtime_verbs

        return runtime_verbs.import_capsule(self, path, tier)  # (files read and checked before the store's lock)

    @property
    def decisions(self) -> int:
        return self.buffers.ledger.decisions

    @property
    def prompt(self) -> str | None:
        return self._prompt


def weights_digest(named_tensors) -> str:
    """sha256 over (name, dtype, shape, bytes) of every weight, in name order; computed once per runtime."""
    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        shape = tuple(t.shape)
        t = t.detach().contiguous().reshape(-1)
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{shape}\n".encode())
        h.update(t.view(torch.uint8).cpu().numpy())  # (the array itself: a bytes copy halved the rate)
    return h.hexdigest()

