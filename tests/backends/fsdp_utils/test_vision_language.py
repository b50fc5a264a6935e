"""The FSDP trainer on tiny random Qwen2.5-VL / Qwen3-VL checkpoints: log-probs of packed VL samples (text-only, one
image, two images of odd sizes in one row) equal transformers' own forward of each sample alone; the vision tower
trains, or stays frozen under --freeze-params-name-list."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from slime.backends.packing import pack_samples
from slime.utils.image_policy import load_vl_processor
from slime.utils.tiny_vl_model import build_tiny_vl_model
from tests.helpers.fsdp_helpers import make_args, make_trainer
from tests.helpers.vl_checkpoints import random_image


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_checkpoint(request, tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=1,
                               initializer_range=0.5)


def vl_train_data(checkpoint, seed: int = 0) -> dict:
    """Three samples: text only, one image, two images of odd sizes; random response tokens."""
    processor = load_vl_processor(checkpoint)
    rng = np.random.default_rng(seed)
    prompts = [("what is 3 + 4?", []),
               ("<|vision_start|><|image_pad|><|vision_end|>how many circles?", [random_image(45, 61, 1)]),
               ("<|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|> which "
                "colour?", [random_image(90, 37, 2), random_image(29, 100, 3)])]
    data = {key: [] for key in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward", "group_indices",
                                "sample_indices", "truncated", "multimodal_train_inputs")}
    for index, (text, images) in enumerate(prompts):
        encoded = processor.encode(text, images)
        response = rng.integers(3, 300, 6).tolist()
        data["tokens"].append(encoded.input_ids + response)
        data["response_lengths"].append(len(response))
        data["loss_masks"].append([1] * len(response))
        data["rewards"].append(float(index) - 1.0)
        data["raw_reward"].append(float(index) - 1.0)
        data["group_indices"].append(0)
        data["sample_indices"].append(index)
        data["truncated"].append(0)
        data["multimodal_train_inputs"].append(
            {"pixel_values": encoded.pixel_values, "image_grid_thw": encoded.image_grid_thw} if images else None)
    data.update(rollout_id=0, num_steps_per_rollout=1, global_batch_size=3)
    return data


def reference_log_probs(checkpoint, data: dict) -> list[torch.Tensor]:
    """transformers' own forward of each sample alone (mm_token_type_ids from the processor's rule)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float64).eval()
    image_token_id = model.config.image_token_id
    out = []
    for tokens, response_length, images in zip(data["tokens"], data["response_lengths"],
                                               data["multimodal_train_inputs"]):
        ids = torch.tensor(tokens)[None]
        kwargs = {} if images is None else {"pixel_values": images["pixel_values"].double(),
                                            "image_grid_thw": images["image_grid_thw"]}
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=(ids == image_token_id).int(), **kwargs).logits[0]
        log_probs = torch.log_softmax(logits[-response_length - 1:-1], dim=-1)
        out.append(log_probs.gather(1, ids[0, -response_length:, None])[:, 0].float())
    return out


