"""On-device image preprocessing (resize-with-pad, [-1, 1]) vs the torch reference, and the reference vs
LeRobot 0.6.1's semantics (centered padding, odd pixel bottom/right, pad value -1, bilinear
align_corners=False on the [0, 1] image).

The interpreter is slow per pixel, so most cases use a small target size (the kernel takes `size`).
"""
from kernel_testing import dev, assert_close  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_core import kernels as K  # noqa: E402
from flashrt_core.kernels import reference as R  # noqa: E402
from flashrt_core.kernels._common import KernelInputError, interpreting  # noqa: E402

# (atol, rtol) per output dtype. fp32: the bilinear source coordinate (scale * (dst + 0.5) - 0.5) is an
# fp32 number near H, whose ulp near 256 is 1.5e-5; rounding-order differences between two correct
# implementations move the result by up to that times a pixel step, so 1e-4 (1/40 of a uint8 level).
TOL = {torch.float32: (1e-4, 0.0), torch.bfloat16: (1e-2, 1e-2)}


def close(out, ref):
    assert_close(out, ref, TOL)


def frames(b, h, w, dev, seed=0, c=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, h, w, c), generator=g, dtype=torch.uint8).to(dev)


@pytest.mark.interpret
@pytest.mark.parametrize("hw", [(37, 53), (13, 40), (50, 21), (9, 9), (32, 32), (64, 31)], ids=str)
def test_uint8_frames(dev, hw):
    img = frames(2, *hw, dev, seed=hw[0])
    out = K.preprocess_images(img, 32, backend="triton")
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.float32
    close(out, R.preprocess_images_ref(img, 32))


@pytest.mark.interpret
def test_float_chw_view_bf16_output_and_out_slot(dev):
    g = torch.Generator().manual_seed(3)
    chw = torch.rand(3, 27, 45, generator=g).to(dev)  # a float CHW frame in [0, 1]
    hwc = chw.permute(1, 2, 0)
    close(K.preprocess_images(hwc, 32, backend="triton"), R.preprocess_images_ref(hwc, 32))
    close(K.preprocess_images(hwc, 32, dtype=torch.bfloat16, backend="triton"),
          R.preprocess_images_ref(hwc, 32, dtype=torch.bfloat16))
    buf = torch.full((3, 3, 32, 32), 7.0, device=dev)  # three camera slots; fill slot 1 only
    K.preprocess_images(hwc, 32, out=buf[1:2], backend="triton")
    close(buf[1:2], R.preprocess_images_ref(hwc, 32))
    assert (buf[0] == 7).all() and (buf[2] == 7).all()


@pytest.mark.interpret
def test_full_size_224_frame_is_only_rescaled(dev):
    img = frames(1, 224, 224, dev, seed=4)
    out = K.preprocess_images(img, backend="triton")
    close(out, R.preprocess_images_ref(img))
    close(out, img.permute(0, 3, 1, 2).float() / 255 * 2 - 1)  # no resize, no padding


def test_reference_follows_lerobot_resize_with_pad():
    """Written out from lerobot/policies/common/vla_utils.py::resize_with_pad_torch (0.6.1) and
    PI05Pytorch._preprocess_images: ratio = max(w / W, h / H), int() sizes, bilinear, clamp, centered pad
    with the remainder on the bottom / right, value 0, then x * 2 - 1."""
    img = frames(1, 15, 32, "cpu", seed=6)
    out = R.preprocess_images_ref(img, 32)
    # 15 x 32 -> ratio 1 -> no resize needed in width, height 15 -> 8 rows on top, 9 at the bottom.
    assert R.resized_hw(15, 32, 32, 32) == (15, 32)
    assert (out[:, :, :8] == -1).all() and (out[:, :, 23:] == -1).all()
    torch.testing.assert_close(out[0, :, 8:23], img[0].permute(2, 0, 1).float() / 255 * 2 - 1)
    tall = frames(1, 40, 21, "cpu", seed=7)
    rh, rw = R.resized_hw(40, 21, 32, 32)
    assert (rh, rw) == (32, 16)  # int(21 / 1.25) = 16
    resized = F.interpolate(tall.permute(0, 3, 1, 2).float() / 255, size=(32, 16), mode="bilinear",
                            align_corners=False).clamp(0, 1)
    out = R.preprocess_images_ref(tall, 32)
    torch.testing.assert_close(out[..., 8:24], resized * 2 - 1)
    assert (out[..., :8] == -1).all() and (out[..., 24:] == -1).all()


@pytest.mark.interpret
def test_constant_frame_stays_constant_inside(dev):
    img = torch.full((1, 23, 41, 3), 200, dtype=torch.uint8, device=dev)
    out = K.preprocess_images(img, 32, backend="triton")
    rh, rw = R.resized_hw(23, 41, 32, 32)
    top = (32 - rh) // 2
    inside = out[..., top:top + rh, :]
    torch.testing.assert_close(inside, torch.full_like(inside, 200 / 255 * 2 - 1), atol=1e-6, rtol=0)
    assert (out[..., :top, :] == -1).all() and (out[..., top + rh:, :] == -1).all()


@pytest.mark.interpret
def test_launcher_errors_name_the_argument(dev):
    with pytest.raises(KernelInputError, match="`images` has 5 channels"):
        K.preprocess_images(frames(1, 9, 9, dev, c=5), 32, backend="triton")
    with pytest.raises(KernelInputError, match="`images` has dtype"):
        K.preprocess_images(frames(1, 9, 9, dev).int(), 32, backend="triton")
    with pytest.raises(KernelInputError, match="`images` must have"):
        K.preprocess_images(frames(1, 9, 9, dev)[0, 0], 32, backend="triton")
    with pytest.raises(KernelInputError, match="empty frame"):
        K.preprocess_images(frames(1, 0, 9, dev), 32, backend="triton")
    with pytest.raises(KernelInputError, match="`out` has shape"):
        K.preprocess_images(frames(2, 9, 9, dev), 32, out=torch.empty(1, 3, 32, 32, device=dev),
                            backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(interpreting(), reason="full shapes are too slow for the Triton interpreter")
@pytest.mark.parametrize("hw", [(480, 640), (720, 1280), (224, 224), (96, 128)], ids=str)
def test_camera_sizes_on_cuda(hw):
    img = frames(2, *hw, "cuda", seed=hw[1])
    close(K.preprocess_images(img, backend="triton"), R.preprocess_images_ref(img))
    close(K.preprocess_images(img, dtype=torch.bfloat16, backend="triton"),
          R.preprocess_images_ref(img, dtype=torch.bfloat16))
