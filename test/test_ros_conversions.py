"""ROS message <-> array conversions: every supported encoding, row padding, endianness, bad input."""
import numpy as np
import pytest

pytestmark = pytest.mark.ros

from flashrt_ros import conversions as cv  # noqa: E402
from png_testing import valid_png  # noqa: E402


@pytest.fixture
def rgb():
    return np.random.default_rng(3).integers(1, 255, size=(13, 17, 3), dtype=np.uint8)


@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8"])
def test_colour_images_round_trip_exactly(rgb, encoding, pad):
    """(rgba8 / bgra8, as e.g. ZED cameras send them: the alpha channel is dropped)"""
    from sensor_msgs.msg import Image

    msg = cv.rgb_to_image(rgb, Image, encoding=encoding, pad=pad)
    assert msg.step == 17 * len(encoding.removesuffix("8")) + pad
    np.testing.assert_array_equal(cv.image_to_rgb(msg), rgb)


def test_mono8_and_16uc1_become_grey_rgb(rgb):
    from sensor_msgs.msg import Image

    grey = rgb.mean(axis=2).astype(np.uint8)
    for encoding in ("mono8", "16UC1"):
        out = cv.image_to_rgb(cv.rgb_to_image(rgb, Image, encoding=encoding, pad=3))
        assert out.shape == (13, 17, 3)
        np.testing.assert_array_equal(out[..., 0], grey)
        np.testing.assert_array_equal(out[..., 2], grey)


def test_big_endian_16uc1_is_honoured():
    from sensor_msgs.msg import Image

    depth = np.random.default_rng(0).integers(256, 65535, size=(5, 7)).astype(np.uint16)
    msg = Image(height=5, width=7, encoding="16UC1", is_bigendian=1, step=14)
    msg.data = depth.astype(">u2").tobytes()
    np.testing.assert_array_equal(cv.image_to_rgb(msg)[..., 1], (depth >> 8).astype(np.uint8))


def test_compressed_png_decodes_to_rgb(rgb):
    import cv2
    from sensor_msgs.msg import CompressedImage

    ok, buf = cv2.imencode(".png", rgb[..., ::-1])
    assert ok
    msg = CompressedImage(format="png", data=buf.tobytes())
    np.testing.assert_array_equal(cv.compressed_to_rgb(msg), rgb)


@pytest.mark.parametrize("mutate, message", [
    (lambda m: setattr(m, "encoding", "yuv422"), "unsupported image encoding 'yuv422'"),
    (lambda m: setattr(m, "step", 10), "step 10 is smaller"),
    (lambda m: setattr(m, "data", bytes(m.data)[:100]), r"expected step\*height"),
    (lambda m: setattr(m, "width", 0), "no pixels"),
])
def test_malformed_images_are_refused_with_the_reason(rgb, mutate, message):
    from sensor_msgs.msg import Image

    msg = cv.rgb_to_image(rgb, Image)
    mutate(msg)
    with pytest.raises(cv.ConversionError, match=message):
        cv.image_to_rgb(msg)


def test_corrupt_compressed_image_is_refused():
    from sensor_msgs.msg import CompressedImage

    with pytest.raises(cv.ConversionError, match="could not be decoded"):
        cv.compressed_to_rgb(CompressedImage(format="jpeg", data=b"\xff\xd8 not a jpeg"))


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header (with its CRC fixed) claims another size."""
    import struct
    import zlib

    import cv2

    png = bytearray(cv2.imencode(".png", np.zeros((1, 1, 3), np.uint8))[1].tobytes())
    ihdr = 8 + 4  # signature, then the IHDR chunk's length; its type and data follow
    png[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    png[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(png[ihdr:ihdr + 17])))
    return bytes(png)


@pytest.fixture(scope="module")
def huge_png():
    """The issue's frame: a valid 8000x8000 RGB PNG of about 200 KB (192 MB once decoded)."""
    return valid_png(8000, 8000, np.random.default_rng(11))


@pytest.fixture
def decoder_calls(monkeypatch):
    """Every call of cv2.imdecode (still decoding), so a test can say that a frame was never decoded."""
    import cv2

    calls, real = [], cv2.imdecode
    monkeypatch.setattr(cv2, "imdecode", lambda *a: calls.append(len(a[0])) or real(*a))
    return calls


