"""Decodes an input image the one way both sides accept it: the API refuses with it, the worker runs with it.

Pillow parses untrusted bytes here, and its decoders signal a bad image with many exception types
(ValueError for a text chunk that inflates too far, OSError for truncation, SyntaxError for a broken
chunk, struct.error, EOFError, zlib.error...). Every one of them means the same thing to a caller, so
they all become `InputImageError`, whose short message says what was wrong.
The size is checked from the header before any pixel is decoded, so a decompression bomb costs nothing.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL.Image import Image

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP")


class InputImageError(ValueError):
    """An input image no decoder here will turn into pixels; the message is safe to show a client."""


def decode_input_image(data: bytes, max_pixels: int | None = None) -> Image:
    """The image's pixels as RGB: a single still PNG, JPEG or WebP, within `max_pixels`, intact (CRCs checked)."""
    from PIL import Image as PilImage
    from PIL import UnidentifiedImageError

    try:
        with PilImage.open(io.BytesIO(data)) as image:
            _check_header(image, max_pixels)
            image.verify()  # PNG chunk CRCs; must be a fresh open before the pixels are read
        with PilImage.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except InputImageError:
        raise
    except UnidentifiedImageError as exc:
        raise InputImageError("not a PNG, JPEG or WebP image") from exc
    except PilImage.DecompressionBombError as exc:
        raise InputImageError(f"image too large ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - every decoder failure is a refused image, whatever its type
        raise InputImageError(f"not a readable image ({_reason(exc)})") from exc


def _check_header(image: Image, max_pixels: int | None) -> None:
    if image.format not in ACCEPTED_FORMATS:
        raise InputImageError(f"must be PNG, JPEG or WebP, not {image.format}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InputImageError(f"{width}x{height} has no pixels")
    if max_pixels is not None and width * height > max_pixels:
        raise InputImageError(f"{width}x{height} exceeds the model's limit of {max_pixels} pixels")
    frames = getattr(image, "n_frames", 1)
    if frames != 1:
        raise InputImageError(f"animated images are not accepted ({frames} frames); send one still image")


def _reason(exc: Exception) -> str:
    """The decoder's own words, first line only and cut short: they name the problem (e.g. a chunk's limit)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:120]
