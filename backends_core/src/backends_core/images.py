"""Images in token-in/token-out prompts: what an image part is, and proving the engine's expansion of it.

A vision-language chat template renders each image as **one** placeholder token (``<|image_pad|>`` on the Qwen-VL
family) and the engine's multimodal processor widens that token into as many as the vision encoder produces
(``grid_t * grid_h * grid_w / merge**2`` on Qwen-VL). The engines widen only the *first* remaining placeholder of
each image, so ids that are already widened would be widened again: prompts go on the wire **collapsed** (one
placeholder per image, images in prompt order) and the engine's answer says which ids it actually ran (its
expanded prompt and the span of each image). :func:`check_expansion` proves that answer against what was sent; a
backend that cannot report it must not accept images.

Multi-turn reuse keeps the expanded ids of earlier turns: a request may hold images whose span is already known
(``GenerateRequest.image_spans``, from the previous result) ahead of new, collapsed ones. :func:`collapse` turns
such ids into the wire form; the engine's answer must widen every known image to exactly its known span.

Image inputs accepted in message content parts (every one becomes an :class:`Image`: the encoded file's bytes):

* ``{"type": "image_url", "image_url": {"url": ...}}`` (OpenAI chat), ``{"type": "image_url", "image_url": "..."}``
  and ``{"type": "input_image", "image_url": "..."}`` (OpenAI Responses), with a ``data:`` URL (base64), a
  ``file:`` URL (read by the client) or an ``http(s):`` URL (handed to the engine, which fetches it; the URL is then
  the image's identity);
* ``{"type": "image", "image": ...}`` (Hugging Face processors' form) holding a PIL image, an ``HxWxC`` /
  ``HxW`` ``uint8`` numpy array (both encoded as PNG, which needs Pillow), or encoded bytes; or
  ``{"type": "image", "url": ...}`` / ``{"type": "image", "path": ...}``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import attrs

from backends_core.errors import InvalidRequestError, ResponseParseError

__all__ = [
    "IMAGE_PART_TYPES",
    "Image",
    "ImageSpan",
    "check_expansion",
    "collapse",
    "image_of_part",
    "image_of_url",
    "image_token_id",
    "json_default",
    "widen_position",
]

#: Content-part types that carry an image.
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def _sniff(data: bytes) -> str | None:
    """The media type of an encoded image from its first bytes, or ``None`` when it is not a known format."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


@attrs.frozen(kw_only=True)
class Image:
    """One image as it goes on the wire: an encoded file (``data``) or a remote ``url`` the engine fetches.

    Two images are equal when their bytes (or URLs) are: conversation histories compare by content, and a history
    whose image changed is a different conversation.

    :param data: the encoded image file (PNG, JPEG, GIF, BMP or WebP), or ``b""`` for a remote image.
    :param media_type: ``image/png``, ``image/jpeg``...
    :param url: the ``http(s)`` URL of a remote image (``None`` for bytes).
    """

    data: bytes = attrs.field(default=b"", repr=lambda b: f"<{len(b)} bytes>")
    media_type: str = "image/png"
    url: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.url is None) == (not self.data):
            raise InvalidRequestError("an Image holds either encoded bytes or an http(s) url")

    @classmethod
    def of(cls, value: Any) -> Image:
        """The image of a PIL image, a ``uint8`` array, encoded bytes or a ``data:`` / ``file:`` / ``http(s):`` URL.

        :raises InvalidRequestError: ``value`` is none of those, or cannot be read.
        """
        image = image_of_part({"type": "image", "image": value}, "image")
        assert image is not None
        return image

    @functools.cached_property
    def sha256(self) -> str:
        """Hex digest of the bytes (of the URL for a remote image): the image's identity."""
        return hashlib.sha256(self.data if self.url is None else self.url.encode()).hexdigest()

    def data_url(self) -> str:
        """The image as a URL an engine takes: ``data:<type>;base64,...`` (the remote URL itself if remote)."""
        if self.url is not None:
            return self.url
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode('ascii')}"

    def identity(self, salt: str | None = None) -> str:
        """The key an engine caches this image's vision features under: the digest, ``@salt`` appended when given.

        Engines key their encoder caches by this identity alone, so features computed under old weights would be
        served after a weight update: salting with the weight version gives each version its own entries.
        """
        return self.sha256 if not salt else f"{self.sha256}@{salt}"


