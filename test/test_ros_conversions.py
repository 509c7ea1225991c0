"""ROS message <-> array conversions: every supported encoding, row padding, endianness, bad input."""
import numpy as np
import pytest

pytestmark = pytest.mark.ros

from flashrt_ros import conversions as cv  # noqa: E402


@pytest.fixture
def rgb():
    return np.random.default_rng(3).integers(1, 255, size=(13, 17, 3), dtype=np.uint8)


@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("encoding", ["rgb8", "bgr8"])
def test_colour_images_round_trip_exactly(rgb, encoding, pad):
    from sensor_msgs.msg import Image

    msg = cv.rgb_to_image(rgb, Image, encoding=encoding, pad=pad)
    assert msg.step == 17 * 3 + pad
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


def test_a_compressed_image_that_opencv_refuses_to_decode_is_a_conversion_error():
    """OpenCV raises (cv2.error, not None) for a header beyond its pixel limit: one such message used to
    escape the callback and end the node."""
    from sensor_msgs.msg import CompressedImage

    with pytest.raises(cv.ConversionError, match="could not be decoded: "):
        cv.compressed_to_rgb(CompressedImage(format="png", data=_png_claiming(100000, 100000)))


def test_16_bit_colour_is_reduced_to_its_high_byte_and_float_images_are_refused(rgb):
    import cv2
    from sensor_msgs.msg import CompressedImage

    wide = rgb.astype(np.uint16) * 256 + 7  # high byte = the 8-bit value
    ok, buf = cv2.imencode(".png", wide[..., ::-1])
    assert ok
    np.testing.assert_array_equal(cv.compressed_to_rgb(CompressedImage(format="png", data=buf.tobytes())), rgb)
    ok, buf = cv2.imencode(".tiff", rgb.astype(np.float32))
    assert ok
    with pytest.raises(cv.ConversionError, match="decodes to float32"):
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
    with pytest.raises(cv.ConversionError, match="3 names but 2 positions"):
        cv.joint_positions(JointState(name=["a", "b", "c"], position=[1.0, 2.0]), [])


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
