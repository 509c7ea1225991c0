"""Read and write pi0.5 checkpoints in LeRobot's `model.safetensors` layout (keys prefixed `model.`).

A checkpoint folder holds `model.safetensors`, LeRobot's `config.json` (optional here) and optionally a
`dims.json` (`PaliGemmaConfig.to_json()` format; the head counts that tensor shapes cannot tell).
"""
from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashrt_core.errors import CheckpointError
from flashrt_core.models import registry
from flashrt_core.models.paligemma.config import EXPERT, PG, VISION, VLM, PaliGemmaConfig

WEIGHTS_FILE = "model.safetensors"
DIMS_FILE = "dims.json"
LEROBOT_CONFIG_FILE = "config.json"
EMBED_KEY = VLM + "embed_tokens.weight"
# Output heads of both towers: present in LeRobot checkpoints, never used to produce actions.
IGNORED_KEYS = ("model.paligemma_with_expert.paligemma.lm_head.weight",
                "model.paligemma_with_expert.gemma_expert.lm_head.weight")
_LIST = 10  # how many offending keys an error message spells out


def expected_keys(config: PaliGemmaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape (lm_head keys excluded: they are optional)."""
    v, g, e = config.vision, config.vlm, config.expert
    keys: dict[str, tuple[int, ...]] = {
        VISION + "embeddings.patch_embedding.weight": (v.hidden, 3, v.patch, v.patch),
        VISION + "embeddings.patch_embedding.bias": (v.hidden,),
        VISION + "embeddings.position_embedding.weight": (v.num_patches, v.hidden),
    }
    for i in range(v.layers):
        p = f"{VISION}encoder.layers.{i}."
        for n in ("layer_norm1", "layer_norm2"):
            keys[p + n + ".weight"] = (v.hidden,)
            keys[p + n + ".bias"] = (v.hidden,)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            keys[p + f"self_attn.{n}.weight"] = (v.hidden, v.hidden)
            keys[p + f"self_attn.{n}.bias"] = (v.hidden,)
        keys[p + "mlp.fc1.weight"] = (v.mlp, v.hidden)
        keys[p + "mlp.fc1.bias"] = (v.mlp,)
        keys[p + "mlp.fc2.weight"] = (v.hidden, v.mlp)
        keys[p + "mlp.fc2.bias"] = (v.hidden,)
    keys[VISION + "post_layernorm.weight"] = (v.hidden,)
    keys[VISION + "post_layernorm.bias"] = (v.hidden,)
    keys[PG + "multi_modal_projector.linear.weight"] = (g.width, v.hidden)
    keys[PG + "multi_modal_projector.linear.bias"] = (g.width,)
    keys[EMBED_KEY] = (config.vocab_size, g.width)

    def gemma_layer(prefix: str, t) -> None:  # (its norms: the prefix's below, the expert's by the model)
        keys[prefix + "self_attn.q_proj.weight"] = (t.heads * t.head_dim, t.width)
        keys[prefix + "self_attn.k_proj.weight"] = (t.kv_heads * t.head_dim, t.width)
        keys[prefix + "self_attn.v_proj.weight"] = (t.kv_heads * t.head_dim, t.width)
        keys[prefix + "self_attn.o_proj.weight"] = (t.width, t.heads * t.head_dim)
        keys[prefix + "mlp.gate_proj.weight"] = (t.mlp, t.width)
        keys[prefix + "mlp.up_proj.weight"] = (t.mlp, t.width)
        keys[prefix + "mlp.down_proj.weight"] = (t.width, t.mlp)

    for i in range(g.depth):
        gemma_layer(f"{VLM}layers.{i}.", g)
        for n in ("input_layernorm", "post_attention_layernorm"):
            keys[f"{VLM}layers.{i}.{n}.weight"] = (g.width,)
    keys[VLM + "norm.weight"] = (g.width,)
    for i in range(e.depth):
        gemma_layer(f"{EXPERT}layers.{i}.", e)
    keys["model.action_in_proj.weight"] = (e.width, config.action_dim)
    keys["model.action_in_proj.bias"] = (e.width,)
    keys["model.action_out_proj.weight"] = (config.action_dim, e.width)
    keys["model.action_out_proj.bias"] = (config.action_dim,)
    keys.update(registry.config_class(config.kind).expert_keys(config))  # the model's own expert keys
    return keys


def _listing(title: str, items: list[str]) -> str:
    shown = ", ".join(items[:_LIST])
    more = f", ... ({len(items) - _LIST} more)" if len(items) > _LIST else ""
    return f"{len(items)} {title}: {shown}{more}"


def _key_layout_hint(shapes: dict) -> str:
    """What the keys of a file whose sizes could not be inferred look like, against LeRobot's layout (keys
    under `model.paligemma_with_expert.`): a prefix too many or too few is the usual cause."""
    keys = sorted(shapes)
    root = ".".join(PG.split(".")[:2]) + "."  # "model.paligemma_with_expert."
    inside = [k for k in keys if root in k]
    text = f"{len(keys)} keys, {len(inside)} of them with '{root}'"
    if inside and not any(k.startswith(root) for k in inside):
        extra = inside[0][: inside[0].index(root)]
        text += f" behind an extra prefix '{extra}' (e.g. {inside[0]}): strip it"
    elif not inside and any(k.startswith(root[len("model."):]) for k in keys):
        text += " (they lack the leading 'model.' of a LeRobot PI05Policy state dict)"
    elif not inside:
        text += "; not a LeRobot pi0.5 checkpoint? " + _listing("keys", keys)
    return text


def validate_shapes(config: PaliGemmaConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped keys (in that order)."""
    want = expected_keys(config)
    have = dict(shapes)
    if EMBED_KEY not in have and IGNORED_KEYS[0] in have:
        have[EMBED_KEY] = have[IGNORED_KEYS[0]]  # LeRobot fills the embedding from a tied lm_head
    missing = sorted(k for k in want if k not in have)
    unexpected = sorted(k for k in have if k not in want and k not in IGNORED_KEYS)
    misshaped = sorted(f"{k} {list(have[k])} (expected {list(want[k])})"
                       for k in want if k in have and tuple(have[k]) != want[k])
    problems = [_listing(t, x) for t, x in (("missing keys", missing), ("unexpected keys", unexpected),
                                            ("mis-shaped keys", misshaped)) if x]
    if problems:
        raise CheckpointError(f"{source} does not match the pi0.5 model: " + "; ".join(problems))


