"""Camera frame -> SigLIP input on the device: uint8 HWC -> float CHW in [-1, 1], resize-with-pad to 224.

Matches LeRobot 0.6.1 (`resize_with_pad_torch` then `img * 2 - 1`): the frame in [0, 1] is resized bilinearly
(align_corners=False, no antialias, sample index clamped at 0 and the far neighbour at the edge, exactly
as torch's upsample_bilinear2d) to keep its aspect ratio, clamped to [0, 1], and centered in the square with
zero padding (the odd pixel on the bottom / right), so the padding is -1 after scaling.
The frame may be any strided view: [B, H, W, C] or [H, W, C], uint8 (divided by 255) or float in [0, 1];
a CHW float frame passes as `.permute(1, 2, 0)`. One program writes BLOCK output pixels of all channels.
Reference: `reference.preprocess_images_ref`.
"""
import torch
import triton
import triton.language as tl

from flashrt_core.kernels._common import FLOAT_DTYPES, KernelInputError, check, check_out
from flashrt_core.kernels.reference import resized_hw

_BLOCK = 256


@triton.jit
def _resize_pad_kernel(IMG, OUT, s_b, s_h, s_w, s_c, o_b, o_c, H, W, RH, RW, PAD_T, PAD_L, SIZE,
                       scale_h, scale_w, in_scale, C: tl.constexpr, RESIZE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_frame = idx < SIZE * SIZE
    oy = idx // SIZE
    ox = idx % SIZE
    ry = oy - PAD_T
    rx = ox - PAD_L
    inside = in_frame & (ry >= 0) & (ry < RH) & (rx >= 0) & (rx < RW)
    if RESIZE:
        sy = tl.maximum(scale_h * (ry.to(tl.float32) + 0.5) - 0.5, 0.0)
        sx = tl.maximum(scale_w * (rx.to(tl.float32) + 0.5) - 0.5, 0.0)
        y0 = sy.to(tl.int32)  # sy >= 0, so truncation is floor
        x0 = sx.to(tl.int32)
        ly = sy - y0.to(tl.float32)
        lx = sx - x0.to(tl.float32)
        y1 = tl.where(y0 < H - 1, y0 + 1, y0)
        x1 = tl.where(x0 < W - 1, x0 + 1, x0)
    else:  # the frame already has the target size: a plain copy, no interpolation
        y0 = ry
        x0 = rx
    src = IMG + b * s_b
    dst = OUT + b * o_b + idx
    for c in tl.static_range(C):
        if RESIZE:
            p00 = tl.load(src + y0 * s_h + x0 * s_w + c * s_c, mask=inside, other=0).to(tl.float32)
            p01 = tl.load(src + y0 * s_h + x1 * s_w + c * s_c, mask=inside, other=0).to(tl.float32)
            p10 = tl.load(src + y1 * s_h + x0 * s_w + c * s_c, mask=inside, other=0).to(tl.float32)
            p11 = tl.load(src + y1 * s_h + x1 * s_w + c * s_c, mask=inside, other=0).to(tl.float32)
            val = ((1.0 - ly) * ((1.0 - lx) * (p00 * in_scale) + lx * (p01 * in_scale))
                   + ly * ((1.0 - lx) * (p10 * in_scale) + lx * (p11 * in_scale)))
            val = tl.minimum(tl.maximum(val, 0.0), 1.0)
        else:
            val = tl.load(src + y0 * s_h + x0 * s_w + c * s_c, mask=inside, other=0).to(tl.float32) * in_scale
        val = tl.where(inside, val, 0.0) * 2.0 - 1.0
        tl.store(dst + c * o_c, val.to(OUT.dtype.element_ty), mask=in_frame)


def preprocess_images(images, size=224, *, dtype=torch.float32, out=None):
    """[B, H, W, C] or [H, W, C] frames (uint8, or float in [0, 1]) -> [B, C, size, size] in [-1, 1].
    `out` may be a slice of a static image buffer, e.g. images_buf[slot:slot + 1]."""
    op = "preprocess_images"
    check(op, "images", images, ndim=(3, 4), dtypes=(torch.uint8,) + FLOAT_DTYPES, last_contiguous=False)
    frames = images if images.dim() == 4 else images[None]
    b, h, w, c = frames.shape
    if c > 4:
        raise KernelInputError(f"{op}: `images` has {c} channels in its last dim; expected HWC with C <= 4 "
                               f"(pass a CHW frame as .permute(1, 2, 0))")
    if min(h, w) < 1:
        raise KernelInputError(f"{op}: `images` has an empty frame of shape {tuple(images.shape)}")
    shape = (b, c, size, size)
    out = check_out(op, "out", out, shape, images.device) if out is not None else \
        torch.empty(shape, dtype=dtype, device=images.device)
    rh, rw = resized_hw(h, w, size, size)
    resize = (h, w) != (size, size)
    _resize_pad_kernel[(triton.cdiv(size * size, _BLOCK), b)](
        frames, out, *frames.stride(), out.stride(0), out.stride(1), h, w, rh, rw,
        (size - rh) // 2, (size - rw) // 2, size,
        # torch's bilinear uses input / output as the step when given an output size.
        float(h) / rh, float(w) / rw, 1.0 / 255.0 if frames.dtype == torch.uint8 else 1.0,
        C=c, RESIZE=resize, BLOCK=_BLOCK, num_warps=4)
    return out