def test_the_png_builder_makes_real_pngs():
    import cv2

    data = valid_png(17, 13, np.random.default_rng(4))
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    assert decoded.shape == (13, 17, 3) and (decoded == decoded[0]).all() and decoded.any()


def test_a_huge_compressed_frame_is_refused_from_its_header_and_never_decoded(huge_png, decoder_calls):
    """One valid 8000x8000 PNG of ~200 KB used to be decoded (1.6 s of the executor, +368 MB) before it was
    refused as the wrong size: its size is now read from the IHDR bytes and compared first."""
    from sensor_msgs.msg import CompressedImage

    assert len(huge_png) < 300_000
    assert cv.compressed_size(huge_png) == (8000, 8000)
    msg = CompressedImage(format="png", data=huge_png)
    with pytest.raises(cv.ImageSizeError, match=r"size 8000x8000 \(from its header, not decoded\), expected 64x48"):
        cv.compressed_to_rgb(msg, expected_size=(64, 48))
    # without an expected size, the decode bound refuses it all the same
    with pytest.raises(cv.ImageSizeError, match=f"outside 1..{cv.MAX_PIXELS} pixels"):
        cv.compressed_to_rgb(msg)
    # a header claiming more than OpenCV allows (it raises cv2.error for those) is refused the same way
    with pytest.raises(cv.ImageSizeError, match="size 100000x100000"):
        cv.compressed_to_rgb(CompressedImage(format="png", data=_png_claiming(100000, 100000)), expected_size=(64, 48))
    assert decoder_calls == []
    # a frame of the expected size is decoded (once), pixel for pixel
    small = valid_png(64, 48, np.random.default_rng(5), channels=1)
    out = cv.compressed_to_rgb(CompressedImage(format="png", data=small), expected_size=(64, 48))
    assert out.shape == (48, 64, 3) and decoder_calls == [len(small)]
    row = np.random.default_rng(5).integers(1, 255, size=64, dtype=np.uint8)  # the builder's first (and every) row
    np.testing.assert_array_equal(out, np.broadcast_to(row[None, :, None], (48, 64, 3)))


@pytest.mark.parametrize("progressive", [0, 1])
def test_jpeg_sizes_are_read_from_the_frame_header(rgb, progressive, decoder_calls):
    import struct

    import cv2
    from sensor_msgs.msg import CompressedImage

    ok, buf = cv2.imencode(".jpg", rgb[..., ::-1], [cv2.IMWRITE_JPEG_PROGRESSIVE, progressive])
    assert ok
    data = buf.tobytes()
    assert cv.compressed_size(data) == (17, 13)
    sof = data.index(b"\xff\xc2" if progressive else b"\xff\xc0")
    assert cv.compressed_to_rgb(CompressedImage(format="jpeg", data=data), expected_size=(17, 13)).shape == (13, 17, 3)
    huge = data[:sof + 5] + struct.pack(">HH", 9000, 12000) + data[sof + 9:]
    with pytest.raises(cv.ImageSizeError, match=r"size 12000x9000 \(from its header, not decoded\), expected 17x13"):
        cv.compressed_to_rgb(CompressedImage(format="jpeg", data=huge), expected_size=(17, 13))
    assert decoder_calls == [len(data)]


def test_a_jpeg_whose_scan_data_cannot_fill_its_frame_header_is_refused_undecoded(decoder_calls):
    """The fuzzer's frame: a small JPEG with its SOF edited to 4000x4000 decoded (libjpeg fills the missing blocks
    with grey) to a garbage image used as camera input. A Huffman-coded block takes at least two bits."""
    import struct

    import cv2
    from sensor_msgs.msg import CompressedImage

    rgb = np.random.default_rng(8).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    data = cv2.imencode(".jpg", rgb)[1].tobytes()
    assert len(data) < 8000
    sof = data.index(b"\xff\xc0")
    edited = data[:sof + 5] + struct.pack(">HH", 4000, 4000) + data[sof + 9:]
    with pytest.raises(cv.ConversionError, match=r"corrupt: its frame header says 4000x4000 but its \d+ bytes of "
                                                 r"scan data cannot fill it \(at least 93750 needed\); not decoded"):
        cv.compressed_to_rgb(CompressedImage(format="jpeg", data=edited))
    assert decoder_calls == []
    # the bound is what the smallest honest streams reach: black frames with optimized Huffman tables (1-bit
    # codes), grey and colour, and a progressive one (no bound) are taken whole
    optimized, progressive = [cv2.IMWRITE_JPEG_OPTIMIZE, 1], [cv2.IMWRITE_JPEG_PROGRESSIVE, 1]
    for image, options in (((4000, 4000), optimized), ((4000, 4000, 3), optimized), ((4000, 4000, 3), progressive)):
        black = cv2.imencode(".jpg", np.zeros(image, np.uint8), options)[1].tobytes()
        out = cv.compressed_to_rgb(CompressedImage(format="jpeg", data=black))
        assert out.shape == (4000, 4000, 3) and not out.any()


