"""Valid PNG streams of any size in few bytes, for the tests of the size check before decoding."""
import struct
import zlib

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def valid_png(width: int, height: int, rng, channels: int = 3) -> bytes:
    """A valid PNG (8-bit RGB or grey) of any size in few bytes: a random first row, and every later row
    filtered 'Up' to zeros (it repeats the first), so that the deflate stream stays about 1/1000 of the pixels."""
    first = b"\x00" + rng.integers(1, 255, size=width * channels, dtype=np.uint8).tobytes()
    up = b"\x02" + bytes(width * channels)
    z = zlib.compressobj(9)
    idat = b"".join([z.compress(first)] + [z.compress(up) for _ in range(height - 1)] + [z.flush()])

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2 if channels == 3 else 0, 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
