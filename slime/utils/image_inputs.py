"""Decode an image reference into an RGB PIL image, and encode an image for a `/generate` request.

A reference is what a data row, a Sample or SGLang's `image_data` carries: a file path, a `file://` URL, a
`data:image/...;base64,` URI, bare base64, or an already decoded PIL image. Every side (rollout, engine, trainer)
decodes through `load_image`, so the pixels the engine sees are the pixels the trainer sees; `image_to_data_uri`
encodes losslessly (PNG) for the same reason. `image_content_key` is the content hash the engine's prefix cache uses.

Not here: resizing and image-token counts (image_policy.py owns them), remote URLs (no network is assumed: an
`http(s)://` reference is refused by name).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path
from urllib.parse import unquote, urlparse


class ImageInputError(ValueError):
    """An image reference that cannot be decoded; the message names the reference (shortened) and why."""


def _short(reference: str, limit: int = 80) -> str:
    return reference if len(reference) <= limit else reference[:limit] + f"... ({len(reference)} chars)"


def _open_bytes(data: bytes, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ImageInputError(f"{what} is not a readable image ({error})") from error
    return image.convert("RGB")


def load_image(reference):
    """The RGB PIL image a reference names. Raises ImageInputError naming the reference when it is missing,
    remote, not base64 or not an image."""
    from PIL import Image

    if isinstance(reference, Image.Image):
        return reference.convert("RGB")
    if isinstance(reference, dict):  # Qwen's rich form {"type": "image", "image": ref, ...}
        if "image" not in reference:
            raise ImageInputError(f"image item {reference!r} has no 'image' field")
        return load_image(reference["image"])
    if isinstance(reference, (bytes, bytearray)):
        return _open_bytes(bytes(reference), "image bytes")
    if not isinstance(reference, str):
        raise ImageInputError(f"an image reference must be a path, file URL, base64 string or PIL image, "
                              f"got {type(reference).__name__}")
    if reference.startswith("data:"):
        header, _, payload = reference.partition(",")
        if ";base64" not in header:
            raise ImageInputError(f"data URI {_short(reference)!r} is not base64-encoded")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ImageInputError(f"data URI {_short(reference)!r} has invalid base64") from error
        return _open_bytes(data, f"data URI {_short(reference)!r}")
    scheme = urlparse(reference).scheme
    if scheme in ("http", "https"):
        raise ImageInputError(f"image URL {_short(reference)!r} is remote; pass a local path, a file:// URL or "
                              f"base64 (nothing here downloads)")
    if scheme == "file":
        path = Path(unquote(urlparse(reference).path))
        if not path.is_file():
            raise ImageInputError(f"image file {str(path)!r} (from {reference!r}) does not exist")
        return _open_bytes(path.read_bytes(), f"image file {str(path)!r}")
    if len(reference) <= _MAX_PATH_CHARS and Path(reference).is_file():
        return _open_bytes(Path(reference).read_bytes(), f"image file {reference!r}")
    try:
        data = base64.b64decode(reference, validate=True)
    except (binascii.Error, ValueError) as error:
        # JPEG's base64 starts with '/', so only a failed decode tells a missing file from bad base64
        raise ImageInputError(f"image reference {_short(reference)!r} is neither an existing file nor valid "
                              f"base64") from error
    return _open_bytes(data, f"base64 image {_short(reference)!r}")


_MAX_PATH_CHARS = 4096


def image_to_data_uri(image) -> str:
    """A lossless `data:image/png;base64,` URI of an image (any reference load_image accepts)."""
    buffer = io.BytesIO()
    load_image(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_content_key(image) -> str:
    """A hash of an RGB image's size and pixels: equal for equal content, whatever the encoding it came in."""
    image = load_image(image)
    digest = hashlib.sha256(f"{image.width}x{image.height}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