@pytest.mark.parametrize("data, message", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "PNG without an IHDR header"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(7) + b"\xff\xda\x00\x08", r"no JPEG frame header \(SOF\)"),
    (b"GIF89a\x01\x00\x01\x00", "neither PNG nor JPEG"),
])
def test_compressed_streams_without_a_readable_size_are_refused_undecoded(data, message, decoder_calls):
    from sensor_msgs.msg import CompressedImage

    with pytest.raises(cv.ConversionError, match=message):
        cv.compressed_to_rgb(CompressedImage(format="x", data=data), expected_size=(64, 48))
    assert decoder_calls == []


def test_raw_images_of_another_size_are_refused_before_conversion(rgb):
    from sensor_msgs.msg import Image

    msg = cv.rgb_to_image(rgb, Image, pad=2)
    np.testing.assert_array_equal(cv.image_to_rgb(msg, expected_size=(17, 13)), rgb)
    with pytest.raises(cv.ImageSizeError, match="size 17x13, expected 13x17"):
        cv.image_to_rgb(msg, expected_size=(13, 17))


def test_16_bit_colour_is_reduced_to_its_high_byte_and_other_formats_are_refused(rgb):
    import cv2
    from sensor_msgs.msg import CompressedImage

    wide = rgb.astype(np.uint16) * 256 + 7  # high byte = the 8-bit value
    ok, buf = cv2.imencode(".png", wide[..., ::-1])
    assert ok
    np.testing.assert_array_equal(cv.compressed_to_rgb(CompressedImage(format="png", data=buf.tobytes())), rgb)
    ok, buf = cv2.imencode(".tiff", rgb.astype(np.float32))  # (its size is not read before decoding)
    assert ok
    with pytest.raises(cv.ConversionError, match="neither PNG nor JPEG"):
        cv.compressed_to_rgb(CompressedImage(format="tiff", data=buf.tobytes()))


def test_joint_states_are_mapped_by_name_and_checked():
    from sensor_msgs.msg import JointState

    msg = JointState(name=["b", "a", "c"], position=[0.25, -0.5, 1.5])
    np.testing.assert_array_equal(cv.joint_positions(msg, ["a", "b"]), np.float32([-0.5, 0.25]))
    np.testing.assert_array_equal(cv.joint_positions(msg, []), np.float32([0.25, -0.5, 1.5]))
    with pytest.raises(cv.ConversionError, match=r"lacks joints \['d'\]"):
        cv.joint_positions(msg, ["a", "d"])
    msg.position = [0.25, float("nan"), 1.5]
    with pytest.raises(cv.ConversionError, match=r"non-finite positions for \['a'\]"):
        cv.joint_positions(msg, ["a", "b"])
    msg.position = [0.25, 1e300, 1.5]  # finite, but no float32: out of range, not "non-finite"
    with pytest.raises(cv.ConversionError, match=r"positions out of range for \['a'\] \(1e\+300: beyond float32's"):
        cv.joint_positions(msg, ["a", "b"])
    with pytest.raises(cv.ConversionError, match="3 names but 2 positions"):
        cv.joint_positions(JointState(name=["a", "b", "c"], position=[1.0, 2.0]), [])