def test_packed_vl_log_probs_equal_transformers_per_sample(vl_checkpoint):
    data = vl_train_data(vl_checkpoint)
    expected = reference_log_probs(vl_checkpoint, data)
    trainer = make_trainer(make_args(vl_checkpoint, "--micro-batch-size", "3"))
    try:
        packed = pack_samples(data["tokens"], data["response_lengths"], [0, 1, 2], data["multimodal_train_inputs"])
        assert packed.num_images == [0, 1, 2]
        with torch.no_grad():
            log_probs, _ = trainer.model.forward_micro_batch(packed)
        for actual, reference in zip(log_probs.split(data["response_lengths"]), expected):
            torch.testing.assert_close(actual, reference, rtol=0, atol=1e-4)
        assert torch.cat(expected).std() > 0.3  # wide weights: a wrong position or image would show
        # one sample per micro-batch gives the same numbers (nothing leaks between packed samples)
        alone = trainer.compute_log_probs([[pack_samples(data["tokens"], data["response_lengths"], [i],
                                                         data["multimodal_train_inputs"])] for i in range(3)])
        for i in range(3):
            torch.testing.assert_close(alone[i], expected[i], rtol=0, atol=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("freeze", [False, True])
def test_vision_tower_trains_or_stays_frozen(vl_checkpoint, freeze):
    data = vl_train_data(vl_checkpoint, seed=1)
    extra = ("--freeze-params-name-list", "visual") if freeze else ()
    trainer = make_trainer(make_args(vl_checkpoint, "--lr", "1e-2", "--micro-batch-size", "2", *extra))
    try:
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        metrics = trainer.train(0, data)
        assert np.isfinite(metrics["train/loss"])
        after = dict(trainer.model.named_parameters())
        changed = {name for name in before if not torch.equal(before[name], after[name].detach())}
        vision = {name for name in before if ".visual." in name}
        assert vision and any(".language_model." in name for name in changed)
        assert (changed & vision == set()) if freeze else (vision <= changed)
    finally:
        dist.destroy_process_group()


def test_image_token_mask_takes_each_images_run_and_leaves_sampled_pads_as_text():
    from slime.backends.fsdp_utils.vision_language import image_token_mask

    pad, start, end = 9, 7, 8
    # prompt: text, image 0 (4 tokens), text, image 1 (2 tokens); response: a sampled pad, a sampled start + pad
    ids = [1, start, pad, pad, pad, pad, end, 2, start, pad, pad, end, 3, pad, start, pad]
    mask = image_token_mask(ids, [4, 2], pad, start, "sample 0")
    assert [i for i, m in enumerate(mask) if m] == [2, 3, 4, 5, 9, 10]
    assert image_token_mask(ids, [], pad, start, "sample 0") == [False] * len(ids)  # a text sample's stray pads
    with pytest.raises(ValueError, match="sample 3: image 1 of 2 has no run of 3 image tokens"):
        image_token_mask(ids, [4, 3], pad, start, "sample 3")


def _two_rank_step(rank, world_size, port, checkpoint, data):
    from tests.helpers.fsdp_helpers import full_params, rank_slice

    trainer = make_trainer(make_args(checkpoint, "--lr", "1e-3", "--micro-batch-size", "1", world_size=world_size),
                           rank, world_size, port)
    schedule = trainer._schedule(rank_slice(data, rank, world_size))
    log_probs = trainer.compute_log_probs(schedule)
    metrics = trainer.train(0, rank_slice(data, rank, world_size))
    return log_probs, metrics["train/loss"], full_params(trainer)


def test_two_fsdp_processes_shard_the_vision_tower_and_match_one(tmp_path):
    """Vision blocks and decoder layers sharded over two gloo processes: the same log-probs as one process, and one
    step leaves the same weights (vision tower included)."""
    from tests.helpers.fsdp_helpers import run_distributed

    checkpoint = build_tiny_vl_model(tmp_path / "vl", arch="qwen3_vl", seed=2, initializer_range=0.5)
    data = vl_train_data(checkpoint, seed=2)
    data["tokens"].append(data["tokens"][1])  # an even count: one VL sample per rank at least
    for key in ("response_lengths", "loss_masks", "rewards", "raw_reward", "group_indices", "sample_indices",
                "truncated", "multimodal_train_inputs"):
        data[key].append(data[key][1])
    data["global_batch_size"] = 4
    [(one_log_probs, one_loss, one_params)] = run_distributed(_two_rank_step, 1, checkpoint, data)
    results = run_distributed(_two_rank_step, 2, checkpoint, data)
    for rank, (log_probs, loss, params) in enumerate(results):
        for local, global_index in enumerate(range(rank * 2, rank * 2 + 2)):
            torch.testing.assert_close(log_probs[local], one_log_probs[global_index], rtol=0, atol=1e-5)
        assert loss == pytest.approx(one_loss, rel=1e-5, abs=1e-6)  # the step's loss over both ranks
        assert any(".visual." in name for name in params)
        for name, value in params.items():
            torch.testing.assert_close(value, one_params[name], rtol=1e-4, atol=1e-6)
