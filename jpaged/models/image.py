"""Images -> the vision tower's pixel values, with Pillow and NumPy (no torch, no
torchvision): what transformers' Gemma 3 image processor does without pan-and-scan.

Each image is made RGB (transparency composited onto white, as transformers'
`convert_to_rgb` does), resized to the processor's size with Pillow's resampling filter,
rescaled (1/255) and normalized with the processor's mean and std, channels first.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # Pillow is imported where an image is met (0.1 s of a server's start)
    from PIL import Image


@dataclasses.dataclass(frozen=True)
class ImageProcessing:
    """preprocessor_config.json's fields that apply; defaults are Gemma 3's released ones."""

    height: int = 896
    width: int = 896
    resample: int = 2  # PIL.Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True


def image_processing(path: str | os.PathLike) -> ImageProcessing:
    """A checkpoint directory's preprocessor_config.json (Gemma 3's defaults if absent)."""
    file = os.path.join(path, "preprocessor_config.json")
    if not os.path.exists(file):
        return ImageProcessing()
    with open(file) as f:
        pc = json.load(f)
    if pc.get("do_pan_and_scan"):
        raise ValueError(f"{file}: pan-and-scan is not supported")
    d = ImageProcessing()
    size = pc.get("size") or {}
    return ImageProcessing(
        height=int(size.get("height", d.height)),
        width=int(size.get("width", d.width)),
        resample=int(pc.get("resample", d.resample)),
        rescale_factor=float(pc.get("rescale_factor", d.rescale_factor)),
        image_mean=tuple(float(m) for m in pc.get("image_mean", d.image_mean)),
        image_std=tuple(float(s) for s in pc.get("image_std", d.image_std)),
        do_resize=bool(pc.get("do_resize", d.do_resize)),
        do_rescale=bool(pc.get("do_rescale", d.do_rescale)),
        do_normalize=bool(pc.get("do_normalize", d.do_normalize)),
        do_convert_rgb=bool(pc.get("do_convert_rgb", d.do_convert_rgb)),
    )


def to_rgb(image: Image.Image) -> Image.Image:
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(images: Sequence[Image.Image], p: ImageProcessing) -> np.ndarray:
    """float32 pixel values `[N, 3, height, width]` of `images` (any sizes and modes)."""
    from PIL import Image

    out = []
    for image in images:
        if p.do_convert_rgb:
            image = to_rgb(image)
        if p.do_resize:
            image = image.resize((p.width, p.height), resample=Image.Resampling(p.resample))
        x = np.asarray(image, dtype=np.float32)
        if p.do_rescale:
            x = x * np.float32(p.rescale_factor)
        if p.do_normalize:
            mean, std = (np.asarray(a, np.float32) for a in (p.image_mean, p.image_std))
            x = (x - mean) / std
        out.append(x.transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)
