"""Conversions between ROS messages and the arrays flashrt_core takes, with clear errors on bad input.

cv_bridge is used when the ROS install has it; otherwise images are decoded with numpy (honouring `step`
row padding and `is_bigendian`) and CompressedImage (PNG, JPEG) with OpenCV, after its size was read from the
header bytes and checked.
"""
from __future__ import annotations

import numpy as np

SUPPORTED_ENCODINGS = ("rgb8", "bgr8", "rgba8", "bgra8", "mono8", "16UC1", "mono16")
CHANNELS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4}  # (the others: one)
GREY_ENCODINGS = ("mono8", "16UC1", "mono16")  # taken as grey RGB (the node warns once per camera)


class ConversionError(ValueError):
    """A message cannot be turned into model input; the message says why."""


class ImageSizeError(ConversionError):
    """An image of another size than the model's frames (read from its header, before any decoding)."""


def stamp_to_ns(stamp) -> int:
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def ns_to_stamp(ns: int, stamp_type):
    msg = stamp_type()
    msg.sec, msg.nanosec = divmod(int(ns), 1_000_000_000)
    return msg


def _to_rgb8(array: np.ndarray, encoding: str) -> np.ndarray:
    """Any supported decoded image -> HxWx3 uint8 RGB."""
    if encoding == "rgb8":
        return array
    if encoding == "bgr8":
        return array[..., ::-1]
    if encoding == "rgba8":  # (alpha dropped: e.g. a ZED camera's frames)
        return array[..., :3]
    if encoding == "bgra8":
        return array[..., 2::-1]
    if encoding == "mono8":
        return np.repeat(array[..., None], 3, axis=2)
    # 16-bit single channel (depth in mm, or mono16): keep the high byte so the range maps onto 0..255.
    return np.repeat((array >> 8).astype(np.uint8)[..., None], 3, axis=2)


_BRIDGE = None


def _cv_bridge():
    """cv_bridge's CvBridge when the ROS install has it (not on PyPI), else None; looked up once."""
    global _BRIDGE
    if _BRIDGE is None:
        try:
            from cv_bridge import CvBridge

            _BRIDGE = CvBridge()
        except ImportError:
            _BRIDGE = False
    return _BRIDGE or None


def image_to_rgb(msg, expected_size: tuple[int, int] | None = None) -> np.ndarray:
    """sensor_msgs/Image -> contiguous HxWx3 uint8 RGB array (validated first: against `expected_size`
    (width, height) when given, else against MAX_PIXELS; then decoded by cv_bridge when available, by numpy
    otherwise)."""
    encoding = msg.encoding
    if encoding not in SUPPORTED_ENCODINGS:
        raise ConversionError(f"unsupported image encoding '{encoding}' (supported: {', '.join(SUPPORTED_ENCODINGS)})")
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height <= 0 or width <= 0:
        raise ConversionError(f"image has no pixels ({width}x{height})")
    if expected_size is not None and (width, height) != tuple(expected_size):
        raise ImageSizeError(f"size {width}x{height}, expected {expected_size[0]}x{expected_size[1]}")
    if width * height > MAX_PIXELS:
        raise ImageSizeError(f"size {width}x{height} is over {MAX_PIXELS} pixels")
    channels = CHANNELS.get(encoding, 1)
    itemsize = 2 if encoding in ("16UC1", "mono16") else 1
    row_bytes = width * channels * itemsize
    if step < row_bytes:
        raise ConversionError(f"image step {step} is smaller than width*channels*bytes = {row_bytes}")
    data = np.frombuffer(bytes(msg.data) if not isinstance(msg.data, (bytes, bytearray, memoryview, np.ndarray))
                         else msg.data, dtype=np.uint8)
    if data.size < step * height:
        raise ConversionError(f"image data has {data.size} bytes, expected step*height = {step * height}")
    bridge = _cv_bridge()
    if bridge is not None:
        try:
            array = bridge.imgmsg_to_cv2(msg, desired_encoding="passthrough")
        except Exception as exc:  # cv_bridge's own errors: report them as ours
            raise ConversionError(f"cv_bridge could not decode the image: {exc}") from exc
        return np.ascontiguousarray(_to_rgb8(np.asarray(array), encoding))
    rows = data[: step * height].reshape(height, step)[:, :row_bytes]
    if itemsize == 2:
        dtype = np.dtype(">u2" if msg.is_bigendian else "<u2")
        array = np.ascontiguousarray(rows).view(dtype).reshape(height, width).astype(np.uint16)
    else:
        array = rows.reshape(height, width, channels) if channels > 1 else rows.reshape(height, width)
    return np.ascontiguousarray(_to_rgb8(array, encoding))


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (every coding process); C4 (DHT), C8 (JPG) and CC (DAC) share the range
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_JPEG_NO_LENGTH = {0x01, *range(0xD0, 0xD9)}  # TEM, RST0-7 and SOI stand alone
# Without an expected size, the most pixels an image may have (4096x4096: 48 MB as RGB); compressed ones are
# checked from their header, before decoding.
MAX_PIXELS = 4096 * 4096


