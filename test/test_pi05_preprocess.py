"""Image pre-processing against LeRobot 0.6.1's outputs (fixtures) and hand-computed resize/pad geometry."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashrt_core.errors import InputError
from flashrt_core.models.pi05 import preprocess_images, resize_with_pad
from lerobot_cases import case_fields, load_case_tensors

# Tolerances (absolute).
TOL = {
    "vs_lerobot": 1e-6,  # fixture `image.<i>` from `raw_image.<i>` (float CHW and uint8 HWC inputs)
    "interior": 1e-6,  # resized content of a constant image
}
CASES = ["two_views_padded_prompt", "three_views_full_prompt", "one_view_240x320_two_missing"]


@pytest.fixture(scope="module")
def cases(fixtures_dir):
    return case_fields(load_case_tensors(fixtures_dir / "lerobot_pi05_tiny" / "cases.safetensors"), CASES)


def _expected(c):
    return (torch.stack([c[f"image.{i}"] for i in range(3)], dim=1),
            torch.stack([c[f"image_mask.{i}"] for i in range(3)], dim=1))


@pytest.mark.parametrize("name", CASES)
def test_matches_lerobot_float_and_uint8(cases, name):
    c = cases[name]
    raws = [c[f"raw_image.{i}"] for i in range(3) if f"raw_image.{i}" in c]
    want_images, want_masks = _expected(c)
    images, masks = preprocess_images(raws, num_slots=3)
    assert images.shape == (1, 3, 3, 224, 224) and torch.equal(masks, want_masks)
    assert (images - want_images).abs().max() < TOL["vs_lerobot"]
    # The same frames as uint8 HWC numpy arrays (camera drivers' format); every raw value is k/255.
    frames = [(r[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy() for r in raws]
    images_u8, masks_u8 = preprocess_images(frames, num_slots=3)
    assert torch.equal(masks_u8, want_masks)
    assert (images_u8 - want_images).abs().max() < TOL["vs_lerobot"]


def test_fixture_240x320_is_letterboxed(cases):
    img = cases["one_view_240x320_two_missing"]["image.0"][0]
    # 240x320 -> ratio 320/224 -> 168x224, padded by 28 rows at the top and the bottom with -1.
    assert (img[:, :28] == -1).all() and (img[:, 196:] == -1).all()
    assert (img[:, 28:196] > -1).any(dim=1).all()


def test_resize_with_pad_geometry_by_hand():
    # 5x8 constant image -> 4x4: ratio max(8/4, 5/4) = 2 -> 2x4; 2 pad rows, 1 on top and 1 at the bottom.
    img = torch.full((1, 3, 5, 8), 0.625)
    out = resize_with_pad(img, 4, 4)
    assert out.shape == (1, 3, 4, 4)
    assert (out[:, :, 0] == 0).all() and (out[:, :, 3] == 0).all()
    assert (out[:, :, 1:3] - 0.625).abs().max() < TOL["interior"]
    # 9x3 tall image -> 6x6: ratio 1.5 -> 6x2; 4 pad columns, 2 left and 2 right.
    tall = resize_with_pad(torch.full((2, 3, 9, 3), 0.25), 6, 6)
    assert (tall[..., :2] == 0).all() and (tall[..., 4:] == 0).all()
    assert (tall[..., 2:4] - 0.25).abs().max() < TOL["interior"]
    # Odd remainder: 7x8 -> 4x4: ratio 2 -> 3x4, one pad row, which goes to the bottom.
    odd = resize_with_pad(torch.full((1, 3, 7, 8), 0.5), 4, 4)
    assert (odd[:, :, 3] == 0).all() and (odd[:, :, :3] - 0.5).abs().max() < TOL["interior"]
    # Half-pixel-centred bilinear: halving a horizontal ramp v_j = j/10 averages pixel pairs:
    # out_k = (v_2k + v_2k+1) / 2 = (4k + 1) / 20. 4x8 -> 4x4: content 2x4 in rows 1..2.
    ramp = (torch.arange(8.0) / 10).expand(1, 3, 4, 8).contiguous()
    r = resize_with_pad(ramp, 4, 4)
    want = torch.tensor([(4 * k + 1) / 20 for k in range(4)])
    assert (r[0, :, 1:3] - want).abs().max() < TOL["interior"]
    # Bilinear overshoot is clamped to [0, 1] before padding (LeRobot clamps float images).
    assert resize_with_pad(torch.full((1, 3, 10, 10), 1.5), 5, 5).max() == 1.0


def test_missing_cameras_fill_later_slots_with_minus_one():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(2, 3, 224, 224, generator=g)
    b = torch.randint(0, 256, (2, 100, 150, 3), dtype=torch.uint8, generator=g)
    images, masks = preprocess_images([None, a, b], num_slots=3)
    assert masks.tolist() == [[True, True, False]] * 2
    assert torch.equal(images[:, 0], a * 2 - 1)  # present cameras first, in order (LeRobot's order)
    assert (images[:, 2] == -1).all()
    b_float = b.permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(images[:, 1], resize_with_pad(b_float, 224, 224) * 2 - 1, atol=0, rtol=0)


def test_bad_inputs_raise_input_error():
    with pytest.raises(InputError, match="every camera is missing"):
        preprocess_images([None, None], num_slots=3)
    with pytest.raises(InputError, match="4 cameras"):
        preprocess_images([torch.rand(3, 224, 224)] * 4, num_slots=3)
    with pytest.raises(InputError, match=r"frames\[1\].*uint8 frames must be HWC"):
        preprocess_images([torch.rand(3, 224, 224), np.zeros((3, 224, 224), np.uint8)], num_slots=3)
    with pytest.raises(InputError, match=r"frames\[0\].*int32"):
        preprocess_images([torch.zeros(3, 224, 224, dtype=torch.int32)])
    with pytest.raises(InputError, match="batch sizes differ"):
        preprocess_images([torch.rand(2, 3, 224, 224), torch.rand(1, 3, 224, 224)])
    with pytest.raises(InputError, match="3-channel"):
        preprocess_images([torch.rand(224, 224, 5)])
    with pytest.raises(InputError, match=r"frames\[0\]: empty frame"):
        preprocess_images([np.zeros((0, 320, 3), np.uint8)])
    with pytest.raises(InputError, match=r"frames\[1\]: float frames must lie in \[0, 1\], got 0\.5..255"):
        preprocess_images([torch.rand(3, 224, 224), torch.full((3, 224, 224), 0.5).index_fill(1, torch.tensor([7]),
                                                                                              255.0)])
    nan = torch.rand(3, 240, 320)
    nan[1, 2, 3] = float("nan")
    with pytest.raises(InputError, match=r"frames\[0\]: NaN or infinite"):
        preprocess_images([nan])
