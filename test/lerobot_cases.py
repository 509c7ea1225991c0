"""The LeRobot 0.6.1 golden cases of ../shared/reference/fixtures, as the model's batched inputs."""
import torch
from safetensors.torch import load_file

PI05_CASES = ["two_views_padded_prompt", "three_views_full_prompt", "one_view_240x320_two_missing"]


def load_cases(fixtures_dir, folder: str = "lerobot_pi05_tiny", names=PI05_CASES, slots: int = 3) -> dict:
    """{case: {field: tensor}} with `images` [1, slots, 3, 224, 224] and `image_masks` [1, slots] stacked."""
    raw = load_file(str(fixtures_dir / folder / "cases.safetensors"))
    out = {}
    for name in names:
        c = {k[len(name) + 1:]: v for k, v in raw.items() if k.startswith(name + ".")}
        c["images"] = torch.stack([c[f"image.{i}"] for i in range(slots)], dim=1)
        c["image_masks"] = torch.stack([c[f"image_mask.{i}"] for i in range(slots)], dim=1)
        out[name] = c
    return out


def model_inputs(case: dict):
    """(images, image_masks, lang_tokens, lang_mask) in `sample_actions` order."""
    return case["images"], case["image_masks"], case["lang_tokens"], case["lang_mask"]
