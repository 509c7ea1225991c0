"""The LeRobot 0.6.1 golden cases of test/fixtures/ (see test/fixtures/README.md), as the model's batched inputs.

The `cases.safetensors` files are stored packed, losslessly: a float32 tensor with at most 256 distinct values
(the camera frames, every value k/255, and the pre-processed 224x224 images) is kept as `<key>.u8` (uint8
indices) plus `<key>.palette` (its distinct float32 values, exactly as LeRobot wrote them); every other tensor
as it is. The file's metadata holds a SHA-256 of each original tensor (dtype, shape, bytes), and
`load_case_tensors` checks every decoded tensor against it, so what the tests see is LeRobot's output bit for
bit. Read the files through `load_case_tensors`, never with a bare `safetensors` `load_file`.
"""
import hashlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PI05_CASES = ["two_views_padded_prompt", "three_views_full_prompt", "one_view_240x320_two_missing"]
PACKED_FORMAT = "flashrt-packed-cases/1"
_INDEX, _PALETTE = ".u8", ".palette"


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 over a tensor's dtype, shape and raw bytes (so -0.0 and 0.0, or two NaN payloads, differ)."""
    t = t.contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
    return h.hexdigest()


def pack_cases(tensors: dict) -> tuple[dict, dict]:
    """(stored tensors, metadata) of the packed form of `tensors` (see the module docstring)."""
    out, meta = {}, {"format": PACKED_FORMAT}
    for key, t in tensors.items():
        meta[f"sha256:{key}"] = tensor_digest(t)
        if t.dtype == torch.float32:
            bits = t.contiguous().view(torch.int32)
            values, index = torch.unique(bits, sorted=True, return_inverse=True)
            if len(values) <= 256:
                out[key + _INDEX] = index.to(torch.uint8).contiguous()
                out[key + _PALETTE] = values.view(torch.float32).contiguous()
                continue
        out[key] = t.contiguous()
    return out, meta


def save_packed_cases(tensors: dict, path) -> None:
    stored, meta = pack_cases(tensors)
    save_file(stored, str(path), metadata=meta)
    if set(load_case_tensors(path)) != set(tensors):  # the decode checks every digest itself
        raise AssertionError(f"{path}: the packed file does not decode to the same keys")


def load_case_tensors(path) -> dict:
    """{key: tensor} of a packed `cases.safetensors`, each tensor bit-identical to LeRobot's (digest-checked)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        stored = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != PACKED_FORMAT:
        raise ValueError(f"{path}: not a packed cases file (format {meta.get('format')!r}, want {PACKED_FORMAT!r})")
    out = {}
    for key, t in stored.items():
        if key.endswith(_PALETTE):
            continue
        if key.endswith(_INDEX):
            key = key[: -len(_INDEX)]
            palette = stored[key + _PALETTE]
            t = palette.view(torch.int32)[t.long()].view(torch.float32)
        out[key] = t
    digests = {k[len("sha256:"):]: v for k, v in meta.items() if k.startswith("sha256:")}
    if set(digests) != set(out):
        raise ValueError(f"{path}: keys {sorted(set(digests) ^ set(out))} lack a digest or a tensor")
    bad = [k for k, t in out.items() if tensor_digest(t) != digests[k]]
    if bad:
        raise ValueError(f"{path}: decoded tensors differ from the recorded LeRobot output: {bad}")
    return out


def case_fields(raw: dict, names=PI05_CASES) -> dict:
    """{case: {field: tensor}} from the flat `<case>.<field>` keys."""
    return {n: {k[len(n) + 1:]: v for k, v in raw.items() if k.startswith(n + ".")} for n in names}


def load_cases(fixtures_dir, folder: str = "lerobot_pi05_tiny", names=PI05_CASES, slots: int = 3) -> dict:
    """{case: {field: tensor}} with `images` [1, slots, 3, 224, 224] and `image_masks` [1, slots] stacked."""
    out = case_fields(load_case_tensors(fixtures_dir / folder / "cases.safetensors"), names)
    for c in out.values():
        c["images"] = torch.stack([c[f"image.{i}"] for i in range(slots)], dim=1)
        c["image_masks"] = torch.stack([c[f"image_mask.{i}"] for i in range(slots)], dim=1)
    return out


def model_inputs(case: dict):
    """(images, image_masks, lang_tokens, lang_mask) in `sample_actions` order."""
    return case["images"], case["image_masks"], case["lang_tokens"], case["lang_mask"]


def rel_l2(a, b) -> float:
    """Relative L2 error of a against the reference b (fp32)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cosine(a, b) -> float:
    """Cosine similarity of a and b, flattened (fp32)."""
    return torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()