def _jpeg_frame(data, fmt: str):
    """(width, height, SOF marker, [(h, v) sampling of each component], offset where the first scan's entropy-coded
    data starts, or None without a scan) of a JPEG stream, from its marker segments."""
    pos, frame = 2, None
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            break  # not a marker where one must be: the stream is corrupt
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _JPEG_NO_LENGTH:
            pos += 2
            continue
        if marker == 0xD9:  # end of image
            break
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker == 0xDA:  # start of scan: the frame header must have come before it
            return (*frame, pos + 2 + length) if frame is not None else None
        if marker in _JPEG_SOF and frame is None and length >= 8 and pos + 10 <= len(data):
            height = int.from_bytes(data[pos + 5:pos + 7], "big")
            width = int.from_bytes(data[pos + 7:pos + 9], "big")
            if height == 0:  # the height comes later, in a DNL marker: not supported
                raise ConversionError(f"compressed image (format '{fmt}') states no height in its frame header")
            sampling = [(data[p + 1] >> 4, data[p + 1] & 15) for p in range(pos + 10, min(pos + 10 + 3 * data[pos + 9],
                                                                                         len(data) - 1), 3)]
            frame = (width, height, marker, sampling)
        pos += 2 + length
    return (*frame, None) if frame is not None else None


def compressed_size(data, fmt: str = "") -> tuple[int, int]:
    """(width, height) of a PNG (IHDR) or JPEG (SOF) stream, read from its header bytes without decoding."""
    if data[:8] == PNG_SIGNATURE:
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise ConversionError(f"compressed image (format '{fmt}') could not be decoded: PNG without an IHDR header")
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:2] == b"\xff\xd8":
        frame = _jpeg_frame(data, fmt)
        if frame is None:
            raise ConversionError(f"compressed image (format '{fmt}') could not be decoded: no JPEG frame header (SOF)")
        return frame[0], frame[1]
    raise ConversionError(f"compressed image (format '{fmt}') is neither PNG nor JPEG: its size cannot be checked "
                          "before decoding")


