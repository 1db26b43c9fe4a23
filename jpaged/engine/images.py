"""A request's images in the engine: where each lies in the prompt (`ImageSpan`), the part
of them a step's row computes (`row_images`), and prompt chunks cut so that none splits an
image (`fit_chunk`).

An image is `length` consecutive image tokens of the prompt, whose embeddings the vision
encoder's output replaces (`models.gemma3_mm.merge_images` defines it) and which see each
other (bidirectional attention, `ragged_plan.plan`'s extents). The attention mask
needs every token of an image in the pool when any of them attends: so a step computes an
image's tokens together (a prefix-cache hit may end inside an image: its cached tokens
were computed with the whole image, and the rest comes in one step), and a prompt chunk
ends before an image it cannot finish.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a prompt: its image tokens are positions [start, start + length)."""

    start: int
    length: int
    pixels: np.ndarray  # float32 [3, H, W]: `models.image.preprocess`d
    key: bytes  # a hash of the pixels: the prefix cache keys the image's blocks by it

    @property
    def end(self) -> int:
        return self.start + self.length


def pixel_key(pixels: np.ndarray) -> bytes:
    """The hash of an image's pixel values (vLLM's multimodal hash, over the preprocessed
    array: the same image at the same processing hashes alike)."""
    a = np.ascontiguousarray(pixels, np.float32)
    return hashlib.blake2b(repr(a.shape).encode() + a.tobytes(), digest_size=16).digest()


def spans(
    token_ids: Sequence[int], image_token_id: int, pixels: Sequence[np.ndarray]
) -> tuple[ImageSpan, ...]:
    """The images of a prompt: its runs of `image_token_id`, in order, one per pixel array
    (a run per image: `ValueError` if the counts differ)."""
    ids = np.asarray(token_ids)
    is_image = ids == image_token_id
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))
    if len(runs) != len(pixels):
        raise ValueError(f"the prompt has {len(runs)} images' tokens for {len(pixels)} images")
    return tuple(
        ImageSpan(s, e - s, np.asarray(p, np.float32), pixel_key(p))
        for (s, e), p in zip(runs, pixels, strict=True)
    )


@dataclasses.dataclass(frozen=True)
class RowImage:
    """The part of an image a row computes: its tokens `offset`, ... of the row are the
    image's soft tokens `first`, ... `first + count - 1`, through the image's last."""

    offset: int
    first: int
    count: int
    image: ImageSpan


def row_images(images: Sequence[ImageSpan], start: int, n: int) -> tuple[RowImage, ...]:
    """The images a row computing positions [start, start + n) covers; ValueError if it
    ends inside one (`fit_chunk` prevents it)."""
    out = []
    for im in images:
        lo, hi = max(im.start, start), min(im.end, start + n)
        if lo >= hi:
            continue
        if hi < im.end:
            raise ValueError(f"a step would split the image at positions {im.start}..{im.end}")
        out.append(RowImage(lo - start, lo - im.start, hi - lo, im))
    return tuple(out)


def fit_chunk(images: Sequence[ImageSpan], start: int, n: int) -> int:
    """The longest chunk from `start`, at most `n` tokens, that ends inside no image: cut
    before the image it would split (0 when it starts inside that image: it waits for a
    step with room for the image's rest)."""
    end = start + n
    for im in images:
        if im.start < end < im.end:
            return max(im.start - start, 0)
    return n