@pytest.mark.parametrize("wanted", [["a", "b"], []])
def test_a_joint_named_twice_is_refused_with_its_name(wanted):
    """The last value used to win silently."""
    from sensor_msgs.msg import JointState

    values = np.random.default_rng(8).uniform(0.1, 1.0, size=5).tolist()
    msg = JointState(name=["b", "a", "c", "a", "b"], position=values)
    with pytest.raises(cv.ConversionError, match=r"names joints \['a', 'b'\] more than once"):
        cv.joint_positions(msg, wanted)
    msg.name = ["b", "a", "c", "d", "e"]
    np.testing.assert_array_equal(cv.joint_positions(msg, ["a", "b"]), np.float32(values[1::-1]))


def test_stamp_conversion_round_trips():
    from builtin_interfaces.msg import Time

    ns = 1_733_000_123_456_789_012
    assert cv.stamp_to_ns(cv.ns_to_stamp(ns, Time)) == ns


def test_cv_bridge_is_used_when_the_ros_install_has_it(monkeypatch, rgb):
    """With a cv_bridge module importable, decoding goes through CvBridge (here a stand-in that decodes
    like the real one, passthrough) and gives the same pixels; its errors come back as ConversionError."""
    import sys
    import types

    from sensor_msgs.msg import Image

    calls = []

    class StandInBridge:
        def imgmsg_to_cv2(self, msg, desired_encoding):
            calls.append(desired_encoding)
            if msg.header.frame_id == "broken":
                raise RuntimeError("bridge refused")
            rows = np.frombuffer(bytes(msg.data), np.uint8).reshape(msg.height, msg.step)
            return rows[:, : msg.width * 3].reshape(msg.height, msg.width, 3)

    monkeypatch.setitem(sys.modules, "cv_bridge", types.SimpleNamespace(CvBridge=StandInBridge))
    monkeypatch.setattr(cv, "_BRIDGE", None)
    msg = cv.rgb_to_image(rgb, Image, encoding="bgr8", pad=4)
    np.testing.assert_array_equal(cv.image_to_rgb(msg), rgb)
    assert calls == ["passthrough"]
    msg.header.frame_id = "broken"
    with pytest.raises(cv.ConversionError, match="cv_bridge could not decode the image: bridge refused"):
        cv.image_to_rgb(msg)
    monkeypatch.setattr(cv, "_BRIDGE", None)


def test_an_action_chunk_with_nan_or_inf_is_never_published():
    """The node sends a chunk only through action_chunk: finite values pass (cut to the joints' width, float32),
    a NaN or infinite value anywhere is refused with the count and the first bad step and dim."""
    chunk = np.random.default_rng(5).normal(size=(50, 8)) + 0.5
    out = cv.action_chunk(chunk, 6)
    assert out.dtype == np.float32 and out.shape == (50, 6)
    np.testing.assert_array_equal(out, chunk[:, :6].astype(np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        broken = chunk.copy()
        broken[7, 3] = bad
        broken[9, 0] = bad
        with pytest.raises(cv.ConversionError, match=r"2 non-finite actions \(first at step 7, dim 3"):
            cv.action_chunk(broken, 6)
    broken = chunk.copy()
    broken[0, 7] = np.nan  # beyond the published width: not sent, so not refused
    assert cv.action_chunk(broken, 6).shape == (50, 6)
    with pytest.raises(cv.ConversionError, match="expected"):
        cv.action_chunk(chunk[0], 6)


def test_raw_images_over_the_pixel_bound_are_refused_before_conversion():
    from sensor_msgs.msg import Image

    msg = Image(height=4097, width=4096, encoding="mono8", step=4096, data=b"")
    with pytest.raises(cv.ImageSizeError, match="over 16777216 pixels"):
        cv.image_to_rgb(msg)


def test_state_vector_from_float64_multiarray():
    from std_msgs.msg import Float64MultiArray

    v = np.random.default_rng(4).normal(size=6)
    np.testing.assert_array_equal(cv.state_vector(Float64MultiArray(data=v.tolist()), 6), v.astype(np.float32))
    with pytest.raises(cv.ConversionError, match="has 6 values, the model's state has 7"):
        cv.state_vector(Float64MultiArray(data=v.tolist()), 7)
    with pytest.raises(cv.ConversionError, match=r"non-finite values at \[2\]"):
        cv.state_vector(Float64MultiArray(data=[0.0, 1.0, float("nan")]))
    with pytest.raises(cv.ConversionError, match="empty"):
        cv.state_vector(Float64MultiArray(data=[]))