def _check_jpeg_scan(data, fmt: str) -> None:
    """A JPEG whose entropy-coded data is too short to fill the frame its SOF states is refused before decoding
    (libjpeg would fill the rest with grey: an edited header turns a 2 KB file into a 4000x4000 image). The
    bound is exact for Huffman coding: sequential (SOF0/1) codes every 8x8 block with at least a 1-bit DC code
    and a 1-bit end-of-block, lossless (SOF3) every sample with at least one bit. Progressive and arithmetic
    streams can code a run of empty blocks in a few bits: they have no such bound."""
    frame = _jpeg_frame(data, fmt)
    if frame is None or frame[4] is None:
        raise ConversionError(f"compressed image (format '{fmt}') could not be decoded: no JPEG scan")
    width, height, marker, sampling, scan = frame
    if marker not in (0xC0, 0xC1, 0xC3) or not sampling:
        return
    h_max, v_max = max(h for h, _ in sampling) or 1, max(v for _, v in sampling) or 1
    samples = [(-(-width * h // h_max), -(-height * v // v_max)) for h, v in sampling]
    if marker == 0xC3:
        least = sum(w * h for w, h in samples) / 8
    else:
        least = sum(-(-w // 8) * -(-h // 8) for w, h in samples) * 2 / 8
    if len(data) - scan < least:
        raise ConversionError(f"compressed image (format '{fmt}') is corrupt: its frame header says {width}x{height} "
                              f"but its {len(data) - scan} bytes of scan data cannot fill it (at least "
                              f"{int(least)} needed); not decoded")


def frame_size(msg) -> tuple[int, int]:
    """(width, height) of a sensor_msgs/Image or CompressedImage, from its fields or compressed header; no decoding."""
    if hasattr(msg, "encoding"):
        return int(msg.width), int(msg.height)
    return compressed_size(memoryview(msg.data), msg.format)


def compressed_to_rgb(msg, expected_size: tuple[int, int] | None = None) -> np.ndarray:
    """sensor_msgs/CompressedImage (png/jpeg) -> HxWx3 uint8 RGB array. The size is read from the header and
    checked first: against `expected_size` (width, height) when given, else against MAX_PIXELS;
    an image refused there is never decoded (a few hundred KB of PNG can claim gigabytes of pixels)."""
    import cv2

    data = memoryview(msg.data)  # (no copy: only the header is read before the size is known to be right)
    if len(data) == 0:
        raise ConversionError("compressed image is empty")
    width, height = compressed_size(data, msg.format)
    if expected_size is not None and (width, height) != tuple(expected_size):
        raise ImageSizeError(f"size {width}x{height} (from its header, not decoded), expected "
                             f"{expected_size[0]}x{expected_size[1]}")
    if width * height == 0 or width * height > MAX_PIXELS:
        raise ImageSizeError(f"size {width}x{height} (from its header, not decoded) is outside "
                             f"1..{MAX_PIXELS} pixels")
    if data[:2] == b"\xff\xd8":
        _check_jpeg_scan(data, msg.format)
    try:
        decoded = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
    except Exception as exc:  # cv2.error: a stream OpenCV refuses part-way
        raise ConversionError(f"compressed image (format '{msg.format}') could not be decoded: "
                              f"{str(exc).strip().splitlines()[-1]}") from None
    if decoded is None:
        raise ConversionError(f"compressed image (format '{msg.format}') could not be decoded")
    if decoded.shape[:2] != (height, width):
        raise ConversionError(f"compressed image (format '{msg.format}') decodes to {decoded.shape[1]}x"
                              f"{decoded.shape[0]}, its header says {width}x{height}")
    if decoded.dtype not in (np.uint8, np.uint16) or decoded.ndim not in (2, 3):
        raise ConversionError(f"compressed image (format '{msg.format}') decodes to {decoded.dtype} with shape "
                              f"{decoded.shape}; expected 8- or 16-bit mono or colour")
    if decoded.ndim == 2:
        return _to_rgb8(decoded, "mono8" if decoded.dtype == np.uint8 else "16UC1")
    if decoded.shape[2] not in (3, 4):
        raise ConversionError(f"compressed image (format '{msg.format}') has {decoded.shape[2]} channels")
    if decoded.dtype == np.uint16:  # 16-bit colour: keep the high byte, as for 16-bit mono
        decoded = (decoded >> 8).astype(np.uint8)
    return np.ascontiguousarray(decoded[..., 2::-1])  # OpenCV decodes to BGR(A)


def rgb_to_image(rgb: np.ndarray, image_type, stamp=None, frame_id: str = "", encoding: str = "rgb8", pad: int = 0):
    """HxWx3 uint8 RGB -> sensor_msgs/Image (used by the synthetic camera and the tests)."""
    msg = image_type()
    if stamp is not None:
        msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    height, width = rgb.shape[:2]
    if encoding == "rgb8":
        pixels = rgb
    elif encoding == "bgr8":
        pixels = rgb[..., ::-1]
    elif encoding in ("rgba8", "bgra8"):
        alpha = np.full(rgb.shape[:2] + (1,), 255, np.uint8)
        pixels = np.concatenate([rgb if encoding == "rgba8" else rgb[..., ::-1], alpha], axis=2)
    elif encoding == "mono8":
        pixels = rgb.mean(axis=2).astype(np.uint8)
    elif encoding in ("16UC1", "mono16"):
        pixels = (rgb.mean(axis=2).astype(np.uint16) << 8).astype("<u2")
    else:
        raise ConversionError(f"cannot encode '{encoding}'")
    row = np.ascontiguousarray(pixels).view(np.uint8).reshape(height, -1)
    if pad:
        row = np.concatenate([row, np.zeros((height, pad), np.uint8)], axis=1)
    msg.height, msg.width, msg.encoding, msg.is_bigendian = height, width, encoding, 0
    msg.step = row.shape[1]
    msg.data = row.tobytes()
    return msg


def prompt_text(cdr: bytes) -> str:
    """A std_msgs/String's text from its serialized bytes (a raw subscription), refusing what rclpy's own
    conversion would silently change: a NUL byte (the text was cut there) and invalid UTF-8 (each bad byte became
    U+FFFD). (A Python sender's rclpy cuts at a NUL before sending: that cannot be seen here.)"""
    if len(cdr) < 8 or cdr[0] != 0 or cdr[1] not in (0, 1):
        raise ConversionError("prompt: not a serialized std_msgs/String")
    length = int.from_bytes(cdr[4:8], "little" if cdr[1] == 1 else "big")
    text = bytes(cdr[8:8 + length])
    if len(text) != length or length == 0 or text[-1] != 0:
        raise ConversionError("prompt: malformed std_msgs/String (its length field and data disagree)")
    text = text[:-1]
    if b"\x00" in text:
        raise ConversionError(f"prompt: a NUL byte at byte {text.index(0)} (the text would be cut there); refused")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConversionError(f"prompt: invalid UTF-8 at byte {exc.start} ({text[exc.start:exc.start + 4]!r}); "
                              "refused (it would reach the tokenizer as U+FFFD)") from None


def joint_positions(msg, joint_names: list[str]) -> np.ndarray:
    """sensor_msgs/JointState -> float32 positions ordered by `joint_names`; every joint must be present,
    and named once."""
    if len(msg.position) != len(msg.name):
        raise ConversionError(f"JointState has {len(msg.name)} names but {len(msg.position)} positions")
    seen, twice = set(), []
    for name in msg.name:
        if name in seen and name not in twice:
            twice.append(name)
        seen.add(name)
    if twice:  # which of the values is the joint's? refused rather than the last one winning
        raise ConversionError(f"JointState names joints {twice} more than once")
    index = {name: i for i, name in enumerate(msg.name)}
    if not joint_names:
        values = np.asarray(msg.position, dtype=np.float64)
    else:
        missing = [n for n in joint_names if n not in index]
        if missing:
            raise ConversionError(f"JointState lacks joints {missing} (has {list(msg.name)})")
        values = np.asarray([msg.position[index[n]] for n in joint_names], dtype=np.float64)
    names = list(joint_names) or list(msg.name)  # (in message order: the message's own names, if it has them)
    # (read as float64, as sent: a finite 1e300 is out of range, not "non-finite" after a cast to float32)
    for bad, what in ((~np.isfinite(values), "non-finite positions"),
                      (np.abs(np.nan_to_num(values)) > np.finfo(np.float32).max, "positions out of range")):
        if bad.any():
            at = np.flatnonzero(bad)
            named = [names[i] if i < len(names) else str(i) for i in at]
            raise ConversionError(f"JointState has {what} for {named}" + (
                f" ({', '.join(f'{values[i]:g}' for i in at)}: beyond float32's 3.4e38)" if what.endswith("range")
                else ""))
    return values.astype(np.float32)


def state_vector(msg, dim: int | None = None) -> np.ndarray:
    """std_msgs/Float64MultiArray -> float32 state vector (its `data`, in the checkpoint's observation.state
    order; the layout is not read); `dim` values when given, all finite."""
    values = np.asarray(msg.data, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ConversionError(f"state vector is empty or not flat (shape {values.shape})")
    if dim is not None and values.size != dim:
        raise ConversionError(f"state vector has {values.size} values, the model's state has {dim}")
    if not np.all(np.isfinite(values)):
        raise ConversionError(f"state vector has non-finite values at {np.flatnonzero(~np.isfinite(values)).tolist()}")
    if np.abs(values).max() > np.finfo(np.float32).max:
        raise ConversionError("state vector has values beyond float32's range")
    return values.astype(np.float32)


def action_chunk(actions, width: int | None = None) -> np.ndarray:
    """A policy's action chunk [horizon, >= width] -> float32 [horizon, width] (None: every column), refused
    (ConversionError naming the first bad step and dim) when anything in it is NaN or infinite: such a chunk
    is never sent to a robot."""
    a = np.asarray(actions, dtype=np.float32)
    if a.ndim != 2 or a.shape[1] < (width or 0):
        raise ConversionError(f"action chunk: expected [horizon, >= {width}], got {a.shape}")
    a = a[:, :width]
    bad = np.argwhere(~np.isfinite(a))
    if len(bad):
        step, dim = (int(v) for v in bad[0])
        raise ConversionError(f"the policy produced {len(bad)} non-finite actions (first at step {step}, dim {dim}: "
                              f"{a[step, dim]}); chunk not published")
    return a
