"""An inpaint request's mask, checked before anything is published, and outpainting made into inpainting.

A mask is read as diffusers reads it: grayscale, white repaints, black keeps (SD 1.5's inpainting pipeline then
binarizes it at one half). It must be the input image's size: a mask of another size is refused (422 naming it)
rather than stretched, on every route, since a stretched mask repaints a region the client did not draw. A mask
with nothing white enough to repaint (every pixel below one half, as the pipeline binarizes) would return the
image unchanged at the full price: refused too.

Outpainting (`parameters.outpaint: {left, right, top, bottom}` in pixels) is inpainting of a larger canvas: the
API pads the image (its edge pixels repeated outwards) and makes the mask (white on the new border, black over the
image), so the worker runs an ordinary inpaint request and the answer is the larger image.
"""

from __future__ import annotations

import io

from pydantic import BaseModel, ConfigDict, Field

from api_server.core.errors import ApiError
from contract.images import InputImageError, decode_input_image

# Below this grey (of 255) a pixel keeps: the pipeline's binarization at one half.
REPAINT_THRESHOLD = 128


class Outpaint(BaseModel):
    """Pixels added on each side of the input image; the model paints them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    left: int = Field(default=0, ge=0, le=2048)
    right: int = Field(default=0, ge=0, le=2048)
    top: int = Field(default=0, ge=0, le=2048)
    bottom: int = Field(default=0, ge=0, le=2048)


def checked_mask(data: bytes, field: str, image: bytes | tuple[int, int], max_pixels: int | None) -> None:
    """Refuses (422 naming `field`) a mask that is not an image, is not the image's size, or repaints nothing;
    `image` is the input image, or the (width, height) of the image a flow drafts before repainting it."""
    try:
        mask = decode_input_image(data, max_pixels).convert("L")
        size = image if isinstance(image, tuple) else decode_input_image(image, max_pixels).size
    except InputImageError as exc:
        raise ApiError(422, f"{field}: {exc}", field) from exc
    if mask.size != size:
        whose = "the image's size" if not isinstance(image, tuple) else "the size of the image it repaints"
        asked = "" if not isinstance(image, tuple) else " (parameters.width x parameters.height)"
        raise ApiError(
            422,
            f"{field}: {mask.size[0]}x{mask.size[1]} is not {whose} {size[0]}x{size[1]}{asked}; send a mask of {whose}",
            field,
        )
    if mask.getextrema()[1] < REPAINT_THRESHOLD:
        raise ApiError(422, f"{field}: all black, nothing to repaint (white repaints, black keeps)", field)


def repaint_fraction(data: bytes) -> float:
    """The share of the mask's pixels that repaint (the log row's mask area)."""
    mask = decode_input_image(data).convert("L")
    histogram = mask.histogram()
    return sum(histogram[REPAINT_THRESHOLD:]) / (mask.size[0] * mask.size[1])


def outpainted(image: bytes, outpaint: Outpaint) -> tuple[bytes, bytes]:
    """The image padded by `outpaint` (its edge pixels repeated outwards) and the mask that repaints the padding,
    both PNG."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(decode_input_image(image))
    pad = ((outpaint.top, outpaint.bottom), (outpaint.left, outpaint.right), (0, 0))
    padded = Image.fromarray(np.pad(pixels, pad, mode="edge"))
    mask = np.full(padded.size[::-1], 255, dtype=np.uint8)
    height, width = pixels.shape[:2]
    mask[outpaint.top : outpaint.top + height, outpaint.left : outpaint.left + width] = 0
    return _png(padded), _png(Image.fromarray(mask, mode="L"))


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
