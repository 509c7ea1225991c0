"""Sizes of a PaliGemma-prefix flow policy (SigLIP + PaliGemma prefix + Gemma action expert), as plain frozen data.

Each model of the family (`registry.kinds("paligemma")`) subclasses `PaliGemmaConfig` with its own `kind`
default and the checkpoint keys of its action expert (`expert_keys`); the shared fields and readers are here.

The JSON form (`to_json` / `from_json`) is a superset of the `dims.json` written next to the LeRobot golden
fixtures, so one file format describes both the fixtures and the checkpoints this project saves.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from flashrt_core.errors import CheckpointError
from flashrt_core.models import registry

# LeRobot key prefixes (model.safetensors layout of the family's save_pretrained()).
FAMILY = "paligemma"
PG = "model.paligemma_with_expert.paligemma.model."
VISION = PG + "vision_tower.vision_model."
VLM = PG + "language_model."
EXPERT = "model.paligemma_with_expert.gemma_expert.model."


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP tower: pre-LayerNorm ViT with biases everywhere and a gelu-tanh MLP."""

    hidden: int
    mlp: int
    layers: int
    heads: int
    image_size: int = 224
    patch: int = 14

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch) ** 2


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma tower (the 2B prefix or the 300M action expert); `kv_heads` < `heads` is GQA/MQA."""

    width: int
    depth: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class PaliGemmaConfig:
    vision: VisionConfig
    vlm: GemmaConfig
    expert: GemmaConfig
    vocab_size: int
    chunk_size: int = 50
    action_dim: int = 32  # LeRobot's max_action_dim: the width of noise and actions
    state_dim: int = 32  # LeRobot's max_state_dim (pi0.5 puts the state in the prompt, not a tensor)
    num_steps: int = 10
    tokenizer_max_length: int = 200
    min_period: float = 4e-3
    max_period: float = 4.0
    num_image_slots: int = 3
    rms_eps: float = 1e-6  # Gemma RMSNorm and AdaRMS
    ln_eps: float = 1e-6  # SigLIP LayerNorm
    rope_theta: float = 10000.0
    kind: str = ""  # the registry kind (each model's subclass sets its own default)

    def __post_init__(self):
        if self.kind not in registry.kinds(FAMILY):
            raise ValueError(f"kind must be one of {', '.join(registry.kinds(FAMILY))}, got {self.kind!r}")
        own = registry.config_class(self.kind)
        if type(self) is not own:  # (the class is the model: its expert keys, its inputs)
            raise ValueError(f"a {self.kind} config is a {own.__name__}, not a {type(self).__name__}")
        for name in ("vocab_size", "chunk_size", "action_dim", "state_dim", "num_steps", "tokenizer_max_length",
                     "num_image_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("min_period", "max_period", "rms_eps", "ln_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.min_period >= self.max_period:
            raise ValueError(f"min_period ({self.min_period}) must be below max_period ({self.max_period})")
        for tower, name in ((self.vlm, "vlm"), (self.expert, "expert")):
            if tower.kv_heads < 1 or tower.heads < 1 or tower.head_dim < 1:
                raise ValueError(f"{name}: heads, kv_heads and head_dim must be positive, got "
                                 f"{tower.heads}, {tower.kv_heads}, {tower.head_dim}")
            if tower.heads % tower.kv_heads:
                raise ValueError(f"{name}.heads ({tower.heads}) must be a multiple of kv_heads ({tower.kv_heads})")
        if self.vlm.depth != self.expert.depth:
            raise ValueError(f"vlm.depth ({self.vlm.depth}) != expert.depth ({self.expert.depth}): "
                             "the expert reads the prefix K/V layer by layer")
        if (self.vlm.kv_heads, self.vlm.head_dim) != (self.expert.kv_heads, self.expert.head_dim):
            raise ValueError("vlm and expert must share kv_heads and head_dim (the expert attends to prefix K/V)")
        if self.vision.heads < 1 or self.vision.hidden % self.vision.heads:
            raise ValueError(f"vision.hidden ({self.vision.hidden}) not divisible by vision.heads")

    def as_kind(self, kind: str) -> "PaliGemmaConfig":
        """The same sizes as another member of the family (`kind`: its config class)."""
        own = registry.config_class(kind)
        return own(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "kind"})

    @property
    def prefix_len(self) -> int:
        """Fixed prefix length: every image slot's patches plus the padded prompt."""
        return self.num_image_slots * self.vision.num_patches + self.tokenizer_max_length

    # ---- constructors -------------------------------------------------------------------------------
    @classmethod
    def full(cls) -> "PaliGemmaConfig":
        """pi0.5 as released (`lerobot/pi05_base`): SigLIP so400m/14, Gemma 2B prefix, Gemma 300M expert."""
        return cls(
            vision=VisionConfig(hidden=1152, mlp=4304, layers=27, heads=16),
            vlm=GemmaConfig(width=2048, depth=18, mlp=16384, heads=8, kv_heads=1, head_dim=256),
            expert=GemmaConfig(width=1024, depth=18, mlp=4096, heads=8, kv_heads=1, head_dim=256),
            vocab_size=257152,
        )

    @classmethod
    def tiny(cls) -> "PaliGemmaConfig":
        """The built-in tiny model: the shapes of the LeRobot golden fixture (runs in milliseconds on CPU).

        The prompt length is 128 rather than the fixture's 16 so that a byte-level tiny prompt with a
        real task and state fits without truncation.
        """
        return cls(
            vision=VisionConfig(hidden=32, mlp=64, layers=2, heads=4),
            vlm=GemmaConfig(width=64, depth=2, mlp=128, heads=8, kv_heads=1, head_dim=16),
            expert=GemmaConfig(width=32, depth=2, mlp=64, heads=8, kv_heads=1, head_dim=16),
            vocab_size=1024,
            tokenizer_max_length=128,
        )

    @classmethod
    def from_state_dict_shapes(
        cls,
        shapes: Mapping[str, Sequence[int]],
        dims: Mapping | None = None,
        lerobot_config: Mapping | None = None,
    ) -> "PaliGemmaConfig":
        """Infer the sizes from checkpoint tensor shapes (LeRobot key layout).

        Read from shapes: every width, MLP size, layer count, patch size, image size (from the number of
        position embeddings), vocab, action dim, and `heads * head_dim` / `kv_heads * head_dim` of each tower.
        Shapes cannot split those products, nor give SigLIP's head count, so those come from `dims`
        (a dims.json / `to_json` dict) when given; otherwise the LeRobot convention is assumed: Gemma
        towers use one K/V head (MQA, as every pi0/pi0.5 variant does) and SigLIP heads are 72 wide
        (so400m). Run-time fields (chunk, steps, prompt length, periods, camera count) come from `dims`,
        else from LeRobot's `config.json` (`lerobot_config`), else the defaults.
        Raises CheckpointError naming the key or field that is missing or inconsistent.
        """
        dims = dict(dims or {})
        lr = dict(lerobot_config or {})

        def shape(key: str) -> tuple[int, ...]:
            if key not in shapes:
                raise CheckpointError(f"cannot infer pi0.5 sizes: key '{key}' is missing")
            return tuple(int(s) for s in shapes[key])

        def count_layers(prefix: str) -> int:
            pat = re.compile(re.escape(prefix) + r"(\d+)\.")
            idx = {int(m.group(1)) for k in shapes for m in [pat.match(k)] if m}
            if not idx:
                raise CheckpointError(f"cannot infer pi0.5 sizes: no keys under '{prefix}'")
            return max(idx) + 1

        patch_w = shape(VISION + "embeddings.patch_embedding.weight")
        v_hidden, patch = patch_w[0], patch_w[2]
        n_pos = shape(VISION + "embeddings.position_embedding.weight")[0]
        side = round(n_pos ** 0.5)
        if side * side != n_pos:
            raise CheckpointError(f"position_embedding has {n_pos} rows, not a square patch grid")
        vd = dims.get("vision", {})
        v_heads = vd.get("num_attention_heads")
        if v_heads is None:
            if v_hidden % 72:
                raise CheckpointError(
                    f"cannot infer SigLIP heads for hidden size {v_hidden}; give dims.json vision.num_attention_heads")
            v_heads = v_hidden // 72
        vision = VisionConfig(
            hidden=v_hidden,
            mlp=shape(VISION + "encoder.layers.0.mlp.fc1.weight")[0],
            layers=count_layers(VISION + "encoder.layers."),
            heads=int(v_heads),
            image_size=side * patch,
            patch=patch,
        )

        def tower(prefix: str, name: str) -> GemmaConfig:
            q = shape(prefix + "layers.0.self_attn.q_proj.weight")
            k = shape(prefix + "layers.0.self_attn.k_proj.weight")
            td = dims.get(name, {})
            kv_heads = int(td.get("num_kv_heads", 1))
            head_dim = int(td.get("head_dim", k[0] // kv_heads))
            if k[0] != kv_heads * head_dim or q[0] % head_dim:
                raise CheckpointError(
                    f"{name}: k_proj rows {k[0]} / q_proj rows {q[0]} do not fit "
                    f"kv_heads={kv_heads}, head_dim={head_dim}")
            cfg = GemmaConfig(
                width=q[1], depth=count_layers(prefix + "layers."),
                mlp=shape(prefix + "layers.0.mlp.gate_proj.weight")[0],
                heads=q[0] // head_dim, kv_heads=kv_heads, head_dim=head_dim,
            )
            _check_dims(name, cfg, td)
            return cfg

        vlm = tower(VLM, "vlm")
        expert = tower(EXPERT, "expert")
        _check_vision_dims(vision, vd)
        embed_key = VLM + "embed_tokens.weight"
        vocab = shape(embed_key if embed_key in shapes else "model.paligemma_with_expert.paligemma.lm_head.weight")[0]
        action_dim = shape("model.action_in_proj.weight")[1]

        def pick(dims_key, lr_key, default, whole=True):
            """A run-time field from dims.json, else config.json, else the default; a whole number where the
            field counts something (1.7 steps is a broken file, not 1)."""
            if dims_key in dims:
                value, where = dims[dims_key], f"dims.json {dims_key}"
            elif lr_key is not None and lr.get(lr_key) is not None:
                value, where = lr[lr_key], f"config.json {lr_key}"
            else:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and value != int(value)):
                raise CheckpointError(f"{where}: expected a {'whole ' if whole else ''}number, got {value!r}")
            return int(value) if whole else float(value)

        features = lr.get("input_features") or {}
        if not isinstance(features, Mapping) or not all(isinstance(f, Mapping) for f in features.values()):
            raise CheckpointError("config.json input_features: expected an object of feature objects")
        n_cams = sum(1 for f in features.values() if f.get("type") == "VISUAL")
        # the model kind: config.json's type, else dims.json's kind (the two must agree), else the keys
        named = {w: v for w, v in (("config.json type", lr.get("type")), ("dims.json kind", dims.get("kind")))
                 if v is not None}
        family = registry.kinds(FAMILY)
        for where, v in named.items():
            if v not in registry.MODELS:
                raise CheckpointError(f"{where}: {v!r} is not a model FlashRT runs ({', '.join(registry.MODELS)})")
            if v not in family:
                raise CheckpointError(f"{where}: {v!r} is not a PaliGemma-prefix checkpoint (this reader reads "
                                      f"{', '.join(family)}; flashrt_core.models.registry.load reads any)")
        if len(set(named.values())) > 1:
            raise CheckpointError(f"config.json type {lr.get('type')!r} and dims.json kind {dims.get('kind')!r} "
                                  "disagree")
        kind = next(iter(named.values()), None) or _kind_by_keys(shapes)
        try:
            return registry.config_class(kind)(
                vision=vision, vlm=vlm, expert=expert, vocab_size=vocab,
                chunk_size=pick("chunk_size", "chunk_size", 50),
                action_dim=action_dim,
                state_dim=pick("max_state_dim", "max_state_dim", 32),
                num_steps=pick("num_steps", "num_inference_steps", 10),
                tokenizer_max_length=pick("tokenizer_max_length", "tokenizer_max_length", 200),
                min_period=pick("min_period", "min_period", 4e-3, whole=False),
                max_period=pick("max_period", "max_period", 4.0, whole=False),
                num_image_slots=pick("num_image_slots", None, n_cams or 3), kind=kind,
            )
        except ValueError as e:  # inconsistent towers (e.g. depths differ) mean a broken checkpoint
            raise CheckpointError(f"inconsistent pi0.5 checkpoint: {e}") from None

    # ---- JSON (the dims.json format, extended) ------------------------------------------------------
    def to_dict(self) -> dict:
        def tower(t: GemmaConfig) -> dict:
            return {"width": t.width, "depth": t.depth, "mlp_dim": t.mlp, "num_heads": t.heads,
                    "num_kv_heads": t.kv_heads, "head_dim": t.head_dim}

        v = self.vision
        return {
            "kind": self.kind,
            "vlm": tower(self.vlm),
            "expert": tower(self.expert),
            "vision": {"hidden_size": v.hidden, "intermediate_size": v.mlp, "num_hidden_layers": v.layers,
                       "num_attention_heads": v.heads, "image_size": v.image_size, "patch_size": v.patch},
            "vocab_size": self.vocab_size, "chunk_size": self.chunk_size, "max_action_dim": self.action_dim,
            "max_state_dim": self.state_dim, "num_steps": self.num_steps,
            "tokenizer_max_length": self.tokenizer_max_length, "min_period": self.min_period,
            "max_period": self.max_period, "num_image_slots": self.num_image_slots,
            "rms_eps": self.rms_eps, "ln_eps": self.ln_eps, "rope_theta": self.rope_theta,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping) -> "PaliGemmaConfig":
        kind = d.get("kind", cls.kind if cls is not PaliGemmaConfig else registry.DEFAULT_KIND)
        if kind not in registry.kinds(FAMILY):
            raise ValueError(f"kind: expected one of {', '.join(registry.kinds(FAMILY))}, got {kind!r}")
        cls = registry.config_class(kind)
        try:
            def tower(t):
                return GemmaConfig(width=t["width"], depth=t["depth"], mlp=t["mlp_dim"], heads=t["num_heads"],
                                   kv_heads=t["num_kv_heads"], head_dim=t["head_dim"])

            v = d["vision"]
            vision = VisionConfig(hidden=v["hidden_size"], mlp=v["intermediate_size"], layers=v["num_hidden_layers"],
                                  heads=v["num_attention_heads"], image_size=v.get("image_size", 224),
                                  patch=v.get("patch_size", 14))
            defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
            return cls(
                vision=vision, vlm=tower(d["vlm"]), expert=tower(d["expert"]), vocab_size=d["vocab_size"],
                chunk_size=d.get("chunk_size", defaults["chunk_size"]),
                action_dim=d.get("max_action_dim", defaults["action_dim"]),
                state_dim=d.get("max_state_dim", defaults["state_dim"]),
                num_steps=d.get("num_steps", defaults["num_steps"]),
                tokenizer_max_length=d.get("tokenizer_max_length", defaults["tokenizer_max_length"]),
                min_period=d.get("min_period", defaults["min_period"]),
                max_period=d.get("max_period", defaults["max_period"]),
                num_image_slots=d.get("num_image_slots", defaults["num_image_slots"]),
                rms_eps=d.get("rms_eps", defaults["rms_eps"]), ln_eps=d.get("ln_eps", defaults["ln_eps"]),
                rope_theta=d.get("rope_theta", defaults["rope_theta"]), kind=kind,
            )
        except KeyError as e:
            raise ValueError(f"pi0.5 config JSON lacks field {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, text: str) -> "PaliGemmaConfig":
        return cls.from_dict(json.loads(text))


def _kind_by_keys(shapes) -> str:
    """A folder without config.json or dims.json: the family member whose action expert's marker key is there."""
    found = [k for k in registry.kinds(FAMILY) if registry.config_class(k).MARKER_KEY in shapes]
    if len(found) != 1:
        raise CheckpointError("cannot tell the model from the tensor names (config.json says it: its 'type')")
    return found[0]


def _check_dims(name: str, cfg: GemmaConfig, td: Mapping) -> None:
    """A dims.json that disagrees with the tensor shapes is a broken checkpoint, not a hint to ignore."""
    for field, attr in (("width", "width"), ("depth", "depth"), ("mlp_dim", "mlp"), ("num_heads", "heads")):
        if field in td and int(td[field]) != getattr(cfg, attr):
            raise CheckpointError(f"dims.json {name}.{field}={td[field]} but the tensors say {getattr(cfg, attr)}")


def _check_vision_dims(v: VisionConfig, vd: Mapping) -> None:
    for field, attr in (("hidden_size", "hidden"), ("intermediate_size", "mlp"), ("num_hidden_layers", "layers"),
                        ("image_size", "image_size"), ("patch_size", "patch")):
        if field in vd and int(vd[field]) != getattr(v, attr):
            raise CheckpointError(f"dims.json vision.{field}={vd[field]} but the tensors say {getattr(v, attr)}")
