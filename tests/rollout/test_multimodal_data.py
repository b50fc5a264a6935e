"""--multimodal-keys rows -> Samples with images: paths, file URLs and base64 in JSONL and Parquet; the rendered
prompt's image tokens equal the processor's count; the train data carries pixel values and grids; a missing or corrupt
image, or placeholders that do not match the images, is an error naming the file and the row."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import numpy as np
import pytest
from PIL import Image

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError
from slime.ray.train_data import samples_to_train_data
from slime.rollout.dataset import PromptFormat, load_processor, load_prompt_samples, load_tokenizer
from slime.rollout.generate_request import encode_multimodal_prompt, image_data_request
from slime.utils.image_policy import image_token_counts
from slime.utils.tiny_model import build_tiny_model
from slime.utils.tiny_vl_model import build_tiny_vl_model

FORMAT = PromptFormat(input_key="problem", label_key="answer", apply_chat_template=True,
                      multimodal_keys={"image": "images"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("vl"), arch="qwen2_5_vl")


def _png(path, width: int, height: int, seed: int) -> Image.Image:
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
    image.save(path)
    return image


def _base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rows_with_paths_file_urls_and_base64_render_and_encode(checkpoint, tmp_path):
    a = _png(tmp_path / "a.png", 57, 31, 1)
    b = _png(tmp_path / "b.png", 40, 83, 2)
    rows = [{"problem": "<image>How many circles?", "answer": "3", "images": [str(tmp_path / "a.png")]},
            {"problem": "Compare <image> with <image>.", "answer": "left",
             "images": [f"file://{tmp_path / 'b.png'}", "data:image/png;base64," + _base64(a)]},
            {"problem": "Colour?", "answer": "red", "images": _base64(b)},  # one item, no placeholder: before the text
            {"problem": "No picture: 2 + 2?", "answer": "4", "images": []}]
    samples, _ = load_prompt_samples(_write_jsonl(tmp_path / "d.jsonl", rows), FORMAT, load_tokenizer(checkpoint))
    processor = load_processor(str(checkpoint))
    assert [len((s.multimodal_inputs or {}).get("images", [])) for s in samples] == [1, 2, 1, 0]
    assert np.array_equal(np.asarray(samples[1].multimodal_inputs["images"][1]), np.asarray(a))
    assert np.array_equal(np.asarray(samples[2].multimodal_inputs["images"][0]), np.asarray(b))
    assert samples[1].prompt.index("Compare") < samples[1].prompt.index("<|image_pad|>")  # placeholder order kept
    assert samples[2].prompt.index("<|image_pad|>") < samples[2].prompt.index("Colour?")
    assert samples[3].multimodal_inputs is None and "<|image_pad|>" not in samples[3].prompt
    args = parse_args(["--hf-checkpoint", str(checkpoint), "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", "math",
                       "--apply-chat-template", "--multimodal-keys", '{"image": "images"}'])
    for sample in samples[:3]:
        encode_multimodal_prompt(args, sample)
        images = sample.multimodal_inputs["images"]
        grids = sample.multimodal_train_inputs["image_grid_thw"]
        assert grids.tolist() == [list(processor.image_grid(image)) for image in images]
        assert sample.tokens.count(processor.image_token_id) == sum(image_token_counts(grids, processor.merge_size))
        assert sample.multimodal_train_inputs["pixel_values"].shape[0] == int(grids.prod(-1).sum())
        request = image_data_request(sample)["image_data"]
        assert len(request) == len(images) and all(uri.startswith("data:image/png;base64,") for uri in request)
    # the train data carries each sample's pixels and grids (None for the text-only one)
    samples[3].tokens = load_tokenizer(checkpoint)(samples[3].prompt)["input_ids"]
    for sample in samples:
        sample.tokens, sample.response_length, sample.reward = sample.tokens + [5, 6], 2, 1.0
    data = samples_to_train_data(args, samples)
    assert [x is None for x in data["multimodal_train_inputs"]] == [False, False, False, True]


def test_parquet_rows_load(checkpoint, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _png(tmp_path / "p.png", 30, 30, 4)
    pq.write_table(pa.Table.from_pylist([{"problem": "<image>shape?", "answer": "circle",
                                          "images": [str(tmp_path / "p.png")]}]), tmp_path / "d.parquet")
    samples, _ = load_prompt_samples(str(tmp_path / "d.parquet"), FORMAT, load_tokenizer(checkpoint))
    assert samples[0].multimodal_inputs["images"][0].size == (30, 30)


@pytest.mark.parametrize("images, problem, message", [
    (["missing.png"], "<image>x", r"d.jsonl:2: column 'images' item 0: .*missing.png"),
    (["CORRUPT"], "<image>x", r"d.jsonl:2: column 'images' item 0: image file .*bad.png.* not a readable image"),
    (["ok.png"], "<image><image>x", r"d.jsonl:2: the prompt has more <image> placeholders than the 1 image"),
    (["ok.png", "ok.png"], "<image>x", r"d.jsonl:2: the prompt has 1 <image> placeholder\(s\) but its row has 2"),
])
def test_bad_images_name_the_file_and_row(checkpoint, tmp_path, images, problem, message):
    _png(tmp_path / "ok.png", 20, 20, 5)
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    paths = [str(tmp_path / ("bad.png" if item == "CORRUPT" else item)) for item in images]
    rows = [{"problem": "<image>fine", "answer": "1", "images": [str(tmp_path / "ok.png")]},
            {"problem": problem, "answer": "1", "images": paths}]
    with pytest.raises(ValueError, match=message):
        load_prompt_samples(_write_jsonl(tmp_path / "d.jsonl", rows), FORMAT, load_tokenizer(checkpoint))


def test_start_up_refuses_what_vl_training_cannot_cover(checkpoint, tmp_path):
    base = ["--hf-checkpoint", str(checkpoint), "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", "math",
            "--apply-chat-template"]
    with pytest.raises(ArgumentError, match="--train-backend megatron: vision-language models"):
        parse_args(base + ["--train-backend", "megatron"])
    with pytest.raises(ArgumentError, match="--advantage-estimator ppo: the PPO critic does not take images"):
        parse_args(base + ["--advantage-estimator", "ppo"])
    text_checkpoint = build_tiny_model(tmp_path / "text", arch="qwen3")
    with pytest.raises(ArgumentError, match="--multimodal-keys needs a vision-language --hf-checkpoint"):
        parse_args(["--hf-checkpoint", str(text_checkpoint), "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", "math",
                    "--apply-chat-template", "--multimodal-keys", '{"image": "images"}'])


def test_a_buffered_vl_sample_round_trips_through_the_saved_state(checkpoint, tmp_path):
    """Partial rollout: a half-generated VL sample in the data source's buffer survives save / load (JSON) and its
    train inputs are derived again, equal to the first ones."""
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    _png(tmp_path / "a.png", 45, 33, 6)
    rows = [{"problem": "<image>How many?", "answer": "2", "images": [str(tmp_path / "a.png")]}]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    args = parse_args(["--hf-checkpoint", str(checkpoint), "--prompt-data", data, "--input-key", "problem",
                       "--label-key", "answer", "--rollout-batch-size", "1", "--n-samples-per-prompt", "1",
                       "--num-rollout", "1", "--rm-type", "math", "--apply-chat-template",
                       "--multimodal-keys", '{"image": "images"}', "--save", str(tmp_path / "save")])
    source = RolloutDataSourceWithBuffer(args)
    [[sample]] = source.get_samples(1)
    encode_multimodal_prompt(args, sample)
    first = sample.multimodal_train_inputs
    sample.tokens, sample.response_length, sample.loss_mask = sample.tokens + [7, 8], 2, [1, 1]
    source.add_samples([[sample]])
    source.save(0)
    restored = RolloutDataSourceWithBuffer(args)
    assert restored.load(0)
    [[again]] = restored.get_samples(1)
    assert again.tokens == sample.tokens and again.multimodal_train_inputs is None
    assert np.array_equal(np.asarray(again.multimodal_inputs["images"][0]),
                          np.asarray(sample.multimodal_inputs["images"][0]))
    encode_multimodal_prompt(args, again)  # what the rollout does before continuing it
    assert again.tokens == sample.tokens
    assert np.array_equal(again.multimodal_train_inputs["pixel_values"].numpy(), first["pixel_values"].numpy())
    again.tokens = [again.tokens[0] + 1] + again.tokens[1:]
    with pytest.raises(ValueError, match="do not start with its prompt encoded with its images"):
        encode_multimodal_prompt(args, again)


def test_max_prompt_len_counts_image_tokens(checkpoint, tmp_path):
    """A short question with a large image is long: --rollout-max-prompt-len counts the expanded image tokens."""
    _png(tmp_path / "small.png", 28, 28, 7)
    _png(tmp_path / "large.png", 200, 150, 8)
    rows = [{"problem": "<image>a?", "answer": "1", "images": [str(tmp_path / "small.png")]},
            {"problem": "<image>a?", "answer": "1", "images": [str(tmp_path / "large.png")]}]
    spec = _write_jsonl(tmp_path / "d.jsonl", rows)
    tokenizer = load_tokenizer(checkpoint)
    processor = load_processor(str(checkpoint))
    samples, _ = load_prompt_samples(spec, FORMAT, tokenizer)
    lengths = [len(processor.encode(s.prompt, s.multimodal_inputs["images"]).input_ids) for s in samples]
    text_lengths = [len(tokenizer(s.prompt)["input_ids"]) for s in samples]
    assert text_lengths[0] == text_lengths[1] and lengths[1] > lengths[0] + 10
    kept, num_filtered = load_prompt_samples(spec, dataclasses.replace(FORMAT, max_prompt_len=lengths[0]), tokenizer)
    assert num_filtered == 1 and kept[0].multimodal_inputs["images"][0].size == (28, 28)
