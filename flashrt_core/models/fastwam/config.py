"""Sizes of a FastWAM model (LeRobot 0.6.1 `policies/fastwam`), as plain frozen data.

FastWAM is a mixture-of-transformers over two DiTs that share their layer count and attention heads: the
Wan2.2-TI2V-5B video DiT (`WanVideoDiT`) and a narrower action DiT (`ActionDiT`). At inference the video DiT
runs once over the first frame's VAE latents (flow time 0) and leaves, per layer, the K/V the action DiT's
self-attention reads beside its own (`MoT.prefill_video_cache`); the action DiT then takes `num_steps` Euler
steps over that cache. Both cross-attend to the same context: the UMT5 prompt embedding plus one proprio token.
`from_lerobot` reads LeRobot's config.json (`type: fastwam`); the VAE and UMT5 encoder are sized by their own
configs (encoders.py) and only their output widths (`latent_channels`, `text_dim`) meet this one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from flashrt_core.errors import CheckpointError


@dataclass(frozen=True)
class DiTConfig:
    """One expert tower: Wan attention blocks (AdaLN modulation, RMS-normed q/k, cross-attention to the context,
    gelu-tanh FFN). `heads * head_dim` may differ from `hidden` (the action DiT projects 1024 -> 24 x 128)."""

    hidden: int
    ffn: int
    heads: int
    head_dim: int
    layers: int
    freq_dim: int = 256  # sinusoidal time-embedding width
    eps: float = 1e-6  # every LayerNorm and the q/k RMSNorms

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class FastWAMConfig:
    video: DiTConfig
    action: DiTConfig
    action_dim: int = 7
    proprio_dim: int | None = 8  # None: no proprio token in the context
    text_dim: int = 4096  # UMT5-XXL d_model: the context's width
    latent_channels: int = 48  # Wan2.2 VAE z_dim (the video DiT's in_dim / out_dim)
    patch: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) of the video DiT's Conv3d patch embedding
    vae_stride: int = 16  # Wan2.2 VAE spatial compression
    image_size: tuple[int, int] = (224, 448)  # (H, W): the cameras side by side
    action_horizon: int = 32
    num_steps: int = 10
    context_len: int = 128  # prompt tokens (LeRobot's tokenizer_max_len; the proprio token comes after them)
    shift: float = 5.0  # action_scheduler.infer_shift (or sigma_shift when set)
    num_train_timesteps: int = 1000  # flow time t in [0, 1] enters the DiTs as t * num_train_timesteps
    rope_theta: float = 10000.0  # Wan's rope_params default, for both DiTs

    def __post_init__(self):
        for name in ("action_dim", "text_dim", "latent_channels", "vae_stride", "action_horizon", "num_steps",
                     "context_len", "num_train_timesteps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.proprio_dim is not None and (not isinstance(self.proprio_dim, int) or self.proprio_dim < 1):
            raise ValueError(f"proprio_dim must be a positive integer or None, got {self.proprio_dim!r}")
        for name in ("shift", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        for name, t in (("video", self.video), ("action", self.action)):
            if min(t.hidden, t.ffn, t.heads, t.head_dim, t.layers, t.freq_dim) < 1:
                raise ValueError(f"{name}: every size must be positive, got {t}")
            if t.head_dim % 2 or t.freq_dim % 2:
                raise ValueError(f"{name}: head_dim {t.head_dim} and freq_dim {t.freq_dim} must be even (RoPE, sincos)")
        v, a = self.video, self.action
        if v.attn_dim != v.hidden:
            # WanVideoDiT: attn_head_dim must equal hidden_dim // num_heads
            raise ValueError(f"video: heads {v.heads} x head_dim {v.head_dim} != hidden {v.hidden}")
        if (v.heads, v.head_dim, v.layers) != (a.heads, a.head_dim, a.layers):
            # MoT: the action queries attend to the video K/V head by head, layer by layer
            raise ValueError(f"video and action DiTs must share heads, head_dim and layers: {v} vs {a}")
        if v.head_dim // 2 < 3:
            raise ValueError(f"video head_dim {v.head_dim} too small for the 3-axis (frame, row, column) RoPE")
        if len(self.patch) != 3 or min(self.patch) < 1:
            raise ValueError(f"patch must be three positive sizes, got {self.patch!r}")
        h, w = self.image_size
        step_h, step_w = self.vae_stride * self.patch[1], self.vae_stride * self.patch[2]
        if h % step_h or w % step_w:
            raise ValueError(f"image_size {self.image_size} must be a multiple of vae_stride x patch ({step_h}, {step_w})")

    # ---- derived sizes --------------------------------------------------------------------------------
    @property
    def latent_hw(self) -> tuple[int, int]:
        """The first frame's latent grid (VAE output), H / 16 x W / 16."""
        return self.image_size[0] // self.vae_stride, self.image_size[1] // self.vae_stride

    @property
    def video_grid(self) -> tuple[int, int, int]:
        """(frames, rows, columns) of the video DiT's tokens for the one observed frame."""
        lh, lw = self.latent_hw
        return 1, lh // self.patch[1], lw // self.patch[2]

    @property
    def video_tokens(self) -> int:
        f, h, w = self.video_grid
        return f * h * w

    @property
    def context_tokens(self) -> int:
        """Context rows both DiTs cross-attend to: the padded prompt, then the proprio token when there is one."""
        return self.context_len + (0 if self.proprio_dim is None else 1)

    # ---- constructors -------------------------------------------------------------------------------
    @classmethod
    def full_size(cls, action_dim: int = 7, proprio_dim: int | None = 8) -> "FastWAMConfig":
        """LeRobot 0.6.1's FastWAM defaults (configuration_fastwam.py) over Wan2.2-TI2V-5B."""
        return cls(
            # default_video_dit_config: hidden_dim 3072, ffn_dim 14336, num_heads 24, attn_head_dim 128,
            # num_layers 30, freq_dim 256, eps 1e-6, in_dim = out_dim 48, patch_size [1, 2, 2], text_dim 4096
            video=DiTConfig(hidden=3072, ffn=14336, heads=24, head_dim=128, layers=30, freq_dim=256, eps=1e-6),
            # default_action_dit_config: hidden_dim 1024, ffn_dim 4096, num_heads 24, attn_head_dim 128 (24 x 128
            # = 3072 attention width from a 1024 stream: _FastWAMProjectedAttention), num_layers 30
            action=DiTConfig(hidden=1024, ffn=4096, heads=24, head_dim=128, layers=30, freq_dim=256, eps=1e-6),
            # FastWAMConfig defaults: action_dim 7, proprio_dim 8, action_horizon 32, image_size (224, 448),
            # context_len = tokenizer_max_len 128, num_inference_steps 10, action_scheduler infer_shift 5.0 over
            # num_train_timesteps 1000; WanVideoVAE38: z_dim 48, upsampling_factor 16
            action_dim=action_dim, proprio_dim=proprio_dim, text_dim=4096, latent_channels=48, patch=(1, 2, 2),
            vae_stride=16, image_size=(224, 448), action_horizon=32, num_steps=10, context_len=128, shift=5.0,
            num_train_timesteps=1000,
        )

    @classmethod
    def from_lerobot(cls, config_json: Mapping, *, num_steps: int | None = None) -> "FastWAMConfig":
        """Sizes from LeRobot's config.json (`type: fastwam`); LeRobot's defaults where a field is left out (as
        FastWAMConfig.__post_init__ fills them). num_steps overrides num_inference_steps. Raises CheckpointError
        naming the field at fault."""
        lr = dict(config_json or {})
        if lr.get("type", "fastwam") != "fastwam":
            raise CheckpointError(f"config.json type: {lr.get('type')!r} is not fastwam")
        full = cls.full_size()

        def section(key: str) -> dict:
            value = lr.get(key)
            if value is None:  # LeRobot: default_video_dit_config / default_action_dit_config
                return {}
            if not isinstance(value, Mapping):
                raise CheckpointError(f"config.json {key}: expected an object, got {type(value).__name__}")
            return dict(value)

        def num(where: str, d: Mapping, key: str, default, whole=True):
            value = d.get(key, default)
            if value is None:
                raise CheckpointError(f"{where}{key}: missing")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and value != int(value)):
                raise CheckpointError(f"{where}{key}: expected a {'whole ' if whole else ''}number, got {value!r}")
            if value <= 0:
                raise CheckpointError(f"{where}{key}: must be positive, got {value!r}")
            return int(value) if whole else float(value)

        V, A, L = "config.json video_dit_config.", "config.json action_dit_config.", "config.json "
        vd, ad = section("video_dit_config"), section("action_dit_config")

        def dit(where: str, d: dict, ref: DiTConfig) -> DiTConfig:
            return DiTConfig(hidden=num(where, d, "hidden_dim", ref.hidden), ffn=num(where, d, "ffn_dim", ref.ffn),
                             heads=num(where, d, "num_heads", ref.heads),
                             head_dim=num(where, d, "attn_head_dim", ref.head_dim),
                             layers=num(where, d, "num_layers", ref.layers),
                             freq_dim=num(where, d, "freq_dim", ref.freq_dim),
                             eps=num(where, d, "eps", ref.eps, whole=False))

        video, action = dit(V, vd, full.video), dit(A, ad, full.action)
        # the parts of Wan's DiT FastWAM's inference path supports
        if vd.get("video_attention_mask_mode", "first_frame_causal") != "first_frame_causal":
            raise CheckpointError(f"{V}video_attention_mask_mode: {vd['video_attention_mask_mode']!r} "
                                  "(infer_action requires first_frame_causal)")
        if not vd.get("seperated_timestep", True):
            raise CheckpointError(f"{V}seperated_timestep: false (FastWAM requires per-token timesteps)")
        patch = vd.get("patch_size", [1, 2, 2])
        if not isinstance(patch, (list, tuple)) or len(patch) != 3 or not all(isinstance(p, int) and p > 0 for p in patch):
            raise CheckpointError(f"{V}patch_size: expected three positive integers, got {patch!r}")
        if patch[0] != 1:
            raise CheckpointError(f"{V}patch_size: temporal patch {patch[0]} (the one-frame prefill needs 1)")
        in_dim = num(V, vd, "in_dim", 48)
        if num(V, vd, "out_dim", 48) != in_dim:
            raise CheckpointError(f"{V}out_dim: {vd.get('out_dim')} differs from in_dim {in_dim}")
        text_dim = num(V, vd, "text_dim", 4096)
        if num(A, ad, "text_dim", text_dim) != text_dim:
            raise CheckpointError(f"{A}text_dim: {ad.get('text_dim')} differs from the video DiT's {text_dim}")
        action_dim = num(L, lr, "action_dim", 7)
        if num(A, ad, "action_dim", action_dim) != action_dim:
            raise CheckpointError(f"{A}action_dim: {ad.get('action_dim')} differs from action_dim {action_dim}")
        proprio = lr.get("proprio_dim", 8)
        proprio_dim = None if proprio is None else num(L, lr, "proprio_dim", 8)
        size = lr.get("image_size", (224, 448))
        if not isinstance(size, (list, tuple)) or len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
            raise CheckpointError(f"config.json image_size: expected (height, width), got {size!r}")
        sched = lr.get("action_scheduler") or {}
        if not isinstance(sched, Mapping):
            raise CheckpointError("config.json action_scheduler: expected an object")
        shift = lr.get("sigma_shift")
        shift = num(L, lr, "sigma_shift", 5.0, whole=False) if shift is not None else \
            num("config.json action_scheduler.", sched, "infer_shift", 5.0, whole=False)
        if lr.get("text_cfg_scale", 1.0) != 1.0:
            # infer_action ignores it; a checkpoint asking for guidance would silently not get it
            raise CheckpointError(f"config.json text_cfg_scale: {lr['text_cfg_scale']!r} (infer_action has no CFG)")
        try:
            return cls(
                video=video, action=action, action_dim=action_dim, proprio_dim=proprio_dim, text_dim=text_dim,
                latent_channels=in_dim, patch=tuple(int(p) for p in patch), vae_stride=16,
                image_size=(int(size[0]), int(size[1])), action_horizon=num(L, lr, "action_horizon", 32),
                num_steps=num_steps or num(L, lr, "num_inference_steps", 10),
                context_len=num(L, lr, "tokenizer_max_len", 128), shift=shift,
                num_train_timesteps=num("config.json action_scheduler.", sched, "num_train_timesteps", 1000),
            )
        except ValueError as exc:
            raise CheckpointError(f"inconsistent FastWAM config: {exc}") from None