def _read_json(path: pathlib.Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None


def weights_file(path: str | os.PathLike) -> pathlib.Path:
    """`model.safetensors` of a checkpoint folder (or the file itself); CheckpointError when absent."""
    path = pathlib.Path(path)
    file = path / WEIGHTS_FILE if path.is_dir() else path
    if not file.is_file():
        inner = path / "pretrained_model" / WEIGHTS_FILE if path.is_dir() else None
        hint = f" (a training run's checkpoint folder: give {inner.parent})" if inner and inner.is_file() else ""
        raise CheckpointError(f"{file}: checkpoint file not found{hint}")
    return file


def _infer_config(file: pathlib.Path, shapes: dict) -> PaliGemmaConfig:
    """The config from the shapes and the JSON files beside `file`; a malformed JSON file is named as such
    (never blamed on the weights)."""
    dims, lerobot = _read_json(file.parent / DIMS_FILE), _read_json(file.parent / LEROBOT_CONFIG_FILE)
    for name, doc in ((DIMS_FILE, dims), (LEROBOT_CONFIG_FILE, lerobot)):
        if doc is not None and not isinstance(doc, dict):
            raise CheckpointError(f"{file.parent / name}: expected a JSON object, got {type(doc).__name__}")
    try:
        return PaliGemmaConfig.from_state_dict_shapes(shapes, dims=dims, lerobot_config=lerobot)
    except CheckpointError as e:
        if not str(e).startswith("cannot infer"):
            raise
        raise CheckpointError(f"{file}: {e}; {_key_layout_hint(shapes)}") from None
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise CheckpointError(f"{file.parent}: {DIMS_FILE} / {LEROBOT_CONFIG_FILE} describe no valid pi0.5 model "
                              f"({type(e).__name__}: {e})") from None


def _read_shapes(file: pathlib.Path) -> dict:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        raise CheckpointError(f"{file}: unreadable safetensors file ({type(e).__name__}: {e})") from None


def checkpoint_config(path: str | os.PathLike, validate: bool = False) -> PaliGemmaConfig:
    """The model sizes of a checkpoint, from its tensor shapes and JSON files, without reading weights;
    validate: also every tensor name and shape against those sizes (`validate_shapes`, as `load_checkpoint`
    checks them), so that a dry run refuses what loading would."""
    file = weights_file(path)
    shapes = _read_shapes(file)
    config = _infer_config(file, shapes)
    if validate:
        validate_shapes(config, shapes, str(file))
    return config


def load_checkpoint(path: str | os.PathLike, config: PaliGemmaConfig | None = None):
    """Load `(config, state_dict)` from a checkpoint folder or a `model.safetensors` file.

    Without `config`, the sizes are inferred from the tensor shapes plus `dims.json` / `config.json`
    beside the weights (see `PaliGemmaConfig.from_state_dict_shapes`). lm_head tensors are dropped.
    """
    file = weights_file(path)
    shapes = _read_shapes(file)
    if config is None:
        config = _infer_config(file, shapes)
    validate_shapes(config, shapes, str(file))
    try:
        with safe_open(str(file), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in shapes if k not in IGNORED_KEYS}
            if EMBED_KEY not in state:
                state[EMBED_KEY] = f.get_tensor(IGNORED_KEYS[0])
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        raise CheckpointError(f"{file}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    bad = sorted(k for k, t in state.items() if not t.is_floating_point())
    if bad:
        raise CheckpointError(f"{file}: " + _listing("non-floating tensors", bad))
    broken = sorted(k for k, t in state.items() if not torch.isfinite(t).all())
    if broken:
        raise CheckpointError(f"{file}: NaN or infinite values in " + _listing("tensors", broken))
    return config, state


def save_checkpoint(path: str | os.PathLike, config: PaliGemmaConfig,
                    state_dict: dict[str, torch.Tensor]) -> pathlib.Path:
    """Write `model.safetensors`, `dims.json` and a LeRobot-style `config.json` into folder `path`."""
    validate_shapes(config, {k: tuple(t.shape) for k, t in state_dict.items()}, "state_dict")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.detach().contiguous().cpu() for k, t in state_dict.items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / DIMS_FILE).write_text(config.to_json())
    cams = {f"observation.images.cam{i}": {"type": "VISUAL", "shape": [3, config.vision.image_size,
                                                                      config.vision.image_size]}
            for i in range(config.num_image_slots)}
    lerobot = {
        "type": config.kind, "input_features": cams, "chunk_size": config.chunk_size,
        "max_state_dim": config.state_dim, "max_action_dim": config.action_dim,
        "num_inference_steps": config.num_steps, "tokenizer_max_length": config.tokenizer_max_length,
        "min_period": config.min_period, "max_period": config.max_period,
        "image_resolution": [config.vision.image_size, config.vision.image_size], "dtype": "float32",
    }
    (path / LEROBOT_CONFIG_FILE).write_text(json.dumps(lerobot, indent=4))
    return path
