"""Sizes of a SmolVLA model (LeRobot 0.6.1 `policies/smolvla`), as plain frozen data.

SmolVLA = SmolVLM2 (SigLIP vision tower + pixel-shuffle connector + the first `num_vlm_layers` SmolLM2 layers)
as the prefix, and a narrower Llama "action expert" whose layers alternate between self-attention over
prefix + actions and cross-attention to the VLM layer's K/V (every `self_attn_every_n_layers`-th layer is a
self-attention one). `from_lerobot` reads the sizes from LeRobot's config.json plus the VLM's HF config (the
`config.json` of `vlm_model_name`, a transformers SmolVLMConfig), deriving the expert exactly as
`SmolVLMWithExpertModel.__init__` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from flashrt_core.errors import CheckpointError


@dataclass(frozen=True)
class SigLIPConfig:
    """The SmolVLM vision tower: pre-LayerNorm ViT, biases everywhere, gelu-tanh MLP."""

    hidden: int
    mlp: int
    layers: int
    heads: int
    image_size: int = 512  # the position table's grid (image_size / patch per side)
    patch: int = 16
    ln_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2


@dataclass(frozen=True)
class LlamaConfig:
    """One Llama tower (SmolLM2 layers of the VLM, or the action expert)."""

    width: int
    depth: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class SmolVLAConfig:
    vision: SigLIPConfig
    vlm: LlamaConfig  # depth = num_vlm_layers: only the first layers are kept
    expert: LlamaConfig
    vocab_size: int
    scale_factor: int = 4  # pixel shuffle: scale_factor^2 patches -> one image token
    image_size: int = 512  # LeRobot's resize_imgs_with_padding: the size images enter SigLIP at
    self_attn_every_n_layers: int = 2
    chunk_size: int = 50
    max_action_dim: int = 32
    max_state_dim: int = 32
    num_steps: int = 10
    tokenizer_max_length: int = 48
    min_period: float = 4e-3
    max_period: float = 4.0
    num_image_slots: int = 3
    rms_eps: float = 1e-5
    # LeRobot's smolvla apply_rope hard-codes max_wavelength=10_000, whatever the text config's rope_theta
    # (100000 for SmolLM2-360M): 10000 is what the checkpoints were trained with.
    rope_theta: float = 10000.0
    add_image_special_tokens: bool = False
    # token ids of `<fake_token_around_image>` and `<global-img>` (from the tokenizer): only with the above
    fake_image_token_id: int = -1
    global_image_token_id: int = -1

    def __post_init__(self):
        for name in ("vocab_size", "scale_factor", "image_size", "chunk_size", "max_action_dim", "max_state_dim",
                     "num_steps", "tokenizer_max_length", "num_image_slots"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("min_period", "max_period", "rms_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        v, g, e = self.vision, self.vlm, self.expert
        if v.hidden % v.heads or self.image_size % v.patch:
            raise ValueError(f"vision: hidden {v.hidden} / heads {v.heads}, image {self.image_size} / patch {v.patch}")
        side = self.image_size // v.patch
        if side % self.scale_factor:
            raise ValueError(f"{side} patches per side do not shuffle by scale_factor {self.scale_factor}")
        for t, name in ((g, "vlm"), (e, "expert")):
            if min(t.heads, t.kv_heads, t.head_dim, t.depth) < 1 or t.heads % t.kv_heads:
                raise ValueError(f"{name}: heads {t.heads} must be a positive multiple of kv_heads {t.kv_heads}")
        if g.depth % e.depth:
            raise ValueError(f"vlm depth {g.depth} is not a multiple of the expert's {e.depth}")
        if (g.heads, g.kv_heads, g.head_dim) != (e.heads, e.kv_heads, e.head_dim):
            # LeRobot's expert config is a copy of the text config with only the widths changed, and its
            # attention uses the VLM's head counts for both towers
            raise ValueError("vlm and expert must share heads, kv_heads and head_dim")
        if self.add_image_special_tokens and min(self.fake_image_token_id, self.global_image_token_id) < 0:
            raise ValueError("add_image_special_tokens needs fake_image_token_id and global_image_token_id")

    # ---- derived sizes --------------------------------------------------------------------------------
    @property
    def patches(self) -> int:
        """SigLIP patches of one image at `image_size`."""
        return (self.image_size // self.vision.patch) ** 2

    @property
    def image_tokens(self) -> int:
        """Connector tokens of one image (pixel shuffle folds scale_factor^2 patches into one)."""
        return self.patches // self.scale_factor ** 2

    @property
    def slot_tokens(self) -> int:
        """Prefix tokens of one image slot: its image tokens, with LeRobot's special tokens around them when on
        (<fake_token_around_image><global-img> ... <fake_token_around_image>)."""
        return self.image_tokens + (3 if self.add_image_special_tokens else 0)

    @property
    def prefix_len(self) -> int:
        """Fixed prefix: every image slot, the padded prompt, one state token (last)."""
        return self.num_image_slots * self.slot_tokens + self.tokenizer_max_length + 1

    @property
    def expert_stride(self) -> int:
        """VLM layers per expert layer (LeRobot's `multiple_of`): VLM layer i has expert layer i // stride where
        i % stride == 0, and none (the suffix passes through unchanged) elsewhere."""
        return self.vlm.depth // self.expert.depth

    def expert_layer(self, i: int) -> int | None:
        return i // self.expert_stride if i % self.expert_stride == 0 else None

    def is_cross(self, i: int) -> bool:
        """VLM layer i's expert layer cross-attends to the VLM's K/V (else self-attention over prefix + actions)."""
        n = self.self_attn_every_n_layers
        return not (n > 0 and i % n == 0)

    @property
    def action_dim(self) -> int:
        """The width of noise and actions (LeRobot's max_action_dim), under the name every policy reads."""
        return self.max_action_dim

    @property
    def dt(self) -> float:
        return -1.0 / self.num_steps

    # ---- constructors -------------------------------------------------------------------------------
    @classmethod
    def full_size(cls) -> "SmolVLAConfig":
        """`lerobot/smolvla_base` over HuggingFaceTB/SmolVLM2-500M-Video-Instruct."""
        return cls(
            # vision_config of SmolVLM2-500M-Video-Instruct's config.json (SigLIP base patch16-512): hidden 768,
            # intermediate 3072, 12 layers, 12 heads, image_size 512, patch_size 16, layer_norm_eps 1e-6
            vision=SigLIPConfig(hidden=768, mlp=3072, layers=12, heads=12, image_size=512, patch=16),
            # text_config (SmolLM2-360M): hidden 960, 15 heads x 64, 5 KV heads, intermediate 2560, 32 layers of
            # which LeRobot's num_vlm_layers (16, SmolVLAConfig default and smolvla_base) are kept
            vlm=LlamaConfig(width=960, depth=16, mlp=2560, heads=15, kv_heads=5, head_dim=64),
            # expert: width int(960 * expert_width_multiplier 0.75) = 720, mlp get_intermediate_size(720) = 2048
            # (smolvlm_with_expert.py), heads copied from the text config, one layer per VLM layer
            expert=LlamaConfig(width=720, depth=16, mlp=expert_mlp(720), heads=15, kv_heads=5, head_dim=64),
            vocab_size=49280,  # text_config.vocab_size
            scale_factor=4,  # SmolVLMConfig.scale_factor: 1024 patches -> 64 tokens per image
            # the rest: LeRobot 0.6.1 SmolVLAConfig defaults (configuration_smolvla.py), as in smolvla_base;
            # rms_norm_eps 1e-5 from the text config; three cameras as smolvla_base's input_features
            image_size=512, self_attn_every_n_layers=2, chunk_size=50, max_action_dim=32, max_state_dim=32,
            num_steps=10, tokenizer_max_length=48, min_period=4e-3, max_period=4.0, num_image_slots=3,
            rms_eps=1e-5,
        )

    @classmethod
    def from_lerobot(cls, config_json: Mapping, vlm_config: Mapping, *, num_image_slots: int | None = None,
                     special_token_ids: tuple[int, int] | None = None) -> "SmolVLAConfig":
        """Sizes from LeRobot's config.json (`type: smolvla`) and the VLM's HF config.json (SmolVLMConfig, with
        `vision_config` and `text_config`). num_image_slots: default the VISUAL input features plus
        `empty_cameras`. special_token_ids: (fake_image_token_id, global_image_token_id) from the tokenizer,
        needed only with `add_image_special_tokens`. Raises CheckpointError naming the field at fault."""
        lr, vc = dict(config_json or {}), dict(vlm_config or {})
        if lr.get("type", "smolvla") != "smolvla":
            raise CheckpointError(f"config.json type: {lr.get('type')!r} is not smolvla")
        for name in ("vision_config", "text_config"):
            if not isinstance(vc.get(name), Mapping):
                raise CheckpointError(f"VLM config.json {name}: missing (not a SmolVLMConfig)")
        vis, txt = dict(vc["vision_config"]), dict(vc["text_config"])

        def num(where: str, d: Mapping, key: str, default=None, whole=True):
            value = d.get(key, default)
            if value is None:
                raise CheckpointError(f"{where} {key}: missing")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and value != int(value)):
                raise CheckpointError(f"{where} {key}: expected a {'whole ' if whole else ''}number, got {value!r}")
            return int(value) if whole else float(value)

        V, T, L = "VLM config.json vision_config", "VLM config.json text_config", "config.json"
        # transformers 5.5 SmolVLMVisionConfig / LlamaConfig defaults where a saved config leaves a field out
        vision = SigLIPConfig(hidden=num(V, vis, "hidden_size", 1152), mlp=num(V, vis, "intermediate_size", 3072),
                              layers=num(V, vis, "num_hidden_layers", 12), heads=num(V, vis, "num_attention_heads", 16),
                              image_size=num(V, vis, "image_size", 224), patch=num(V, vis, "patch_size", 32),
                              ln_eps=num(V, vis, "layer_norm_eps", 1e-6, whole=False))
        width, heads = num(T, txt, "hidden_size"), num(T, txt, "num_attention_heads")
        kv_heads = num(T, txt, "num_key_value_heads", heads)
        head_dim = txt.get("head_dim") or width // heads
        head_dim = num(T, {"head_dim": head_dim}, "head_dim")
        total = num(T, txt, "num_hidden_layers")
        kept = num(L, lr, "num_vlm_layers", 16)
        depth = kept if kept > 0 else total
        if depth > total:
            raise CheckpointError(f"config.json num_vlm_layers: {kept} but the text model has {total} layers")
        mult = num(L, lr, "expert_width_multiplier", 0.75, whole=False)
        e_width = int(width * mult)  # as LeRobot: int(hidden_size * expert_width_multiplier)
        n_expert = num(L, lr, "num_expert_layers", -1)
        if n_expert > 0 and depth % n_expert:
            raise CheckpointError(f"config.json num_expert_layers: {n_expert} does not divide num_vlm_layers {depth}")
        if lr.get("attention_mode", "cross_attn") != "cross_attn":
            raise CheckpointError(f"config.json attention_mode: {lr.get('attention_mode')!r} (only cross_attn)")
        size = lr.get("resize_imgs_with_padding", (512, 512))
        if not isinstance(size, (list, tuple)) or len(size) != 2 or size[0] != size[1]:
            raise CheckpointError(f"config.json resize_imgs_with_padding: {size!r} (a square size is supported)")
        features = lr.get("input_features") or {}
        if not isinstance(features, Mapping) or not all(isinstance(f, Mapping) for f in features.values()):
            raise CheckpointError("config.json input_features: expected an object of feature objects")
        cams = sum(1 for f in features.values() if f.get("type") == "VISUAL") + num(L, lr, "empty_cameras", 0)
        special = bool(lr.get("add_image_special_tokens", False))
        if special and special_token_ids is None:
            raise CheckpointError("config.json add_image_special_tokens: true needs the tokenizer's "
                                  "fake_image_token_id and global_image_token_id (special_token_ids=)")
        fake, glob = special_token_ids if special else (-1, -1)
        try:
            return cls(
                vision=vision,
                vlm=LlamaConfig(width=width, depth=depth, mlp=num(T, txt, "intermediate_size"), heads=heads,
                                kv_heads=kv_heads, head_dim=head_dim),
                expert=LlamaConfig(width=e_width, depth=n_expert if n_expert > 0 else depth, mlp=expert_mlp(e_width),
                                   heads=heads, kv_heads=kv_heads, head_dim=head_dim),
                vocab_size=num(T, txt, "vocab_size"), scale_factor=num("VLM config.json", vc, "scale_factor", 2),
                image_size=int(size[0]), self_attn_every_n_layers=num(L, lr, "self_attn_every_n_layers", 2),
                chunk_size=num(L, lr, "chunk_size", 50), max_action_dim=num(L, lr, "max_action_dim", 32),
                max_state_dim=num(L, lr, "max_state_dim", 32), num_steps=num(L, lr, "num_steps", 10),
                tokenizer_max_length=num(L, lr, "tokenizer_max_length", 48),
                min_period=num(L, lr, "min_period", 4e-3, whole=False),
                max_period=num(L, lr, "max_period", 4.0, whole=False),
                num_image_slots=num_image_slots or cams or 1, rms_eps=num(T, txt, "rms_norm_eps", 1e-6, whole=False),
                add_image_special_tokens=special, fake_image_token_id=int(fake), global_image_token_id=int(glob),
            )
        except ValueError as exc:
            raise CheckpointError(f"inconsistent SmolVLA config: {exc}") from None


def expert_mlp(width: int, ffn_dim_multiplier: int = 4, multiple_of: int = 256) -> int:
    """The expert's MLP size for its width, as LeRobot's `get_intermediate_size` derives it (2/3 of 4x, rounded
    up to a multiple of 256)."""
    hidden = int(ffn_dim_multiplier * int(2 * width / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
