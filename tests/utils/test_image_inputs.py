"""Image references decode to the same RGB pixels whatever form they come in, and bad ones are named."""

import base64
import io

import numpy as np
import pytest

from slime.utils.image_inputs import ImageInputError, image_content_key, image_to_data_uri, load_image
from tests.helpers.vl_checkpoints import random_image


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_reference_form_gives_the_same_pixels(tmp_path):
    image = random_image(13, 29, seed=1)
    path = tmp_path / "a b.png"
    path.write_bytes(_png_bytes(image))
    raw_b64 = base64.b64encode(_png_bytes(image)).decode()
    forms = [image, str(path), path.as_uri(), "data:image/png;base64," + raw_b64, raw_b64, _png_bytes(image),
             {"type": "image", "image": str(path)}, image_to_data_uri(image)]
    expected = np.asarray(image)
    for form in forms:
        decoded = load_image(form)
        assert decoded.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(decoded), expected)


def test_content_key_follows_pixels_not_encoding(tmp_path):
    image = random_image(16, 16, seed=2)
    path = tmp_path / "x.png"
    path.write_bytes(_png_bytes(image))
    assert image_content_key(image) == image_content_key(str(path)) == image_content_key(image_to_data_uri(image))
    changed = np.asarray(image).copy()
    changed[3, 5, 1] ^= 1
    from PIL import Image

    assert image_content_key(Image.fromarray(changed)) != image_content_key(image)
    # same bytes, other shape: a different image
    assert image_content_key(image.resize((8, 32))) != image_content_key(image)


def test_rgba_and_grayscale_become_rgb():
    from PIL import Image

    gray = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), mode="L")
    assert load_image(gray).mode == "RGB"
    assert load_image(_png_bytes(gray.convert("RGBA"))).mode == "RGB"


@pytest.mark.parametrize("reference, words", [
    ("/no/such/image.png", "neither an existing file nor valid base64"),
    ("file:///no/such/image.png", "does not exist"),
    ("https://example.com/cat.png", "remote"),
    ("data:image/png;base64,@@@", "invalid base64"),
    ("data:image/png,rawtext", "not base64-encoded"),
    (base64.b64encode(b"not an image at all").decode(), "not a readable image"),
    (12, "must be a path"),
    ({"type": "image"}, "no 'image' field"),
])
def test_bad_references_are_refused_by_name(reference, words):
    with pytest.raises(ImageInputError, match=words):
        load_image(reference)
