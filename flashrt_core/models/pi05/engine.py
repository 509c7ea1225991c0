"""The fused pi0.5 engine: static buffers, Triton glue between cuBLAS GEMMs, one CUDA graph per stage.

Same staged API as the eager reference (`reference.py`), so `Pi05Policy` and the runtime drive either:
  encode_prefix(images, image_masks, lang_tokens, lang_mask) -> PrefixCache   (stage `observe`)
  denoise(prefix, noise) -> actions                                           (stage `act`)
What makes it fast:
- every buffer a decision reads or writes lives at a fixed address (`EngineBuffers`): camera images,
  prompt tokens + mask, prefix K/V of every layer, pad mask, noise, actions. A prompt of any length up to
  `tokenizer_max_length` is padded into the token buffer and masked, so it never needs a new graph;
- the glue between GEMMs is one Triton kernel each (`flashrt_core.kernels`): residual + RMSNorm, AdaRMS +
  gated residual, GeGLU, bias + GELU, LayerNorm (+ residual), QKV split + RoPE + K/V write, attention with
  padding / over the cached prefix; GEMMs run on merged weights (q|k|v, gate|up) through cuBLAS or the
  skinny Triton GEMM of `engine_gemm.py`, whichever measured faster for that shape on this GPU;
- the action expert's split-K GEMMs (QKV, o, down) hand their fp32 partial sums to the kernel that reads
  their result anyway (split/rotate, gated residual + AdaRMS), which adds them up in split order as it loads
  the row (`kernels.Partials`): no in-kernel reduction at the end of those GEMMs;
- AdaRMS scale/shift/gate of every step and layer come from the tables precomputed in `weights.py`;
- `observe` and `act` are each captured once as a CUDA graph and replayed (no host syncs inside).
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
from flashrt_core.models.pi05.engine_attention import AttentionPicker
from flashrt_core.models.pi05.inputs import check_model_inputs, check_noise, check_prefix
from flashrt_core.models.pi05.engine_blas import linear_bias_gelu_tanh, patch_embed, patch_matrix
from flashrt_core.models.pi05.engine_gemm import (GatedResidual, LinearPicker, QkvRope, RowNorm, RowStats,
                                                  stat_chunks)
from flashrt_core.models.pi05.engine_rerank import rerank
from flashrt_core.models.pi05.engine_tuning import TuningCache
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

    def __init__(self, weights: Pi05Weights, device=None, dtype: torch.dtype | None = None, *,
                 vision_dtype: torch.dtype | None = None, batch: int = 1, backend: str | None = None,
                 graphs: bool | None = None, gemm: str = "auto", pdl: bool = True, tune_attention: bool = True,
                 tuning_cache="default", rope_in_attention: bool = False, norm_in_gemm: bool = False,
                 l2_prefetch: bool = False, rope_in_gemm: bool = False, attention_merge_apart: bool = False,
                 gemm_preload: bool = True, early_modulation: bool = True,
                 early_positions: bool = True, fused_euler: bool = True, gemm_tma: bool = False,
                 reduce_in_norm: bool = True, reduce_in_rotate: bool = True, overlap_decision: bool = True,
                 gemm_mid: bool = False, patch_gemm: bool = True, gelu_epilogue: bool = True,
                 rerank_in_graph: bool = True):
        """weights: engine layout (`convert`), moved to `device` / `dtype` when given (default: where they are).
        vision_dtype: SigLIP + projector dtype (default: `dtype`; LeRobot keeps fp32 there).
        backend: kernel backend (None = Triton where it runs, else the torch references; "torch"; "triton").
        graphs: capture CUDA graphs (default: on CUDA). gemm: "auto" (time cuBLAS vs Triton per shape on
        CUDA), "torch" (cuBLAS only) or "triton". pdl: launch the Triton kernels with programmatic dependent
        launch where the GPU supports it (sm_90+), so each kernel's launch and weight loads overlap the one
        before. tune_attention: time attention launch configurations per shape during warm-up.
        tuning_cache: directory where the tuned GEMM and attention choices are kept per GPU and software
        ("default": $FLASHRT_TUNING_CACHE or ~/.cache/flashrt/tuning; None: tune in every process), or a
        `TuningCache`. rope_in_attention: the action expert's attention reads q, k and v straight from the
        QKV GEMM output and rotates q and k on load, instead of a split/rotate kernel before it (one kernel
        less per layer and flow step; off: slower on the H200,
        `benchmarks/profile_pi05.py --ab rope_in_attention`; again at d78ebe1 with the current attention
        kernel: act 8690 vs 7394 us interleaved p50,
        `benchmarks/results/profile_pi05_w2_rope_in_attention_ab.json`).
        norm_in_gemm: no norm kernels between the action expert's GEMMs: the GEMMs that produce its residual
        stream (action in, o, down) add their gated residual in place and also write the next AdaRMS's
        scaled input and row sums of squares (`engine_gemm.GatedResidual`, `RowStats`); the GEMMs that read
        a norm (QKV, gate|up, action out) apply the row scale and shift after their product (`RowNorm`).
        370 fewer launches per act, same actions (cosine 0.999999), but not faster on the H200 with PDL
        (8451 vs 8393 us, `benchmarks/results/profile_pi05_w2_norm_ab2.json`: there the norm kernels hide behind the
        GEMMs and the producing GEMMs' epilogues grow; again at d78ebe1 with the full candidate list: 7591 vs
        7550 us, `benchmarks/results/profile_pi05_w2_norm_in_gemm_ab.json`), so off by default; without PDL
        (pdl=False, GPUs before sm_90) launches cost more and it may pay:
        `benchmarks/profile_pi05.py --pdl 0 --ab norm_in_gemm`.
        l2_prefetch: the action expert's glue kernels start the HBM -> L2 stream of the weights (and cached
        prefix K/V) that the next GEMMs (and attention) read, so those read L2 instead of waiting on HBM
        (`_expert_prefetch`; sm_90+, elsewhere a no-op). Packs each expert layer's weights into one block.
        Needs the split/rotate and norm kernels (rope_in_attention and norm_in_gemm off). Off: slower on
        the H200 (act 11.5 vs 8.6 ms, `benchmarks/results/profile_pi05_w2_l2_ab.json`: the prefetch traffic slows the
        GEMMs it was meant to feed, which already load their weights before the PDL wait).
        rope_in_gemm: the action expert's QKV GEMM splits, rotates and writes q / k / v in its epilogue
        (`engine_gemm.QkvRope`; tuned against cuBLAS + the split/rotate kernel, over every plain candidate and
        its twin at half the BLOCK_N), one kernel less per layer and flow step. Off: slower on the H200 (act
        7222 vs 7115 us interleaved p50, `benchmarks/results/profile_pi05_w2_rope_in_gemm_ab.json`): the fused GEMM's
        best form takes 6.87 us (the plain GEMM's twin 6.98) against 4.62 us for the plain QKV GEMM, more
        than the rotate kernel it removes costs in the PDL chain.
        attention_merge_apart: the attention tuning may also pick configurations whose key splits are merged
        by a second kernel (`kernels.attention` config[5]). Off: timed alone such a configuration wins the
        expert's attention (9.8 vs 12.3 us for W2), but in the act graph it lost (interleaved act p50 8478
        vs 8279 us with the in-kernel merge, H200, `benchmarks/results/profile_pi05_w2_attention_merge_apart_ab.json`):
        the merge kernel is one more PDL boundary per layer and flow step that the isolated timing misses
        (again at 1d7cd17 with the one-key-loop kernel: 8.92 vs 9.69 us alone, act 7397 vs 6912 us,
        `benchmarks/results/profile_pi05_w2_attention_merge_apart_ab_1d7cd17.json`).
        gemm_preload: the GEMM tuning may also pick skinny configurations that request their first weight
        tiles before the PDL wait in the K loop (`engine_gemm.CONFIGS` entries with a 6th element; the PTX
        check `test/test_kernels_ptx.py` shows the loads before the wait). On: together with early_modulation the
        act graph went from 7486 to 7090 us (interleaved p50, H200, action cosine 0.999999,
        `benchmarks/results/profile_pi05_w2_gemm_preload-early_modulation_ab.json`; the picker took preload
        configurations for the expert's QKV and down GEMMs). It adds 10 candidates to the first tuning.
        early_modulation: the action expert's AdaRMS kernels read their scale / shift / gate rows (weights: the
        precomputed modulation table) before waiting for the kernel before them (`constant_mod`), so that
        read leaves the critical path; same results. On (measured with gemm_preload, above).
        early_positions: the split/rotate kernel reads its tokens' positions (n_valid + t) and cos / sin rows
        before the PDL wait (`qkv_rope_cache(constant_positions=True)`; `set_prefix`'s copies and the
        positions are torch kernels that finish before the act stage's first Triton kernel starts), so after
        the wait it reads only the qkv row it rotates: one memory round trip instead of two. Same results.
        On: act 7402 -> 7224 us interleaved p50 (6967 -> 6851 us under the profiler; H200, 80b7fb2,
        `benchmarks/results/profile_pi05_w2_early_positions_ab.json`). (The expert attention's first prefix K/V
        tile read before its wait, `early_prefix` until b21f6d8..80b7fb2, lost: 7335 vs 7102 us, its held tile cost
        registers and a spill, `benchmarks/results/profile_pi05_w2_early_prefix_ab.json`; it was removed.)
        fused_euler: each flow step's Euler update x_t += dt * velocity is the action-out GEMM's epilogue (a
        gated residual into the fp32 state, the velocity rounded to the model dtype first as before), and the
        next step's action-in GEMM reads the fp32 state, rounding it on load: the two torch kernels per step
        (the add and the cast) leave the act graph. Torch kernels do not take part in PDL, so each was a full
        drain of the chain (and the action-in GEMM could not request its weights early). Same actions up to
        fp32 rounding of the update. On: act 7245 -> 7161 us interleaved p50 (7022 -> 6996 us under the
        profiler; H200, 6e84f3f, `benchmarks/results/profile_pi05_w2_fused_euler_ab.json`).
        gemm_tma: the GEMM tuning may also pick skinny configurations that read their weight tiles through TMA
        descriptors (Hopper's bulk tensor copies into shared memory, `engine_gemm.TMA_CONFIGS`) instead of
        per-thread loads. Off: on the H200 the picker took TMA forms only for the two tiny flow-step GEMMs
        (action in 1.33 vs 1.52 us, action out 3.06 vs 3.38 us); for QKV, o, gate|up and down the best TMA
        form was 0.15-0.8 us slower than the best pointer-loaded one, and act stayed where it was (6994 vs
        6956 us interleaved p50, action cosine 1.000000; 1bdf079,
        `benchmarks/results/profile_pi05_w2_gemm_tma_ab.json`).
        reduce_in_norm: the action expert's o and down GEMMs leave their split-K partials unreduced
        (`kernels.Partials`) and the gated residual + AdaRMS kernel after each adds them up while it reads the
        row, so the GEMM's in-kernel reduction (a ticket, then the last program's reads of every partial)
        leaves the chain. The picker then offers the skinny configurations of at most 8 splits. Same actions,
        bit for bit where the same configuration is picked (the sum order and rounding are the GEMM's).
        On: act 7377 -> 7018 us interleaved p50 (6859 -> 6509 us under the profiler; o 5.08 -> 3.12 us, down
        7.24 -> 4.85 us graph-timed; H200, fd4f555, `benchmarks/results/profile_pi05_w2_reduce_in_norm_ab.json`). No
        effect with norm_in_gemm (no norm kernel there).
        reduce_in_rotate: the same for the QKV GEMM, whose partials the split/rotate kernel adds up (no effect
        where that kernel is not used: rope_in_attention, rope_in_gemm, norm_in_gemm). On: act 7009 -> 6832 us
        interleaved p50 with reduce_in_norm on in both (6701 -> 6540 us under the profiler; the QKV GEMM took
        (64, 512, 0, 8, 1), 2 splits; action cosine 0.999999; H200, 810d6d9,
        `benchmarks/results/profile_pi05_w2_reduce_in_rotate_ab.json`).
        overlap_decision: a whole decision (`decision()`, `sample_actions`) is one CUDA graph in which the act
        stage runs on a second stream beside the observe stage: its first flow step's layer i waits only for
        the observe stage's K/V of prefix layer i (events), not for the whole prefix, so that flow step fills
        the SMs the prefix's kernels leave idle (their tails, the glue kernels, SigLIP's small GEMMs). Same
        kernels, same actions (bit for bit on the H200); `observe()` / `act()` alone are unchanged. On: whole
        decision 11924 -> 11589 us interleaved p50 (graphs only; H200, ca08d1d,
        `benchmarks/results/profile_pi05_w2_overlap_decision_ab.json`).
        gemm_mid: the GEMMs of 129-1024 rows (SigLIP's, the prefix's QKV / o / down) are tuned too, cuBLAS against
        the Triton GEMM with mid-size tiles (`engine_gemm.MID_CONFIGS`: smaller tiles and split K where cuBLAS
        leaves SMs idle, and PDL launches). Off: cuBLAS won every such shape on the H200 (graph-timed, weights
        cycled past L2; best Triton form in brackets): SigLIP QKV 9.43 us (11.6), o 5.90 (7.65), fc1 10.5 (17.7),
        fc2 15.6 (22.3), projector 6.99 (8.41); prefix QKV 11.6 (17.2), o 10.2 (16.4), down 56.4 (106), so the
        picker kept cuBLAS and observe stayed where it was (5946 vs 5933 us interleaved p50; ccc8d16,
        `benchmarks/results/profile_pi05_w2_gemm_mid_ab.json`): the skinny kernel's pointer-loaded, transposed
        weight tiles are no match for cuBLAS's Hopper kernels once a GEMM has hundreds of rows.
        patch_gemm: SigLIP's patch embedding (a 14x14 stride-14 convolution) as what it is, one GEMM over the
        images' patches (a reshape copy of the pixels, then cuBLAS with the bias), instead of `F.conv2d`
        (on CUDA cuDNN converts the input and weight to NHWC and the output back around its kernel). Same
        math up to the products' summation order. On: observe 5914 -> 5819 us, whole decision 11663 -> 11556 us
        (interleaved p50, H200, 972a64f, `benchmarks/results/profile_pi05_w2_patch_gemm_ab.json`). The patch rows are
        zero-padded from 588 to 592 values (16-byte rows: cuBLAS's TMA kernels, 14.7 -> 5.0 us for W2,
        `benchmarks/results/blas_choice_probe_h200.json`), and the position embedding is added by the first LayerNorm's
        kernel (`kernels.add_layer_norm` with the table as a repeating residual) instead of a kernel of its own.
        gelu_epilogue: on CUDA SigLIP's fc1 + bias + tanh-GELU is one cuBLASLt GEMM with a bias + GELU
        epilogue (`engine_blas.linear_bias_gelu_tanh`) instead of the GEMM and the bias_gelu kernel after it.
        Not used where the GEMM picker may route fc1 to the Triton GEMM (gemm_mid). On: observe 5958 -> 5824 us,
        whole decision 11670 -> 11554 us (interleaved p50, H200, 972a64f,
        `benchmarks/results/profile_pi05_w2_gelu_epilogue_ab.json`).
        rerank_in_graph: once, before the first graph holding the act stage is captured, the act stage's
        deferred-reduction GEMMs (QKV, o, down with reduce_in_rotate / reduce_in_norm) are ranked again by
        the act graph's own time over their best few candidates by isolated time (`engine_rerank`: alone,
        a GEMM's timing misses what its split count costs the kernel that adds the partials); kept in the
        tuning cache. CUDA graphs only; a few seconds of the first warm-up. On: act 6949 -> 6733 us, whole
        decision 11670 -> 11442 us (interleaved p50, H200, 6d7a0bc,
        `benchmarks/results/profile_pi05_w2_rerank_in_graph_ab.json`: the down projection took 4 splits instead
        of 8)."""
        if l2_prefetch and (rope_in_attention or norm_in_gemm or rope_in_gemm):
            raise ValueError("l2_prefetch: the prefetches ride on the rotate and norm kernels, which "
                             "rope_in_attention / norm_in_gemm / rope_in_gemm remove; use it with those off")
        if rope_in_attention and rope_in_gemm:
            raise ValueError("rope_in_attention and rope_in_gemm: the rotation is done in one place or the other")
        device = torch.device(device) if device is not None else weights.action_in_w.device
        dtype = dtype or weights.action_in_w.dtype
        self.vision_dtype = vision_dtype or dtype
        w = weights.to(device=device, dtype=dtype, vision_dtype=self.vision_dtype)
        self.l2_prefetch = bool(l2_prefetch)
        if self.l2_prefetch:
            w = _pack_expert(w)
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
        self.rope_in_attention = bool(rope_in_attention)
        self.rope_in_gemm = bool(rope_in_gemm)
        self.norm_in_gemm = bool(norm_in_gemm)
        self.early_modulation = bool(early_modulation)
        self.early_positions = bool(early_positions)
        self.fused_euler = bool(fused_euler)
        # (the partials' readers: the norm kernels and the split/rotate kernel, where this engine has them)
        self.reduce_in_norm = bool(reduce_in_norm) and not self.norm_in_gemm
        self.reduce_in_rotate = bool(reduce_in_rotate) and not (self.norm_in_gemm or self.rope_in_gemm
                                                                or self.rope_in_attention)
        self.overlap_decision = bool(overlap_decision)
        self.patch_gemm = bool(patch_gemm)
        self._patch_mat = patch_matrix(w.patch_w) if self.patch_gemm else None  # [hidden, K padded to 16 bytes]
        self.gelu_epilogue = bool(gelu_epilogue) and not gemm_mid
        self.rerank_in_graph = bool(rerank_in_graph)
        self.rerank_timings: dict = {}  # rerank_in_graph: {GEMM key: {candidate: act graph ms}} timed here
        self._reranked = False
        # the Euler step's gate: dt per action dim (a static buffer the act graph reads)
        self._dt = torch.full((w.action_out_w.shape[0],), float(w.dt), dtype=torch.float32, device=device)
        self._shift_w = _shift_projections(w) if self.norm_in_gemm else None
        if isinstance(tuning_cache, TuningCache) or tuning_cache is None or tuning_cache is False:
            self.tuning_cache = tuning_cache or None
        else:  # choices tuned with PDL on are not those of PDL off: the setting is part of the context
            self.tuning_cache = TuningCache.for_device(device, tuning_cache, pdl=self.pdl)
        self.linear = LinearPicker(device, mode=gemm, cache=self.tuning_cache, preload=gemm_preload, tma=gemm_tma,
                                   mid=gemm_mid)
        self.attend = AttentionPicker(device, enabled=tune_attention, cache=self.tuning_cache,
                                      merge_apart=attention_merge_apart)
        self.buffers = EngineBuffers.allocate(w, batch, device, dtype, self.vision_dtype)
        self._staging: dict[tuple, tuple] = {}  # set_observation's views of `buffers` (_staging_views; _resize clears)
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}
        # Tickets of the split kernels' in-kernel reductions, one buffer per stage: the stage graphs may
        # replay concurrently on different streams (observe beside act) and must not share them.
        # (the decision graph has none of its own: its observe and act parts each enter their stage's)
        self._tickets = {stage: K.new_semaphore_workspace(device) for stage in ("observe", "act")}
        self._pool = None
        self._act_stream = None  # overlap_decision's second stream (created on the first decision)
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
        if self.patch_gemm:  # the position embedding is added by the first LayerNorm's kernel
            x, h = K.add_layer_norm(patch_embed(pixels, w.patch_w, w.patch_b, self._patch_mat), w.pos_emb,
                                    layers[0].ln1_w, layers[0].ln1_b, eps, backend=be)
        else:
            x = F.conv2d(pixels, w.patch_w, w.patch_b, stride=vc.patch)
            x = (x.flatten(2).transpose(1, 2) + w.pos_emb).contiguous()
            h = K.layer_norm(x, layers[0].ln1_w, layers[0].ln1_b, eps, backend=be)
        n, t = x.shape[:2]
        for i, L in enumerate(layers):
            qkv = lin(h, L.qkv_w, L.qkv_b).view(n, t, 3, vc.heads, vc.head_dim)
            # q stays token-major; k / v are [N, H, T, Dh] views of the same GEMM output (no copies).
            a = self.attend(qkv[:, :, 0], qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2), backend=be)
            o = lin(a.reshape(n, t, vc.hidden), L.out_w, L.out_b)
            x, h = K.add_layer_norm(o, x, L.ln2_w, L.ln2_b, eps, residual_out=x, backend=be)
            if self.gelu_epilogue and h.is_cuda:
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
        # The pad mask and valid count first: they depend on the masks only (overlap_decision's act stream
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
        if not self.rope_in_attention:  # the split/rotate kernel's outputs (the other path reads the QKV output)
            suffix_k = torch.empty(b, e.kv_heads, chunk, e.head_dim, device=self.device, dtype=self.dtype)
            suffix_v = torch.empty_like(suffix_k)
        if self.rope_in_gemm:  # what the QKV GEMM's epilogue writes
            q_buf = torch.empty(b, chunk, e.heads, e.head_dim, device=self.device, dtype=self.dtype)
            qkv_out = QkvRope(positions, self.cos, self.sin, q_buf, suffix_k, suffix_v, e.heads, e.kv_heads)
        x_t = buf.noise.clone()
        layers = w.expert_layers
        pf = _expert_prefetch(layers, buf) if self.l2_prefetch else None
        if self.norm_in_gemm:  # the next AdaRMS's input (x * (1 + scale)) and its rows' sums of squares
            xs = torch.empty(b, chunk, e.width, device=self.device, dtype=self.dtype)
            sums = torch.empty(stat_chunks(e.width), b * chunk, device=self.device, dtype=torch.float32)

        def qkv_heads(L, i, step):
            """Layer i's q, own keys / values and the rotation the attention still applies (None: done), from
            the normed input h of the loop below (or xs / sums with norm_in_gemm), wherever this engine rotates."""
            norm = self._norm("qkv", sums, step, i) if self.norm_in_gemm else None
            x_in = xs if self.norm_in_gemm else h
            if self.rope_in_gemm:  # q, suffix_k and suffix_v straight from the GEMM's epilogue
                return lin.qkv_rope(x_in, L.qkv_w, qkv_out, norm=norm, backend=be), suffix_k, suffix_v, None
            qkv = lin(x_in, L.qkv_w, norm=norm, backend=be) if self.norm_in_gemm else \
                lin(x_in, L.qkv_w, defer=self.reduce_in_rotate)
            if self.rope_in_attention:  # strided views of the GEMM output; attention rotates q and k
                heads = qkv.view(b, chunk, e.heads + 2 * e.kv_heads, e.head_dim)
                return (heads[:, :, :e.heads], heads[:, :, e.heads:e.heads + e.kv_heads].transpose(1, 2),
                        heads[:, :, e.heads + e.kv_heads:].transpose(1, 2), (positions, self.cos, self.sin))
            q = K.qkv_rope_cache(qkv, positions, self.cos, self.sin, suffix_k, suffix_v, 0, num_q_heads=e.heads,
                                 num_kv_heads=e.kv_heads, prefetch=pf and pf["rotate"][i],
                                 constant_positions=self.early_positions, backend=be)
            return q, suffix_k, suffix_v, None
        for step in range(c.num_steps):
            x_in = x_t if self.fused_euler else x_t.to(self.dtype)  # (fused_euler: rounded on load)
            if self.norm_in_gemm:
                x = lin(x_in, w.action_in_w, w.action_in_b, emit=RowStats(w.ada_attn[step, 0, 0], xs, sums),
                        backend=be)
            else:
                x = lin(x_in, w.action_in_w, w.action_in_b)
                mod = w.ada_attn[step, 0]
                h = K.ada_rms_norm(x, mod[0], mod[1], eps, prefetch=pf and pf["start"],
                                   constant_mod=self.early_modulation, backend=be)
            for i, L in enumerate(layers):
                q, k2, v2, rope = qkv_heads(L, i, step)
                if prefix_wait is not None and step == 0:
                    prefix_wait(i)
                # Action tokens see the valid prefix (cached K/V, pad mask) and every action token.
                a = self.attend(q, buf.prefix_k[i], buf.prefix_v[i], key_mask=buf.pad_mask, k2=k2, v2=v2, rope=rope,
                                backend=be)
                if self.norm_in_gemm:
                    lin(a.flatten(2), L.o_w, residual=GatedResidual(x, w.ada_attn[step, i, 2]),
                        emit=RowStats(w.ada_mlp[step, i, 0], xs, sums), backend=be)
                    g = lin.geglu(xs, L.gate_up_w, norm=self._norm("gate_up", sums, step, i), backend=be)
                    following = w.ada_attn[step, i + 1, 0] if i + 1 < len(layers) else w.ada_final[step, 0]
                    lin(g, L.down_w, residual=GatedResidual(x, w.ada_mlp[step, i, 2]),
                        emit=RowStats(following, xs, sums), backend=be)
                    continue
                o = lin(a.flatten(2), L.o_w, defer=self.reduce_in_norm)
                gate, mod = w.ada_attn[step, i, 2], w.ada_mlp[step, i]
                x, h = K.gated_residual_ada_rms_norm(x, o, gate, mod[0], mod[1], eps, x_out=x,
                                                     prefetch=pf and pf["attn_norm"][i],
                                                     constant_mod=self.early_modulation, backend=be)
                d = lin(lin.geglu(h, L.gate_up_w, backend=be), L.down_w, defer=self.reduce_in_norm)
                gate = w.ada_mlp[step, i, 2]
                mod = w.ada_attn[step, i + 1] if i + 1 < len(layers) else w.ada_final[step]
                x, h = K.gated_residual_ada_rms_norm(x, d, gate, mod[0], mod[1], eps, x_out=x,
                                                     prefetch=pf and pf["mlp_norm"][i],
                                                     constant_mod=self.early_modulation, backend=be)
            euler = GatedResidual(x_t, self._dt) if self.fused_euler else None  # x_t += dt * velocity, in the GEMM
            if self.norm_in_gemm:
                velocity = lin(xs, w.action_out_w, w.action_out_b, norm=self._norm("out", sums, step),
                               residual=euler, backend=be)
            else:
                velocity = lin(h, w.action_out_w, w.action_out_b, residual=euler)
            if not self.fused_euler:
                x_t.add_(velocity, alpha=w.dt)  # fp32 += dt * bf16 in one kernel (the upcast is exact)
        buf.actions.copy_(x_t)

    def _norm(self, gemm: str, sums: torch.Tensor, step: int, layer: int | None = None) -> RowNorm:
        """The AdaRMS fused into the expert GEMM `gemm` ("qkv", "gate_up" or "out") at a step and layer."""
        shift_w = self._shift_w[gemm][step] if layer is None else self._shift_w[gemm][step, layer]
        return RowNorm(sums, shift_w, self.config.rms_eps)

    def _decision_body(self, hooks: DecisionHooks | None = None) -> None:
        """observe then act, each between its hooks; with overlap_decision on CUDA the act stage (and its hooks)
        runs on a second stream that waits for each prefix layer's K/V only where its first flow step reads
        them (fork and join: capturable)."""
        h = hooks or DecisionHooks()
        if not (self.overlap_decision and self.device.type == "cuda"):
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
        observe stage just wrote into the engine's buffers. With overlap_decision act_pre, the act stage and
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
        if stage in ("act", "decision") and self.rerank_in_graph and not self._reranked:
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
        median of `iters`: what `engine_rerank` compares. (A capture that fails part-way is not recoverable in
        this process on the H200 with torch 2.11: every later capture fails, "already recording to mempool_id",
        and so do other engines' (benchmarks/results/gpu_tests_h200_7a3ec9c_failed_capture.log). Each candidate runs
        eagerly first and the body is the one the main capture records, so none is expected to fail here.)"""
        graph = self._capture("act", self._act_body, keep=False)
        return statistics.median(cuda_samples(graph.replay, warmup=1, iters=iters))

    def capture(self) -> None:
        """Capture both stage graphs now, and with overlap_decision the decision graph (otherwise each is
        captured on its first use)."""
        for stage, body in (("observe", self._observe_body), ("act", self._act_body)):
            if stage not in self._graphs:
                self._capture(stage, body)
        if self.overlap_decision:
            self._hooked_graph("decision", "decision", self._decision_body)

    def observe(self) -> None:
        """Run the `observe` stage on the current buffer contents (graph replay on CUDA)."""
        self._run("observe", self._observe_body)

    def act(self) -> None:
        """Run the `act` stage: buffers.noise + prefix buffers -> buffers.actions."""
        self._run("act", self._act_body)

    def decision(self) -> None:
        """A whole decision on the current buffers: images + prompt + noise -> prefix K/V and actions. Without
        overlap_decision the two stage graphs one after the other; with it one graph of its own, in which the
        act stage overlaps the observe stage (see `overlap_decision`)."""
        def stages():
            self.observe()
            self.act()
        if not self.overlap_decision:
            stages()
            return
        self._run_hooked("decision", "decision", self._decision_body, stages)  # (stages: where not captured)

    # ---- staged API (copies into the static buffers) --------------------------------------------------
    def _resize(self, batch: int) -> None:
        if batch != self.batch:  # a new batch size needs new buffers and therefore new graphs
            self.buffers = EngineBuffers.allocate(self.weights, batch, self.device, self.dtype, self.vision_dtype)
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


def _shift_projections(w: Pi05Weights) -> dict[str, torch.Tensor]:
    """weight @ shift in fp32 for every AdaRMS that the expert's GEMMs apply (`RowNorm.shift_w`):
    "qkv" and "gate_up" [steps, depth, N], "out" [steps, action_dim]; computed from the weights in the
    engine's dtype, which the GEMMs multiply."""
    def proj(shift, weight):
        return (shift.float() @ weight.float().t()).contiguous()
    return {"qkv": torch.stack([proj(w.ada_attn[:, i, 1], L.qkv_w) for i, L in enumerate(w.expert_layers)], 1),
            "gate_up": torch.stack([proj(w.ada_mlp[:, i, 1], L.gate_up_w) for i, L in enumerate(w.expert_layers)], 1),
            "out": proj(w.ada_final[:, 1], w.action_out_w)}


def _pack_expert(w: Pi05Weights) -> Pi05Weights:
    """A copy of `w` whose expert GEMM weights all live in one block, layer after layer, each layer's in the
    order its GEMMs run (qkv, o, gate|up, down): the weights that follow a point of the layer are then one
    contiguous byte range, which one prefetch covers. The other fields are shared with `w`."""
    names = ("qkv_w", "o_w", "gate_up_w", "down_w")
    layers = w.expert_layers
    first = getattr(layers[0], names[0])
    block = torch.empty(sum(getattr(L, n).numel() for L in layers for n in names), dtype=first.dtype,
                        device=first.device)
    packed, offset = [], 0
    for L in layers:
        views = {}
        for n in names:
            t = getattr(L, n)
            views[n] = block[offset:offset + t.numel()].view(t.shape)
            views[n].copy_(t)
            offset += t.numel()
        packed.append(dataclasses.replace(L, **views))
    return dataclasses.replace(w, expert_layers=packed)


def _span(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The bytes from `first` to the end of `last` (adjacent views of one block) as one flat view."""
    n = (last.data_ptr() - first.data_ptr()) // first.element_size() + last.numel()
    return first.as_strided((n,), (1,))


def _expert_prefetch(layers, buf: EngineBuffers) -> dict:
    """What each glue kernel of the action expert warms into L2 (`l2_prefetch`), one layer of reads ahead:
      rotate[i] (before layer i's attention): layer i's o, gate|up and down weights, read after it;
      attn_norm[i] (after o): layer i + 1's QKV weights and cached prefix K (the next step's layer 0
        after the last layer), read after the MLP;
      mlp_norm[i] (after down): layer i + 1's cached prefix V, read by the next attention;
      start (each step's first norm): layer 0's QKV weights and prefix K (for the first step; later
        steps find them already warm).
    At most ~30 MB (o..down of a layer) is in flight, well inside the H200's 50 MB L2."""
    n = len(layers)
    return {"rotate": [(_span(L.o_w, L.down_w),) for L in layers],
            "attn_norm": [(layers[(i + 1) % n].qkv_w, buf.prefix_k[(i + 1) % n]) for i in range(n)],
            "mlp_norm": [(buf.prefix_v[(i + 1) % n],) for i in range(n)],
            "start": (layers[0].qkv_w, buf.prefix_k[0])}


def make_engine(weights: Pi05Weights) -> Pi05Engine:
    """The `Pi05Policy` engine hook: the fused engine on the weights' own device and dtype."""
    return Pi05Engine(weights)