@attrs.frozen
class ImageSpan:
    """Where one image's placeholder run lies in a token sequence: ids ``start`` to ``end`` (exclusive)."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def _from_bytes(data: bytes, where: str) -> Image:
    kind = _sniff(data)
    if kind is None:
        raise InvalidRequestError(
            f"{where} is not an encoded image this client recognises (PNG, JPEG, GIF, BMP, WebP): it starts with "
            f"{data[:8]!r}"
        )
    return Image(data=data, media_type=kind)


def _from_data_url(url: str, where: str) -> Image:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequestError(f"{where} is a data: URL that is not base64 (data:<type>;base64,<bytes>)")
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise InvalidRequestError(f"{where} is a data: URL whose base64 does not decode: {exc}") from exc
    image = _from_bytes(data, where)
    declared = header[: -len(";base64")]
    if declared and declared != image.media_type:
        raise InvalidRequestError(f"{where} says {declared!r} but holds {image.media_type!r} bytes")
    return image


def _from_path(path: Path, where: str) -> Image:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"{where}: cannot read image file {str(path)!r}: {exc}") from exc
    return _from_bytes(data, where)


def _from_url(url: Any, where: str) -> Image:
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{where} needs an image URL string, got {url!r}")
    if url.startswith("data:"):
        return _from_data_url(url, where)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return _from_path(Path(unquote(parsed.path)), where)
    if parsed.scheme in ("http", "https") and parsed.netloc:
        return Image(url=url)
    raise InvalidRequestError(f"{where} has an image URL that is not data:, file: or http(s): {url[:80]!r}")


def image_of_url(url: Any, where: str) -> Image:
    """The image an image URL names: a base64 ``data:`` URL, a ``file:`` URL (read here) or an ``http(s)`` URL
    (kept as the URL, which the engine fetches).

    :raises InvalidRequestError: not such a URL, or its image cannot be read, naming ``where``.
    """
    return _from_url(url, where)


def _encode_png(obj: Any, where: str) -> Image:
    try:
        import PIL.Image
    except ImportError as exc:
        raise InvalidRequestError(
            f"{where} holds a {type(obj).__name__}: encoding it as PNG needs Pillow (pip install pillow)"
        ) from exc
    if not isinstance(obj, PIL.Image.Image):
        import numpy as np

        array = np.asarray(obj)
        if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
            raise InvalidRequestError(
                f"{where} holds an array of dtype {array.dtype} and shape {array.shape}: an image array must be "
                "uint8, HxW or HxWxC with C in 1, 3, 4"
            )
        obj = PIL.Image.fromarray(array[:, :, 0] if array.ndim == 3 and array.shape[2] == 1 else array)
    buffer = io.BytesIO()
    obj.save(buffer, format="PNG")
    return Image(data=buffer.getvalue(), media_type="image/png")


def image_of_part(part: Mapping[str, Any], where: str) -> Image | None:
    """The image a content part carries, or ``None`` when its type is not an image type.

    :raises InvalidRequestError: an image part that is malformed or whose image cannot be read, naming ``where``.
    """
    kind = part.get("type")
    if kind not in IMAGE_PART_TYPES:
        return None
    if kind == "image":
        if part.get("image") is not None:
            value = part["image"]
            if isinstance(value, str):
                return _from_url(value, f"{where}.image")
            if isinstance(value, bytes | bytearray | memoryview):
                return _from_bytes(bytes(value), f"{where}.image")
            if isinstance(value, Image):
                return value
            if hasattr(value, "__array_interface__") or hasattr(value, "save"):
                return _encode_png(value, f"{where}.image")
            raise InvalidRequestError(
                f"{where}.image is a {type(value).__name__}: give a PIL image, a uint8 numpy array, encoded bytes "
                "or a URL"
            )
        if part.get("url") is not None:
            return _from_url(part["url"], f"{where}.url")
        if part.get("path") is not None:
            return _from_path(Path(str(part["path"])), f"{where}.path")
        raise InvalidRequestError(f"{where} is an image part with none of 'image', 'url', 'path'")
    value = part.get("image_url")
    if isinstance(value, Mapping):
        return _from_url(value.get("url"), f"{where}.image_url.url")
    return _from_url(value, f"{where}.image_url")


def json_default(value: Any) -> Any:
    """``orjson``'s ``default=`` for data holding images (normal-form messages): an :class:`Image` becomes its URL,
    which :func:`image_of_part` reads back as the same image.

    :raises TypeError: any other type, as ``orjson`` expects.
    """
    if isinstance(value, Image):
        return value.data_url()
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


@functools.lru_cache(maxsize=16)
def _config_image_token(directory: str) -> int | None:
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for key in ("image_token_id", "image_token_index"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def image_token_id(tokenizer_path: str) -> int | None:
    """The model's image placeholder id from ``config.json`` beside its tokenizer (``image_token_id``, or
    ``image_token_index`` in the LLaVA family), or ``None`` when the model declares none (it takes no images)."""
    return _config_image_token(tokenizer_path)


def collapse(ids: Sequence[int], spans: Sequence[ImageSpan]) -> tuple[int, ...]:
    """``ids`` with each span (sorted, non-overlapping) reduced to its first id: the form an engine widens."""
    out: list[int] = []
    at = 0
    for span in spans:
        out.extend(ids[at : span.start + 1])
        at = span.end
    out.extend(ids[at:])
    return tuple(out)


def widen_position(position: int, spans: Sequence[ImageSpan]) -> int:
    """Where a boundary ``position`` of ids holding each of ``spans``' images as one placeholder lies once the
    engine widened them (``spans`` are the widened spans, in order): shifted past every placeholder before it."""
    shift = 0
    for span in spans:
        if span.start - shift >= position:
            break
        shift += span.length - 1
    return position + shift


def check_expansion(
    sent: Sequence[int],
    known: Sequence[ImageSpan],
    answered: Sequence[int],
    spans: Sequence[ImageSpan],
    *,
    images: int,
    where: str,
    server_url: str,
) -> None:
    """Prove an engine ran ``sent`` with each image placeholder widened once, and nothing else changed.

    :param sent: the ids as the client holds them (known images widened, new images one placeholder each).
    :param known: the spans of the images already widened in ``sent`` (they come first).
    :param answered: the prompt ids the engine reports having run.
    :param spans: the engine's span of each image, in prompt order.
    :param images: how many images were sent.
    :raises ResponseParseError: the answer is not ``sent`` with exactly the images widened (naming the first
        difference), or a known image was widened to a different span.
    """
    if len(spans) != images:
        raise ResponseParseError(f"{where}: the engine placed {len(spans)} images, {images} were sent", url=server_url)
    previous = 0
    for k, span in enumerate(spans):
        if not previous <= span.start < span.end <= len(answered):
            raise ResponseParseError(
                f"{where}: image {k}'s span [{span.start}, {span.end}) is out of order or outside the "
                f"{len(answered)} prompt ids",
                url=server_url,
            )
        run = set(answered[span.start : span.end])
        if len(run) != 1:
            raise ResponseParseError(
                f"{where}: image {k}'s span [{span.start}, {span.end}) holds different ids {sorted(run)[:4]}",
                url=server_url,
            )
        previous = span.end
    for k, (mine, theirs) in enumerate(zip(known, spans, strict=False)):
        if mine != theirs:
            raise ResponseParseError(
                f"{where}: image {k} was widened to [{theirs.start}, {theirs.end}), but the ids being extended hold "
                f"it at [{mine.start}, {mine.end}): the engine processed the image into different ids",
                url=server_url,
            )
    wire = collapse(sent, known)
    ran = collapse(answered, spans)
    if ran != wire:
        first = next((i for i, (a, b) in enumerate(zip(ran, wire, strict=False)) if a != b), min(len(ran), len(wire)))
        raise ResponseParseError(
            f"{where}: the engine ran a different prompt than was sent: with each image collapsed to one placeholder "
            f"they first differ at id {first} (sent {wire[first : first + 4]}, ran {ran[first : first + 4]}; "
            f"{len(wire)} vs {len(ran)} ids)",
            url=server_url,
        )
