"""A request's control images on the worker: decoded as the API checked them (the ControlNet's own image processor
resizes them to the output size, as the pipeline does) and preprocessed when the request asks (`canny`: OpenCV's Canny edges with its thresholds, as diffusers' ControlNet
examples and controlnet_aux's `CannyDetector` make them, white edges on black in three channels)."""

from __future__ import annotations

from contract.generation import ControlRef
from contract.images import InputImageError, decode_input_image


class ControlImageError(ValueError):
    """A control image the worker cannot use (bad_input: the request fails alone)."""


def control_image(data: bytes, ref: ControlRef, max_pixels: int):
    """The PIL image a ControlNet is given for `ref`: the request's image, or its Canny edges."""
    try:
        image = decode_input_image(data, max_pixels)
    except InputImageError as exc:
        raise ControlImageError(f"control image of {ref.name}: {exc}") from exc
    if ref.preprocess == "canny":
        return canny(image, ref.low_threshold, ref.high_threshold)
    return image


def canny(image, low_threshold: int, high_threshold: int):
    """OpenCV's Canny edges of an RGB PIL image, as an RGB image (edges white on black)."""
    import cv2
    import numpy as np
    from PIL import Image

    edges = cv2.Canny(np.asarray(image), low_threshold, high_threshold)
    return Image.fromarray(np.stack([edges] * 3, axis=-1))
