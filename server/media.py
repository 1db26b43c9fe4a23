"""Images in requests: OpenAI's `image_url` parts (chat) and `input_image` parts (Responses)
read into PIL images, each refusal a 400 naming the part.

An image is a `data:` URL (base64 PNG, JPEG or WebP), or an `http(s)` URL whose host
`--allowed-media-domains` lists (vLLM's flag; none by default, so the server fetches
nothing unless told). `--limit-mm-per-prompt` (vLLM's) bounds the images of a request and
`--max-image-bytes` the encoded size of each; Pillow decodes them (its decompression-bomb
check on, at `MAX_PIXELS`), and the engine preprocesses them as the checkpoint's processor
config says (`models.image`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import urllib.parse
import urllib.request
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from server.errors import APIError

if TYPE_CHECKING:  # Pillow is imported where an image is met (0.1 s of a server's start)
    from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP")
MIME = {"image/png", "image/jpeg", "image/jpg", "image/webp"}
MAX_PIXELS = 64 * 1024 * 1024  # larger images are refused before Pillow decodes them
FETCH_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class MediaOptions:
    allowed_domains: tuple[str, ...] = ()  # --allowed-media-domains: hosts to fetch from
    max_images: int = 4  # --limit-mm-per-prompt '{"image": N}'
    max_image_bytes: int = 16 * 1024 * 1024  # --max-image-bytes: encoded, per image


def read_images(
    parts: Sequence[tuple[str, str]], options: MediaOptions, param: str
) -> list[Image.Image]:
    """The images of a request's `(field, url)` parts, in order; an APIError (400, its
    `param` the request's field: "messages", "input") naming the part at fault."""
    if len(parts) > options.max_images:
        field = parts[options.max_images][0]
        raise APIError(
            400,
            f"{field}: more than {options.max_images} images in one request "
            "(--limit-mm-per-prompt)",
            param,
        )
    return [_read(field, url, options, param) for field, url in parts]


def _read(field: str, url: Any, options: MediaOptions, param: str) -> Image.Image:
    from PIL import Image

    def refuse(message: str) -> APIError:
        return APIError(400, f"{field}: {message}", param)

    if not isinstance(url, str) or not url:
        raise refuse("an image URL is a non-empty string")
    if url.startswith("data:"):
        data = _data_url(url, options, refuse)
    else:
        data = _fetch(url, options, refuse)
    if len(data) > options.max_image_bytes:
        raise refuse(f"the image exceeds {options.max_image_bytes} bytes (--max-image-bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            if image.width * image.height > MAX_PIXELS:
                raise refuse(
                    f"the image is {image.width}x{image.height}, more than {MAX_PIXELS} pixels"
                )
            image.load()
    except APIError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise refuse("the image is too large to decode") from None
    except Exception:  # not an image Pillow reads (or a truncated one)
        raise refuse("not a PNG, JPEG or WebP image") from None
    return image


def _data_url(url: str, options: MediaOptions, refuse: Any) -> bytes:
    head, comma, payload = url.partition(",")
    kind = head[len("data:") :].split(";")
    if not comma or kind[-1] != "base64":
        raise refuse("a data URL must be base64 (data:image/png;base64,...)")
    if kind[0].lower() not in MIME:
        raise refuse(f"unsupported media type {kind[0][:40]!r} (PNG, JPEG or WebP)")
    if len(payload) > 4 * (options.max_image_bytes // 3 + 1):
        raise refuse(f"the image exceeds {options.max_image_bytes} bytes (--max-image-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise refuse("the data URL is not valid base64") from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _fetch(url: str, options: MediaOptions, refuse: Any) -> bytes:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise refuse("an image URL is a data: URL or an http(s) URL")
    host = (parsed.hostname or "").lower()
    if host not in options.allowed_domains:
        raise refuse(
            f"remote images from {host[:100]!r} are not allowed (the server's "
            "--allowed-media-domains lists the hosts it fetches from)"
        )
    try:  # (no redirects: they could lead to a host the list does not name)
        with _OPENER.open(url, timeout=FETCH_TIMEOUT_S) as reply:
            data = reply.read(options.max_image_bytes + 1)
    except Exception as exc:
        raise refuse(f"fetching the image failed: {type(exc).__name__}") from None
    return data
