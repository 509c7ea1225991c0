"""The fused pi0.5 engine: static buffers, Triton glue between cuBLAS GEMMs, one CUDA graph per stage.

Same staged API as the eager reference (`reference.py`), so `Pi05Policy` and the runtime drive either:
  encode_prefix(images, image_masks, lang_tokens, lang_mask) -> PrefixCache   (stage `observe`)
  denoise(prefix, noise) -> actions                                           (stage `act`)
What makes it fast (each decision and its measured effect: docs/performance-history.md):
- every buffer a decision reads or writes lives at a fixed address (`EngineBuffers`): camera images,
  prompt tokens + mask, prefix K/V of every layer, pad mask, noise, actions. A prompt of any length up to
  `tokenizer_max_length` is padded into the token buffer and masked, so it never needs a new graph;
- the glue between GEMMs is one Triton kernel each (`flashrt_core.kernels`): residual + RMSNorm, AdaRMS +
  gated residual, GeGLU, bias + GELU, LayerNorm (+ residual), QKV split + RoPE + K/V write, attention with
  padding / over the cached prefix; GEMMs run on merged weights (q|k|v, gate|up) through cuBLAS or the
  skinny Triton GEMM (`kernels.skinny_gemm`), whichever measured faster for that shape on this GPU
  (`flashrt_core.engine.gemm.LinearPicker`); SigLIP's patch embedding is one GEMM over the gathered patches and its
  fc1 + bias + GELU one cuBLASLt GEMM with an epilogue (`flashrt_core.engine.blas`);
- the action expert's split-K GEMMs (QKV, o, down) hand their fp32 partial sums to the kernel that reads
  their result anyway (split/rotate, gated residual + AdaRMS), which adds them up in split order as it loads
  the row (`kernels.Partials`): no in-kernel reduction at the end of those GEMMs; once per engine those
  GEMMs' candidates are ranked again by the act graph's own time (`flashrt_core.engine.rerank`);
- with PDL each Triton kernel reads what no kernel of the chain writes (weights, the AdaRMS modulation
  table, the act stage's positions and RoPE rows) before it waits for the kernel before it;
- each flow step's Euler update x_t += dt * velocity is the action-out GEMM's epilogue, and the next step's
  action-in GEMM reads the fp32 state, rounding it on load (no torch kernel between the steps' PDL chains);
- AdaRMS scale/shift/gate of every step and layer come from the tables precomputed in `weights.py`;
- `observe` and `act` are each captured once as a CUDA graph and replayed (no host syncs inside); a whole
  decision is one graph of its own in which the act stage runs on a second stream beside observe, each of
  its first flow step's layers waiting only for that prefix layer's K/V.
On a CPU the same code runs with the kernels' torch references (or Triton under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from flashrt_core import kernels as K
from flashrt_core.engine.timing import cuda_samples
from flashrt_core.errors import InputError
from flashrt_core.kernels.skinny_gemm import GatedResidual
from flashrt_core.engine.attention import AttentionPicker
from flashrt_core.engine.blas import linear_bias_gelu_tanh, patch_embed, patch_matrix
from flashrt_core.engine.gemm import LinearPicker
from flashrt_core.engine.rerank import rerank
from flashrt_core.engine.tuning import TuningCache
from flashrt_core.models.pi05.inputs import check_model_inputs, check_noise, check_prefix
from flashrt_core.models.pi05.reference import PrefixCache
from flashrt_core.models.pi05.weights import Pi05Weights


@dataclass
class EngineBuffers:
    """Everything a decision reads or writes, allocated once per batch size (fixed CUDA-graph addresses)."""

    images: torch.Tensor  # [B, slots, 3, S, S] SigLIP input in [-1, 1]
    image_masks: torch.Tensor  # [B, slots] bool
    lang_tokens: torch.Tensor  # [B, L_max] int64
    lang_mask: torch.Tensor  # [B, L_max] bool
    prefix_k: torch.Tensor  # [depth, B, kv_heads, prefix_len, head_dim], RoPE applied
    prefix_v: torch.Tensor
    pad_mask: torch.Tensor  # [B, prefix_len] bool
    n_valid: torch.Tensor  # [B] int64
    noise: torch.Tensor  # [B, chunk, action_dim] fp32
    actions: torch.Tensor  # [B, chunk, action_dim] fp32

    @classmethod
    def allocate(cls, w: Pi05Weights, batch: int, device, dtype, vision_dtype) -> "EngineBuffers":
        c = w.config
        size, g = c.vision.image_size, c.vlm
        kv = (g.depth, batch, g.kv_heads, c.prefix_len, g.head_dim)
        chunk = (batch, c.chunk_size, c.action_dim)
        return cls(
            images=torch.full((batch, c.num_image_slots, 3, size, size), -1.0, device=device, dtype=vision_dtype),
            image_masks=torch.zeros(batch, c.num_image_slots, dtype=torch.bool, device=device),
            lang_tokens=torch.zeros(batch, c.tokenizer_max_length, dtype=torch.int64, device=device),
            lang_mask=torch.zeros(batch, c.tokenizer_max_length, dtype=torch.bool, device=device),
            prefix_k=torch.zeros(kv, dtype=dtype, device=device), prefix_v=torch.zeros(kv, dtype=dtype, device=device),
            pad_mask=torch.zeros(batch, c.prefix_len, dtype=torch.bool, device=device),
            n_valid=torch.zeros(batch, dtype=torch.int64, device=device),
            noise=torch.zeros(chunk, dtype=torch.float32, device=device),
            actions=torch.zeros(chunk, dtype=torch.float32, device=device),
        )


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


class Pi05Engine:
    """pi0.5 over static buffers. `encode_prefix` / `denoise` / `sample_actions` copy inputs into the buffers
    and run the stages; a runtime that owns the buffers can fill `buffers` itself and call `observe()` /
    `act()`, which replay the CUDA graphs (captured on first use on CUDA, or with `capture()`)."""

    name = "fused"
    Buffers = EngineBuffers  # the static buffers' class (a model with more inputs extends it)

    def __init__(self, weights: Pi05Weights, device=None, dtype: torch.dtype | None = None, *,
                 vision_dtype: torch.dtype | None = None, batch: int = 1, backend: str | None = None,
                 graphs: bool | None = None, gemm: str = "auto", pdl: bool = True, tune_attention: bool = True,
                 tuning_cache="default"):
        """weights: engine layout (`convert`), moved to `device` / `dtype` when given (default: where they are).
        vision_dtype: SigLIP + projector dtype (default: `dtype`; LeRobot keeps fp32 there).
        batch: the batch size the buffers are allocated for (a call with another batch reallocates them).
        backend: kernel backend (None = Triton where it runs, else the torch references; "torch"; "triton").
        graphs: capture CUDA graphs (default: on CUDA; off is the fallback where capture fails).
        gemm: "auto" (time cuBLAS against the skinny Triton GEMM's configurations per shape on CUDA), "torch"
        (cuBLAS only: the fallback where the Triton GEMMs fail) or "triton" (always the first skinny
        configuration where the rows are few: for tests).
        pdl: launch the Triton kernels with programmatic dependent launch where the GPU supports it (sm_90+),
        so each kernel's launch and weight loads overlap the one before (off: the fallback for GPUs or
        drivers where it fails).
        tune_attention: time attention launch configurations per shape during warm-up (off: the kernel's
        own heuristic).
        tuning_cache: directory where the tuned GEMM and attention choices are kept per GPU and software
        ("default": $FLASHRT_TUNING_CACHE or ~/.cache/flashrt/tuning; None: tune in every process), or a
        `TuningCache`."""
        device = torch.device(device) if device is not None else weights.action_in_w.device
        dtype = dtype or weights.action_in_w.dtype
        self.vision_dtype = vision_dtype or dtype
        w = weights.to(device=device, dtype=dtype, vision_dtype=self.vision_dtype)
        self.weights, self.config, self.device, self.dtype = w, w.config, device, dtype
        self.backend = backend
        self.use_graphs = (device.type == "cuda") if graphs is None else bool(graphs)
        if self.use_graphs and device.type != "cuda":
            raise ValueError(f"graphs: CUDA graphs need a CUDA device, got {device}")
        c = self.config
        self.cos, self.sin = K.rope_cos_sin(c.prefix_len + c.chunk_size, c.vlm.head_dim, c.rope_theta, device=device)
        # Gemma multiplies token embeddings by sqrt(width) rounded to the table's dtype (a Python float:
        # no host->device copy during capture).
        self.embed_scale = float(torch.tensor(c.vlm.width ** 0.5, dtype=torch.float32).to(w.embed.dtype))
        self.pdl = bool(pdl)
        self._patch_mat = patch_matrix(w.patch_w)  # [hidden, K padded to 16 bytes]
        self.rerank_timings: dict = {}  # {GEMM key: {candidate: act graph ms}} of the ranking timed here
        self._reranked = False
        # the Euler step's gate: dt per action dim (a static buffer the act graph reads)
        self._dt = torch.full((w.action_out_w.shape[0],), float(w.dt), dtype=torch.float32, device=device)
        if isinstance(tuning_cache, TuningCache) or tuning_cache is None or tuning_cache is False:
            self.tuning_cache = tuning_cache or None
        else:  # choices tuned with PDL on are not those of PDL off: the setting is part of the context
            self.tuning_cache = TuningCache.for_device(device, tuning_cache, pdl=self.pdl)
        self.linear = LinearPicker(device, mode=gemm, cache=self.tuning_cache)
        self.attend = AttentionPicker(device, enabled=tune_attention, cache=self.tuning_cache)
        self.buffers = self.Buffers.allocate(w, batch, device, dtype, self.vision_dtype)
        self._staging: dict[tuple, tuple] = {}  # set_observation's views of `buffers` (_staging_views; _resize clears)
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}
        # Tickets of the split kernels' in-kernel reductions, one buffer per stage: the stage graphs may
        # replay concurrently on different streams (observe beside act) and must not share them.
        # (the decision graph has none of its own: its observe and act parts each enter their stage's)
        self._tickets = {stage: K.new_semaphore_workspace(device) for stage in ("observe", "act")}
        self._pool = None
        self._act_stream = None  # the decision graph's second stream (created on the first decision)
        self.captures = 0  # how many graphs were captured (tests and benchmarks read it)
        # graphs that could not be captured, and why: run_stage / run_decision hooks ((stage, key)), "decision"
        self.hook_capture_errors: dict = {}

    @property
    def batch(self) -> int:
        return self.buffers.noise.shape[0]

    # ---- stage bodies (what the graphs record) --------------------------------------------------------
    def _siglip(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] -> projected image tokens [N, patches, vlm.width] in the model dtype."""
        w, vc, eps, be, lin = self.weights, self.config.vision, self.config.ln_eps, self.backend, self.linear
        layers = w.vision_layers
        # the patch embedding as one GEMM; the position embedding is added by the first LayerNorm's kernel
        x, h = K.add_layer_norm(patch_embed(pixels, w.patch_w, w.patch_b, self._patch_mat), w.pos_emb,
                                layers[0].ln1_w, layers[0].ln1_b, eps, backend=be)
        n, t = x.shape[:2]
        for i, L in enumerate(layers):
            qkv = lin(h, L.qkv_w, L.qkv_b).view(n, t, 3, vc.heads, vc.head_dim)
            # q stays token-major; k / v are [N, H, T, Dh] views of the same GEMM output (no copies).
            a = self.attend(qkv[:, :, 0], qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2), backend=be)
            o = lin(a.reshape(n, t, vc.hidden), L.out_w, L.out_b)
            x, h = K.add_layer_norm(o, x, L.ln2_w, L.ln2_b, eps, residual_out=x, backend=be)
            if h.is_cuda:  # one cuBLASLt GEMM with a bias + GELU epilogue
                f = linear_bias_gelu_tanh(h, L.fc1_w, L.fc1_b)
            else:
                f = K.bias_gelu(lin(h, L.fc1_w), L.fc1_b, backend=be)
            m = lin(f, L.fc2_w, L.fc2_b)
            nw, nb = (layers[i + 1].ln1_w, layers[i + 1].ln1_b) if i + 1 < len(layers) else (w.post_ln_w, w.post_ln_b)
            x, h = K.add_layer_norm(m, x, nw, nb, eps, residual_out=x, backend=be)
        return lin(h, w.proj_w, w.proj_b).to(self.dtype)

    def _observe_body(self, prefix_done=None) -> None:
        """images + prompt buffers -> prefix K/V, pad mask and valid count (the `observe` stage).
        prefix_done(i) is called once prefix layer i's K/V are written (-1: the pad mask and valid count)."""
        w, c, buf, be, lin = self.weights, self.config, self.buffers, self.backend, self.linear
        g, eps = c.vlm, c.rms_eps
        b, slots = buf.image_masks.shape
        # A masked (missing) camera reads as a -1 image, as LeRobot builds it, whatever its buffer holds
        # (stale or NaN pixels), and token ids are clamped into the vocabulary (on CUDA an id past it would
        # abort the context in the lookup; CPU ids were checked, see inputs.py). Done here rather than in
        # set_observation: buffers filled any other way (a restored capsule) get the same, and the staged
        # copies before the graph need no extra eager kernels.
        n_patch = c.vision.num_patches
        # The pad mask and valid count first: they depend on the masks only (the decision graph's act stream
        # starts its first flow step on them while SigLIP runs).
        pad = torch.cat([buf.image_masks[:, :, None].expand(b, slots, n_patch).reshape(b, slots * n_patch),
                         buf.lang_mask], dim=1)
        buf.pad_mask.copy_(pad)
        buf.n_valid.copy_(pad.sum(dim=1))
        if prefix_done is not None:
            prefix_done(-1)
        pixels = torch.where(buf.image_masks[:, :, None, None, None], buf.images, -1.0)
        img = self._siglip(pixels.flatten(0, 1))
        lang = F.embedding(buf.lang_tokens.clamp(0, c.vocab_size - 1), w.embed) * self.embed_scale
        x = torch.cat([img.view(b, slots * n_patch, -1), lang], dim=1)
        # Positions count valid tokens only; padding gets a clamped (unused) position.
        positions = (torch.cumsum(pad, dim=1) - 1).clamp_(min=0)
        layers = w.vlm_layers
        h = K.rms_norm(x, layers[0].attn_norm, eps, weight_offset=0.0, backend=be)
        for i, L in enumerate(layers):
            q = K.qkv_rope_cache(lin(h, L.qkv_w), positions, self.cos, self.sin, buf.prefix_k[i], buf.prefix_v[i], 0,
                                 num_q_heads=g.heads, num_kv_heads=g.kv_heads, backend=be)
            if prefix_done is not None:
                prefix_done(i)
            if i == len(layers) - 1:
                break  # the last layer's attention output and MLP only feed the unused prefix logits
            a = self.attend(q, buf.prefix_k[i], buf.prefix_v[i], key_mask=buf.pad_mask, backend=be)
            o = lin(a.flatten(2), L.o_w)
            x, h = K.add_rms_norm(o, x, L.mlp_norm, eps, weight_offset=0.0, residual_out=x, backend=be)
            d = lin(lin.geglu(h, L.gate_up_w, backend=be), L.down_w)
            x, h = K.add_rms_norm(d, x, layers[i + 1].attn_norm, eps, weight_offset=0.0, residual_out=x, backend=be)

    def _act_body(self, prefix_wait=None) -> None:
        """noise + prefix buffers -> `num_steps` Euler steps of the action expert -> actions (the `act` stage).
        prefix_wait(i) is called before the first read of prefix layer i's K/V (-1: of the valid count)."""
        w, c, buf, be, lin = self.weights, self.config, self.buffers, self.backend, self.linear
        e, eps, chunk = c.expert, c.rms_eps, c.chunk_size
        b = buf.noise.shape[0]
        if prefix_wait is not None:
            prefix_wait(-1)
        positions = buf.n_valid[:, None] + torch.arange(chunk, device=self.device)
        suffix_k = torch.empty(b, e.kv_heads, chunk, e.head_dim, device=self.device, dtype=self.dtype)
        suffix_v = torch.empty_like(suffix_k)
        x_t = buf.noise.clone()  # the fp32 flow state
        layers = w.expert_layers
        # defer=True: the QKV, o and down GEMMs may leave their split-K partials to the kernel after them (the
        # split/rotate kernel, the gated residual + AdaRMS), which adds them up as it loads the row.
        # constant_mod / constant_positions: the modulation rows, positions and RoPE rows are written by no
        # kernel of the stage's PDL chain, so those kernels read them before waiting for the one before.
        for step in range(c.num_steps):
            x = lin(x_t, w.action_in_w, w.action_in_b)  # (the fp32 state is rounded to the weights' dtype on load)
            mod = w.ada_attn[step, 0]
            h = K.ada_rms_norm(x, mod[0], mod[1], eps, constant_mod=True, backend=be)
            for i, L in enumerate(layers):
                q = K.qkv_rope_cache(lin(h, L.qkv_w, defer=True), positions, self.cos, self.sin, suffix_k, suffix_v,
                                     0, num_q_heads=e.heads, num_kv_heads=e.kv_heads, constant_positions=True,
                                     backend=be)
                if prefix_wait is not None and step == 0:
                    prefix_wait(i)
                # Action tokens see the valid prefix (cached K/V, pad mask) and every action token.
                a = self.attend(q, buf.prefix_k[i], buf.prefix_v[i], key_mask=buf.pad_mask, k2=suffix_k, v2=suffix_v,
                                backend=be)
                o = lin(a.flatten(2), L.o_w, defer=True)
                gate, mod = w.ada_attn[step, i, 2], w.ada_mlp[step, i]
                x, h = K.gated_residual_ada_rms_norm(x, o, gate, mod[0], mod[1], eps, x_out=x, constant_mod=True,
                                                     backend=be)
                d = lin(lin.geglu(h, L.gate_up_w, backend=be), L.down_w, defer=True)
                gate = w.ada_mlp[step, i, 2]
                mod = w.ada_attn[step, i + 1] if i + 1 < len(layers) else w.ada_final[step]
                x, h = K.gated_residual_ada_rms_norm(x, d, gate, mod[0], mod[1], eps, x_out=x, constant_mod=True,
                                                     backend=be)
            # x_t += dt * velocity in the action-out GEMM (the velocity rounded to the model dtype first)
            lin(h, w.action_out_w, w.action_out_b, residual=GatedResidual(x_t, self._dt))
        buf.actions.copy_(x_t)

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
        ready = [torch.cuda.Event() for _ in range(self.config.vlm.depth + 1)]  # [0]: valid count, [i + 1]: layer i
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
    def _launch_context(self, stage: str) -> contextlib.ExitStack:
        """What every kernel launch of a stage runs under: no autograd, the stage's ticket workspace, PDL on/off."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        if stage in self._tickets:
            stack.enter_context(K.semaphore_workspace(self._tickets[stage]))
        stack.enter_context(K.pdl_scope(self.pdl))
        return stack

    def _run(self, stage: str, body) -> None:
        if not self.use_graphs:
            with self._launch_context(stage):
                body()
            return
        graph = self._graphs.get(stage)
        if graph is None:
            graph = self._capture(stage, body)
        graph.replay()

    def run_stage(self, stage: str, pre=None, post=None, key: str = "hooks") -> None:
        """Run `observe` or `act` with `pre` (fill the engine's buffers from a caller's static buffers) and
        `post` (copy the results out) recorded in the same CUDA graph as the stage: one launch for all of
        it. pre / post may only launch device work on tensors that keep their addresses, never read values
        on the host, and must do the same thing at every call for a given `key` (captured on first use).
        Hooks that wait for the device (found by a warm-up under CUDA's sync debug mode) or whose capture
        fails run eagerly around the stage's own graph from then on (`hook_capture_errors` says why); other
        errors raised by pre / post in their first, eager run propagate."""
        body = {"observe": self._observe_body, "act": self._act_body}[stage]

        def eager():  # the hooks around the stage's own graph
            _call(pre)
            self._run(stage, body)
            _call(post)
        self._run_hooked(stage, (stage, key), lambda: self._stage_between(stage, pre, body, post), eager)

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
            self._run("observe", self._observe_body)
            _call(hooks.observe_post)
            _call(hooks.act_pre)
            self._run("act", self._act_body)
            _call(hooks.act_post)
        self._run_hooked("decision", ("decision", key), lambda: self._decision_body(hooks), eager)

    def _run_hooked(self, stage: str, name, whole, eager) -> None:
        """Replay the graph `name` of `whole` (`_hooked_graph`); where there is none, `eager()` runs the same
        work around the stage graphs."""
        graph = self._hooked_graph(stage, name, whole)
        if graph is not None:
            graph.replay()
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
        # Warm up on a side stream first: Triton compiles, cuBLAS picks algorithms and the GEMM picker
        # times its candidates outside the capture (none of that may happen inside it).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with self._launch_context(stage), torch.cuda.stream(side):
            self.linear.tuning = self.attend.tuning = True
            try:
                body()
            finally:
                self.linear.tuning = self.attend.tuning = False
                if self.tuning_cache is not None:
                    self.tuning_cache.save()
            refused = None
            if tolerate:  # hooks that wait for the device (.item(), a blocking copy) cannot be captured:
                # find out here, not by a failed capture (which can leave the allocator's pool capturing)
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    body()
                except RuntimeError as exc:
                    refused = f"waits for the device: {exc}"
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
            else:
                body()
        caller = torch.cuda.current_stream(self.device)
        caller.wait_stream(side)
        if self._act_stream is not None:  # (a decision's act stream, joined into `side` already: belt and braces)
            caller.wait_stream(self._act_stream)
        if refused is not None:
            self.hook_capture_errors[name] = refused
            return None
        if stage in ("act", "decision") and not self._reranked:
            self._reranked = True  # (first: the ranking captures act graphs of its own)
            self.rerank_timings = rerank(self.linear, self.tuning_cache, self._act_graph_ms)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with self._launch_context(stage), torch.cuda.graph(graph, pool=self._pool):
                body()
        except Exception as exc:
            if not tolerate:
                raise
            torch.cuda.set_stream(caller)  # a capture_end that raises skips the capture stream's own exit
            try:  # ... and the allocator's end of recording into the pool: end it, or later captures fail
                torch._C._cuda_endAllocateToPool(self.device.index or torch.cuda.current_device(), self._pool)
            except Exception:  # noqa: BLE001 (already ended, or a torch without this hook)
                pass
            self.hook_capture_errors[name] = f"{type(exc).__name__}: {exc}"
            return None
        if keep:
            self._graphs[name or stage] = graph
            self.captures += 1
        return graph

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
        self._run("observe", self._observe_body)

    def act(self) -> None:
        """Run the `act` stage: buffers.noise + prefix buffers -> buffers.actions."""
        self._run("act", self._act_body)

    def decision(self) -> None:
        """A whole decision on the current buffers: images + prompt + noise -> prefix K/V and actions, as one
        graph of its own in which the act stage overlaps the observe stage (`_decision_body`; without
        graphs, or where it could not be captured, the two stages one after the other)."""
        def stages():
            self.observe()
            self.act()
        self._run_hooked("decision", "decision", self._decision_body, stages)  # (stages: where not captured)

    # ---- staged API (copies into the static buffers) --------------------------------------------------
    def _resize(self, batch: int) -> None:
        if batch != self.batch:  # a new batch size needs new buffers and therefore new graphs
            self.buffers = self.Buffers.allocate(self.weights, batch, self.device, self.dtype, self.vision_dtype)
            self._graphs.clear()
            self._staging.clear()

    def set_observation(self, images, image_masks, lang_tokens, lang_mask) -> None:
        """Copy one observation into the buffers: images [B, S<=slots, 3, size, size] in [-1, 1], masks [B, S],
        lang_tokens / lang_mask [B, L<=tokenizer_max_length]. Unused slots and prompt positions are masked; a
        masked (missing) camera's image reads as -1s as LeRobot builds it (the observe stage does that), so
        whatever it holds (stale or NaN pixels) never reaches the actions. Everything is checked before anything
        is written (`inputs.check_model_inputs`): a refused call leaves the buffers as they were."""
        check_model_inputs(self.config, images, image_masks, lang_tokens, lang_mask)
        self._write_observation(images, image_masks, lang_tokens, lang_mask)

    def _write_observation(self, images, image_masks, lang_tokens, lang_mask) -> None:
        """set_observation's copies, after its checks: two multi-tensor calls (the four copies, then the
        unused slots' masks and prompt tails cleared) over views made once per (buffers, slots, tokens). The
        host time of these calls is part of every decision (the graph launch waits for it): 55 us p50 on the
        H200 machine against 82 for seven separate slicings and copies
        (benchmarks/results/set_observation_host_h200.json)."""
        b, s = images.shape[:2]
        n = lang_tokens.shape[1]
        self._resize(b)
        dst, tails = self._staging_views(s, n)
        torch._foreach_copy_(dst, [images, image_masks, lang_tokens, lang_mask])
        if tails:  # (slots past s are masked: the observe stage reads their images as -1s)
            torch._foreach_zero_(tails)

    def _staging_views(self, slots: int, tokens: int) -> tuple[list, list]:
        """([images, image_masks, lang_tokens, lang_mask] views of the first `slots` / `tokens`, [the views
        past them that a write clears]) of the current buffers, kept until `_resize` replaces the buffers."""
        key = (slots, tokens)
        if key not in self._staging:
            buf = self.buffers
            dst = [buf.images[:, :slots], buf.image_masks[:, :slots], buf.lang_tokens[:, :tokens],
                   buf.lang_mask[:, :tokens]]
            tails = [t for t in (buf.image_masks[:, slots:], buf.lang_tokens[:, tokens:], buf.lang_mask[:, tokens:])
                     if t.numel()]
            self._staging[key] = (dst, tails)
        return self._staging[key]

    def encode_prefix(self, images, image_masks, lang_tokens, lang_mask) -> PrefixCache:
        """-> PrefixCache viewing the engine's static buffers: valid until the next encode_prefix (clone to keep)."""
        self.set_observation(images, image_masks, lang_tokens, lang_mask)
        self.observe()
        buf = self.buffers
        return PrefixCache(k=buf.prefix_k, v=buf.prefix_v, pad_mask=buf.pad_mask, n_valid=buf.n_valid)

    def share_prefix(self, prefix: PrefixCache) -> None:
        """Make the tensors of `prefix` (a caller's persistent buffers, e.g. a contract's: same shapes, dtypes
        and device as the engine's) the engine's own prefix buffers: observe writes into them and act reads
        them, with no copy either way. Graphs captured before are dropped (they hold the old addresses)."""
        b = check_prefix(self.config, prefix, self.config.prefix_len)
        if b != self.batch:
            raise InputError(f"prefix.k: batch {b} but the engine holds batch {self.batch}")
        buf = self.buffers
        for name, src, dst in (("k", prefix.k, buf.prefix_k), ("v", prefix.v, buf.prefix_v),
                               ("pad_mask", prefix.pad_mask, buf.pad_mask), ("n_valid", prefix.n_valid, buf.n_valid)):
            if src.dtype != dst.dtype or src.device != dst.device or src.shape != dst.shape:
                raise InputError(f"prefix.{name}: {tuple(src.shape)} {src.dtype} on {src.device}, the engine's is "
                                 f"{tuple(dst.shape)} {dst.dtype} on {dst.device}")
        self.buffers = dataclasses.replace(buf, prefix_k=prefix.k, prefix_v=prefix.v, pad_mask=prefix.pad_mask,
                                           n_valid=prefix.n_valid)
        self._graphs.clear()
        self._staging.clear()

    def set_prefix(self, prefix: PrefixCache) -> None:
        """Make `prefix` the cached prefix (a no-op when it already views the engine's buffers). Every field is
        checked (shape, dtype) before anything is copied."""
        b = check_prefix(self.config, prefix, self.config.prefix_len)
        if b != self.batch:
            raise InputError(f"prefix.k: batch {b} but the engine holds batch {self.batch}")
        self._copy_prefix(prefix)

    def _copy_prefix(self, prefix: PrefixCache) -> None:
        buf = self.buffers
        for src, dst in ((prefix.k, buf.prefix_k), (prefix.v, buf.prefix_v), (prefix.pad_mask, buf.pad_mask),
                         (prefix.n_valid, buf.n_valid)):
            if not _same(src, dst):
                dst.copy_(src)

    def denoise(self, prefix: PrefixCache, noise: torch.Tensor) -> torch.Tensor:
        """noise [B, chunk, action_dim] -> actions [B, chunk, action_dim] fp32 (a fresh tensor). The prefix and
        the noise are checked before the engine changes anything (a refused call keeps its buffers)."""
        b = check_prefix(self.config, prefix, self.config.prefix_len)
        check_noise(self.config, noise, b)
        if not _same(prefix.k, self.buffers.prefix_k):
            self._resize(b)  # a cache from elsewhere may bring its own batch size
        self._copy_prefix(prefix)
        self.buffers.noise.copy_(noise)
        self.act()
        return self.buffers.actions.clone()

    def sample_actions(self, images, image_masks, lang_tokens, lang_mask, noise) -> torch.Tensor:
        """One whole decision (`decision()`): observation + noise -> actions [B, chunk, action_dim] fp32 (a fresh
        tensor). Everything is checked before anything is written."""
        check_model_inputs(self.config, images, image_masks, lang_tokens, lang_mask)
        check_noise(self.config, noise, images.shape[0])
        self._write_observation(images, image_masks, lang_tokens, lang_mask)
        self.buffers.noise.copy_(noise)
        self.decision()
        return self.buffers.actions.clone()


def make_engine(weights: Pi05Weights) -> Pi05Engine:
    """The `Pi05Policy` engine hook: the fused engine on the weights' own device and dtype."""
    return Pi05Engine(weights)
