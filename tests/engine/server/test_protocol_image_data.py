"""SGLang's image_data in /generate bodies: one reference or a list per prompt, a list per prompt in a batch,
copied to every parallel sample; malformed shapes are RequestErrors naming the field."""

import pytest

from slime.engine.server.protocol import RequestError, parse_generate_request


def parse(body):
    return parse_generate_request(body, lambda text: [5] * len(text), vocab_size=100, max_model_len=64)


def test_single_prompt_forms():
    assert parse({"input_ids": [1, 2], "image_data": "a.png"}).items[0].images == ["a.png"]
    assert parse({"input_ids": [1, 2], "image_data": ["a.png", "b.png"]}).items[0].images == ["a.png", "b.png"]
    assert parse({"input_ids": [1, 2]}).items[0].images is None
    assert parse({"input_ids": [1, 2], "image_data": []}).items[0].images is None


def test_batch_and_parallel_samples():
    request = parse({"input_ids": [[1], [2]], "image_data": [["a.png"], None]})
    assert [item.images for item in request.items] == [["a.png"], None]
    request = parse({"input_ids": [1, 2], "image_data": "a.png", "sampling_params": {"n": 3}})
    assert [item.images for item in request.items] == [["a.png"]] * 3


@pytest.mark.parametrize("body, words", [
    ({"input_ids": [[1], [2]], "image_data": ["a.png"]}, "one entry per prompt"),
    ({"input_ids": [1], "image_data": [{"url": "a.png"}]}, "must be strings"),
    ({"input_ids": [1], "image_data": 7}, "must be strings"),
])
def test_malformed_image_data(body, words):
    with pytest.raises(RequestError, match=words):
        parse(body)
