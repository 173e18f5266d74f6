"""Generated malformed input images: what an image-to-image request can carry that a decoder should refuse.

Each is built from a small valid image by hand (chunks, CRCs, headers), so the set needs no files and
covers what real decoders trip on: compressed metadata that inflates past Pillow's limits, truncation,
wrong CRCs, huge or zero dimensions, animated frames, EXIF bombs. The API's validation (a 422 naming the
field) and the worker's decoding (a `bad_input` reply for that request alone) are both fuzzed with them.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Inflates to 2 MiB: past Pillow's 1 MiB text-chunk limit (PngImagePlugin.MAX_TEXT_CHUNK).
_INFLATES_PAST_TEXT_LIMIT = zlib.compress(b"a" * (2 << 20), 9)


def _image(width: int = 64, height: int = 64, fmt: str = "PNG", **save) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes, crc: int | None = None) -> bytes:
    """One PNG chunk: length, type, data, CRC (the right one unless `crc` is given)."""
    value = zlib.crc32(kind + data) if crc is None else crc
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", value)


def _insert(png: bytes, chunk: bytes, before: bytes) -> bytes:
    at = png.index(before) - 4  # the chunk's length field precedes its type
    return png[:at] + chunk + png[at:]


def _with_bad_crc(png: bytes, kind: bytes) -> bytes:
    start = png.index(kind) - 4
    length = struct.unpack(">I", png[start : start + 4])[0]
    crc_at = start + 8 + length
    return png[:crc_at] + bytes(b ^ 0xFF for b in png[crc_at : crc_at + 4]) + png[crc_at + 4 :]


def _header_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR (CRC fixed up) claims another size: a bomb before anything is decoded."""
    data = bytearray(_image(1, 1))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _animated_png(frames: int = 3) -> bytes:
    from PIL import Image

    images = [Image.new("RGB", (64, 64), (i * 40, 0, 0)) for i in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format="PNG", save_all=True, append_images=images[1:], duration=100)
    return buffer.getvalue()


def _animated_webp(frames: int = 3) -> bytes:
    from PIL import Image

    images = [Image.new("RGB", (64, 64), (0, i * 40, 0)) for i in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format="WEBP", save_all=True, append_images=images[1:], duration=100, lossless=True)
    return buffer.getvalue()


def _tiff_exif_bomb() -> bytes:
    """A little-endian TIFF header whose first IFD claims 65,535 entries, each a huge array, and links to itself."""
    entry = struct.pack("<HHII", 0x010E, 2, 0xFFFFFFF0, 8)  # ImageDescription, ASCII, ~4 G characters at offset 8
    return b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 0xFFFF) + entry * 4000 + struct.pack("<I", 8)


def _jpeg_with_exif_bomb() -> bytes:
    jpeg = _image(fmt="JPEG")
    payload = b"Exif\x00\x00" + _tiff_exif_bomb()[: 0xFFFF - 8]
    app1 = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
    return jpeg[:2] + app1 + jpeg[2:]


def _png_with_exif_bomb() -> bytes:
    return _insert(_image(), png_chunk(b"eXIf", _tiff_exif_bomb()), b"IDAT")


def _text_bomb(kind: bytes) -> bytes:
    if kind == b"zTXt":
        return png_chunk(b"zTXt", b"comment\x00\x00" + _INFLATES_PAST_TEXT_LIMIT)
    # iTXt: keyword, compressed flag 1, method 0, empty language tag and translated keyword.
    return png_chunk(b"iTXt", b"comment\x00\x01\x00\x00\x00" + _INFLATES_PAST_TEXT_LIMIT)


def _jpeg_truncated() -> bytes:
    jpeg = _image(256, 256, fmt="JPEG", quality=95)
    return jpeg[: len(jpeg) // 2]


MALFORMED_IMAGES: dict[str, Callable[[], bytes]] = {
    "png: zTXt inflating past the text limit, before IDAT": lambda: _insert(_image(), _text_bomb(b"zTXt"), b"IDAT"),
    "png: iTXt inflating past the text limit, before IDAT": lambda: _insert(_image(), _text_bomb(b"iTXt"), b"IDAT"),
    "png: zTXt inflating past the text limit, after IDAT": lambda: _insert(_image(), _text_bomb(b"zTXt"), b"IEND"),
    "png: iCCP profile inflating past the limit": lambda: _insert(
        _image(), png_chunk(b"iCCP", b"icc\x00\x00" + _INFLATES_PAST_TEXT_LIMIT), b"IDAT"
    ),
    "png: 70 text chunks of 1 MiB each": lambda: _insert(
        _image(), png_chunk(b"zTXt", b"k\x00\x00" + zlib.compress(b"a" * 1_000_000, 9)) * 70, b"IDAT"
    ),
    "png: truncated in IDAT": lambda: _image(256, 256)[: len(_image(256, 256)) // 2],
    "png: signature only": lambda: PNG_SIGNATURE,
    "png: wrong IHDR CRC": lambda: _with_bad_crc(_image(), b"IHDR"),
    "png: wrong IDAT CRC": lambda: _with_bad_crc(_image(), b"IDAT"),
    "png: IDAT not zlib": lambda: (
        _image()[: _image().index(b"IDAT") - 4] + png_chunk(b"IDAT", b"\x00garbage" * 32) + png_chunk(b"IEND", b"")
    ),
    "png: header claims 16000x16000": lambda: _header_claiming(16000, 16000),
    "png: header claims 8000x8000": lambda: _header_claiming(8000, 8000),
    "png: header claims 0x0": lambda: _header_claiming(0, 0),
    "png: header claims 2^31-1 wide": lambda: _header_claiming(2**31 - 1, 1),
    "png: animated, 3 frames": _animated_png,
    "webp: animated, 3 frames": _animated_webp,
    "png: EXIF bomb (65,535 entries, self-linked IFD)": _png_with_exif_bomb,
    "jpeg: EXIF bomb (65,535 entries, self-linked IFD)": _jpeg_with_exif_bomb,
    "jpeg: truncated": _jpeg_truncated,
    "jpeg: SOI then garbage": lambda: b"\xff\xd8\xff" + b"\x00garbage" * 64,
    "gif: a format the models do not take": lambda: _image(fmt="GIF"),
}
"""Name -> builder of a malformed image; built on demand (some are a few MiB when inflated)."""

# Images a decoder may accept as they are (metadata nobody reads): a 422 or a normal answer, never a 500.
MAY_BE_ACCEPTED = {
    "png: EXIF bomb (65,535 entries, self-linked IFD)",
    "jpeg: EXIF bomb (65,535 entries, self-linked IFD)",
}
