"""What every staged engine shares: stages captured as CUDA graphs over static buffers, hooks around them.

A model's engine (`models/paligemma/engine.py` and the action experts over it) writes two stage bodies,
`_observe_body(prefix_done=None)` and `_act_body(prefix_wait=None)`, over buffers at fixed addresses; this class
runs them:
- `observe()` / `act()`: each stage captured once as a CUDA graph (after a warm-up that compiles the Triton
  kernels and lets the GEMM and attention pickers time their candidates) and replayed;
- `decision()`: a whole decision as one graph of its own, the act stage on a second stream beside observe,
  each first-flow-step layer waiting only for its prefix layer (events announced by the bodies' callbacks);
- `run_stage(stage, pre, post, key)` / `run_decision(DecisionHooks, key)`: the same with a caller's copies
  recorded in the graph (one launch for a runtime's tick; hooks that cannot be captured run eagerly around
  the stage graphs, `hook_capture_errors` says why);
- the launch context of every kernel (no autograd, the stage's split-K ticket workspace, PDL on or off), the
  graphs (`engine.graphs.GraphSet`: one memory pool per engine, address checks with `debug_graphs`), and
  the act-graph ranking of the deferred GEMMs (`engine.rerank`).
Without CUDA (or with graphs off) the same bodies run eagerly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from flashrt_core import kernels as K
from flashrt_core.engine.attention import AttentionPicker
from flashrt_core.engine.gemm import LinearPicker
from flashrt_core.engine.graphs import GraphSet, warm_up
from flashrt_core.engine.rerank import rerank
from flashrt_core.engine.timing import cuda_samples
from flashrt_core.engine.tuning import TuningCache


@dataclass(frozen=True)
class DecisionHooks:
    """Callables (each optional) run around the stages of `Pi05Engine.run_decision`: fill the engine's buffers
    before a stage (pre), copy its results out after it (post)."""

    observe_pre: Callable[[], None] | None = None
    observe_post: Callable[[], None] | None = None
    act_pre: Callable[[], None] | None = None
    act_post: Callable[[], None] | None = None


def _call(fn) -> None:
    if fn is not None:
        fn()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a is the very buffer b (same memory and layout): metadata only, no device read."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class StagedEngine:
    """Stage graphs, hooks and launch settings over a subclass's stage bodies and static buffers (see the
    module docstring). Subclasses set `prefix_layers` (how many prefix layers `_observe_body` announces) and
    write `_observe_body` / `_act_body`."""

    name = "fused"
    prefix_layers = 0

    def __init__(self, device: torch.device, *, backend: str | None = None, graphs: bool | None = None,
                 gemm: str = "auto", pdl: bool = True, tune_attention: bool = True, tuning_cache="default"):
        """device: where the buffers and graphs live. backend: kernel backend (None = Triton where it runs,
        else the torch references; "torch"; "triton"). graphs: capture CUDA graphs (default: on CUDA; off is
        the fallback where capture fails). gemm: "auto" (time cuBLAS against the skinny Triton GEMM's
        configurations per shape on CUDA), "torch" (cuBLAS only: the fallback where the Triton GEMMs fail) or
        "triton" (always the first skinny configuration where the rows are few: for tests). pdl: launch the
        Triton kernels with programmatic dependent launch where the GPU supports it (sm_90+), so each
        kernel's launch and weight loads overlap the one before (off: the fallback for GPUs or drivers where
        it fails). tune_attention: time attention launch configurations per shape during warm-up (off: the
        kernel's own heuristic). tuning_cache: directory where the tuned GEMM and attention choices are kept
        per GPU and software ("default": $FLASHRT_TUNING_CACHE or ~/.cache/flashrt/tuning; None: tune in
        every process), or a `TuningCache`."""
        self.device = device
        self.backend = backend
        self.use_graphs = (device.type == "cuda") if graphs is None else bool(graphs)
        if self.use_graphs and device.type != "cuda":
            raise ValueError(f"graphs: CUDA graphs need a CUDA device, got {device}")
        self.pdl = bool(pdl)
        self.rerank_timings: dict = {}  # {GEMM key: {candidate: act graph ms}} of the ranking timed here
        self._reranked = False
        if isinstance(tuning_cache, TuningCache) or tuning_cache is None or tuning_cache is False:
            self.tuning_cache = tuning_cache or None
        else:  # choices tuned with PDL on are not those of PDL off: the setting is part of the context
            self.tuning_cache = TuningCache.for_device(device, tuning_cache, pdl=self.pdl)
        self.linear = LinearPicker(device, mode=gemm, cache=self.tuning_cache)
        self.attend = AttentionPicker(device, enabled=tune_attention, cache=self.tuning_cache)
        self._graphs = GraphSet(device, addresses=self._buffer_addresses)
        # Tickets of the split kernels' in-kernel reductions, one buffer per stage: the stage graphs may
        # replay concurrently on different streams (observe beside act) and must not share them.
        # (the decision graph has none of its own: its observe and act parts each enter their stage's)
        self._tickets = {stage: K.new_semaphore_workspace(device) for stage in ("observe", "act")}
        self._act_stream = None  # the decision graph's second stream (created on the first decision)
        # graphs that could not be captured, and why: run_stage / run_decision hooks ((stage, key)), "decision"
        self.hook_capture_errors: dict = {}

    # ---- stage bodies (a model's engine writes them) ------------------------------------------------------
    def _observe_body(self, prefix_done=None) -> None:
        """The `observe` stage over the static buffers; prefix_done(i) once prefix layer i is final (-1 first:
        what act reads before any layer)."""
        raise NotImplementedError

    def _act_body(self, prefix_wait=None, rtc: bool = False) -> None:
        """The `act` stage over the static buffers; prefix_wait(i) before its first read of prefix layer i;
        rtc: each Euler step guided towards the previous chunk (real-time chunking)."""
        raise NotImplementedError

    def _decision_body(self, hooks: DecisionHooks | None = None) -> None:
        """observe then act, each between its hooks; on CUDA the act stage (and its hooks) runs on a second
        stream that waits for each prefix layer's K/V only where its first flow step reads them (fork and
        join: capturable), so that flow step fills the SMs the prefix's kernels leave idle."""
        h = hooks or DecisionHooks()
        if self.device.type != "cuda":
            self._stage_between("observe", h.observe_pre, self._observe_body, h.observe_post)
            self._stage_between("act", h.act_pre, self._act_body, h.act_post)
            return
        main = torch.cuda.current_stream(self.device)
        if self._act_stream is None:
            self._act_stream = torch.cuda.Stream(self.device)
        side = self._act_stream
        ready = [torch.cuda.Event() for _ in range(self.prefix_layers + 1)]  # [0]: valid count, [i + 1]: layer i
        side.wait_stream(main)  # (fork: the buffers the caller filled before this decision)
        try:
            self._stage_between("observe", h.observe_pre,
                                lambda: self._observe_body(prefix_done=lambda i: ready[i + 1].record(main)),
                                h.observe_post)
            with torch.cuda.stream(side):
                self._stage_between("act", h.act_pre,
                                    lambda: self._act_body(prefix_wait=lambda i: side.wait_event(ready[i + 1])),
                                    h.act_post)
        finally:  # (join, also when a hook or the body raised: nothing may stay queued on the side stream)
            main.wait_stream(side)

    def _stage_between(self, stage: str, pre, body, post) -> None:
        """A stage's body between its hooks, under the stage's launch context."""
        with self._launch_context(stage):
            _call(pre)
            body()
            _call(post)

    # ---- graphs ---------------------------------------------------------------------------------------
    @property
    def captures(self) -> int:
        """How many graphs were captured and kept (tests and benchmarks read it)."""
        return self._graphs.captures

    @property
    def debug_graphs(self) -> bool:
        """Check before every replay that no buffer the graphs use moved since their capture."""
        return self._graphs.debug

    @debug_graphs.setter
    def debug_graphs(self, on: bool) -> None:
        self._graphs.debug = bool(on)

    def _buffer_addresses(self) -> dict[str, int]:
        """{name: data_ptr} of the tensors of the engine's static buffers (`buffers`, a dataclass of tensors)."""
        buf = getattr(self, "buffers", None)
        if buf is None or not dataclasses.is_dataclass(buf):
            return {}
        return {f.name: t.data_ptr() for f in dataclasses.fields(buf)
                if isinstance(t := getattr(buf, f.name), torch.Tensor)}

    def _launch_context(self, stage: str) -> contextlib.ExitStack:
        """What every kernel launch of a stage runs under: no autograd, the stage's ticket workspace, PDL on/off."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        if stage in self._tickets:
            stack.enter_context(K.semaphore_workspace(self._tickets[stage]))
        stack.enter_context(K.pdl_scope(self.pdl))
        return stack

    def _stage(self, name: str):
        """(the stage it launches as, its body) of a stage name: "observe", "act", or "act+rtc" (the act stage
        with real-time-chunking guidance: a graph of its own, under the act stage's launch context)."""
        if name == "observe":
            return "observe", self._observe_body
        if name == "act":
            return "act", self._act_body
        if name == "act+rtc":
            return "act", lambda prefix_wait=None: self._act_body(prefix_wait, rtc=True)
        raise ValueError(f"unknown stage {name!r} (observe, act, act+rtc)")

    def _run(self, name: str) -> None:
        """Run the stage `name` (`_stage`) on the current buffers: its graph (captured on first use), or eagerly."""
        stage, body = self._stage(name)
        if not self.use_graphs:
            with self._launch_context(stage):
                body()
            return
        if name not in self._graphs:
            self._capture(stage, body, name)
        self._graphs.replay(name)

    def run_stage(self, stage: str, pre=None, post=None, key: str = "hooks") -> None:
        """Run `observe` or `act` with `pre` (fill the engine's buffers from a caller's static buffers) and
        `post` (copy the results out) recorded in the same CUDA graph as the stage: one launch for all of
        it. pre / post may only launch device work on tensors that keep their addresses, never read values
        on the host, and must do the same thing at every call for a given `key` (captured on first use).
        Hooks that wait for the device (found by a warm-up under CUDA's sync debug mode) or whose capture
        fails run eagerly around the stage's own graph from then on (`hook_capture_errors` says why); other
        errors raised by pre / post in their first, eager run propagate."""
        name = stage
        stage, body = self._stage(name)

        def eager():  # the hooks around the stage's own graph
            _call(pre)
            self._run(name)
            _call(post)
        self._run_hooked(stage, (name, key), lambda: self._stage_between(stage, pre, body, post), eager)

    def run_decision(self, hooks: DecisionHooks, key: str = "hooks") -> None:
        """A whole decision (observe, then act) with hooks around each stage (`DecisionHooks`), recorded in one
        CUDA graph (`run_stage`'s rules for hooks apply to all four). The act stage reads the prefix the
        observe stage just wrote into the engine's buffers. On CUDA act_pre, the act stage and
        act_post run on the second stream beside observe_pre, the observe stage and observe_post, ordered only
        by the prefix layers' events: the act hooks may neither read nor write anything the observe side
        writes or reads (images, prompt, prefix K/V, pad mask, valid count, and whatever observe_pre reads /
        observe_post writes), and the observe hooks may not touch the act side's (noise, actions). Filling the
        noise in act_pre and copying the actions out in act_post is fine; copying a prefix in is not (the
        engine's buffers already hold this decision's)."""
        def eager():  # the hooks around the stage graphs
            _call(hooks.observe_pre)
            self._run("observe")
            _call(hooks.observe_post)
            _call(hooks.act_pre)
            self._run("act")
            _call(hooks.act_post)
        self._run_hooked("decision", ("decision", key), lambda: self._decision_body(hooks), eager)

    def _run_hooked(self, stage: str, name, whole, eager) -> None:
        """Replay the graph `name` of `whole` (`_hooked_graph`); where there is none, `eager()` runs the same
        work around the stage graphs."""
        if self._hooked_graph(stage, name, whole) is not None:
            self._graphs.replay(name)
            return
        with torch.no_grad():
            eager()

    def _hooked_graph(self, stage: str, name, whole) -> torch.cuda.CUDAGraph | None:
        """The graph `name` of `whole` (a stage body with hooks, or the decision), captured on first use; None
        where graphs are off or it could not be captured (`hook_capture_errors[name]` says why, once)."""
        if not self.use_graphs or name in self.hook_capture_errors:
            return None
        if name not in self._graphs:
            self._capture(stage, whole, name, tolerate=True)
        return self._graphs.get(name)

    def _capture(self, stage: str, body, name=None, tolerate: bool = False,
                 keep: bool = True) -> torch.cuda.CUDAGraph | None:
        """Warm up, then capture `body` as the graph `name` (default: `stage`); keep=False: return it without
        keeping or counting it."""
        # Warm up first (`graphs.warm_up`): Triton compiles, cuBLAS picks algorithms and the GEMM picker
        # times its candidates outside the capture (none of that may happen inside it).
        refused = None

        def warm():
            nonlocal refused
            self.linear.tuning = self.attend.tuning = True
            try:
                body()
            finally:
                self.linear.tuning = self.attend.tuning = False
                if self.tuning_cache is not None:
                    self.tuning_cache.save()
            if not tolerate:
                body()
                return
            # hooks that wait for the device (.item(), a blocking copy) cannot be captured: find out
            # here, not by a failed capture
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                body()
            except RuntimeError as exc:
                refused = f"waits for the device: {exc}"
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        warm_up(warm, self.device, context=lambda: self._launch_context(stage))
        if self._act_stream is not None:  # (a decision's act stream, joined into the side stream already)
            torch.cuda.current_stream(self.device).wait_stream(self._act_stream)
        if refused is not None:
            self.hook_capture_errors[name] = refused
            return None
        if stage in ("act", "decision") and not self._reranked:
            self._reranked = True  # (first: the ranking captures act graphs of its own)
            self.rerank_timings = rerank(self.linear, self.tuning_cache, self._act_graph_ms)
        try:
            return self._graphs.capture(name or stage, body, context=lambda: self._launch_context(stage), keep=keep)
        except Exception as exc:
            if not tolerate:
                raise
            self.hook_capture_errors[name] = f"{type(exc).__name__}: {exc}"
            return None

    def _act_graph_ms(self, iters: int = 15) -> float:
        """ms of one replay of a fresh act graph (captured with the pickers' current choices, then dropped),
        median of `iters`: what `flashrt_core.engine.rerank` compares. (A capture that fails part-way is not recoverable in
        this process on the H200 with torch 2.11: every later capture fails, "already recording to mempool_id",
        and so do other engines' (benchmarks/results/gpu_tests_h200_7a3ec9c_failed_capture.log). Each candidate runs
        eagerly first and the body is the one the main capture records, so none is expected to fail here.)"""
        graph = self._capture("act", self._act_body, keep=False)
        return statistics.median(cuda_samples(graph.replay, warmup=1, iters=iters))

    def capture(self) -> None:
        """Capture both stage graphs and the decision graph now (otherwise each is captured on its first use)."""
        for stage, body in (("observe", self._observe_body), ("act", self._act_body)):
            if stage not in self._graphs:
                self._capture(stage, body)
        self._hooked_graph("decision", "decision", self._decision_body)

    def observe(self) -> None:
        """Run the `observe` stage on the current buffer contents (graph replay on CUDA)."""
        self._run("observe")

    def act(self, rtc: bool = False) -> None:
        """Run the `act` stage: buffers.noise + prefix buffers -> buffers.actions; rtc: guided towards the
        previous chunk in the engine's RTC buffers (its own graph, "act+rtc")."""
        self._run("act+rtc" if rtc else "act")

    def decision(self) -> None:
        """A whole decision on the current buffers: images + prompt + noise -> prefix K/V and actions, as one
        graph of its own in which the act stage overlaps the observe stage (`_decision_body`; without
        graphs, or where it could not be captured, the two stages one after the other)."""
        def stages():
            self.observe()
            self.act()
        self._run_hooked("decision", "decision", self._decision_body, stages)  # (stages: where not captured)

