"""The engine serving tiny random Qwen2.5-VL / Qwen3-VL (fp32, CPU): its sampled tokens' log-probs equal
transformers' on prompts with one and two images, through chunked prefill and decode; a second request with the
same image hits the prefix cache and one with a changed image misses it, both still exact."""

import pytest
import torch

from slime.engine.engine import Engine
from slime.engine.memory_tags import EngineWeightsMissingError
from slime.utils.image_policy import IMAGE_PLACEHOLDER, load_vl_processor
from tests.helpers.vl_checkpoints import hf_log_probs, random_image, tiny_vl_checkpoint

ARCHES = ["qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module", params=ARCHES)
def checkpoint(request, tmp_path_factory):
    return tiny_vl_checkpoint(request.param, tmp_path_factory.mktemp("vl"))


def _prompt(processor, num_images):
    text = "<|im_start|>user\n" + " then ".join([IMAGE_PLACEHOLDER] * num_images) + "count<|im_end|>\n"
    return processor.tokenizer(text + "<|im_start|>assistant\n")["input_ids"]


def _run(engine, token_ids, images, max_new_tokens=6):
    rid = engine.add_request(token_ids, {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                                         "sampling_seed": 7}, images=images, incremental=False)
    while True:
        for output in engine.step():
            if output.rid == rid and output.finished:
                return engine, output


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.mark.parametrize("num_images", [1, 2])
def test_log_probs_match_transformers(checkpoint, hf_model, num_images):
    processor = load_vl_processor(checkpoint)
    images = [random_image(61, 97, seed=1), random_image(45, 130, seed=2)][:num_images]
    token_ids = _prompt(processor, num_images)
    # chunks of 16 tokens: images split over several prefill steps
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=256,
                    max_num_batched_tokens=16)
    _, output = _run(engine, token_ids, images)
    # the prompt as the processor expands it (the engine's content ids stay inside)
    assert output.prompt_token_ids == processor.expand_input_ids(token_ids, images).input_ids
    expected = hf_log_probs(hf_model, processor, token_ids, images, output.output_token_ids)
    got = torch.tensor(output.output_log_probs, dtype=torch.float32)
    assert (got - expected).abs().max() < 1e-4, (got, expected)


def test_prefix_cache_hits_on_the_same_image_and_misses_on_a_changed_one(checkpoint, hf_model):
    processor = load_vl_processor(checkpoint)
    token_ids = _prompt(processor, 1)
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=256)
    image = random_image(61, 97, seed=1)
    _, first = _run(engine, token_ids, [image])
    _, again = _run(engine, token_ids, [image.copy()])
    changed = random_image(61, 97, seed=3)  # same size, same token count, other pixels
    _, other = _run(engine, token_ids, [changed])
    num_prompt = len(processor.expand_input_ids(token_ids, [image]).input_ids)
    seqs_cached = [out.num_cached_tokens for out in (first, again, other)]
    assert seqs_cached[0] == 0
    assert seqs_cached[1] >= (num_prompt - 1) // 4 * 4 > 0  # every full block of the prompt
    image_start = token_ids.index(processor.image_token_id)
    assert seqs_cached[2] <= image_start  # only the text before the image
    for out, img in ((again, image), (other, changed)):
        expected = hf_log_probs(hf_model, processor, token_ids, [img], out.output_token_ids)
        got = torch.tensor(out.output_log_probs, dtype=torch.float32)
        assert (got - expected).abs().max() < 1e-4


def test_unsupported_vl_configurations_are_refused_by_flag(checkpoint):
    with pytest.raises(ValueError, match="--tp-size 2"):
        Engine(str(checkpoint), device="cpu", tp_size=2)
    with pytest.raises(ValueError, match="enable_lora"):
        Engine(str(checkpoint), device="cpu", enable_lora=True, max_lora_rank=8)


def test_text_model_refuses_images(tiny_qwen3):
    engine = Engine(str(tiny_qwen3), device="cpu", num_kvcache_blocks=64)
    with pytest.raises(ValueError, match="not a vision-language model"):
        engine.add_request([1, 2, 3], {"max_new_tokens": 2}, images=[random_image(30, 30)])


def test_batched_images_and_text_in_one_batch(checkpoint, hf_model):
    """Two image requests (one vision-encoder call over both) and a text request stepped together, each exact."""
    processor = load_vl_processor(checkpoint)
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=256)
    params = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 11}
    requests = [(_prompt(processor, 2), [random_image(61, 97, seed=5), random_image(33, 200, seed=6)]),
                (_prompt(processor, 1), [random_image(100, 100, seed=7)]),
                (processor.tokenizer("<|im_start|>user\nhello<|im_end|>\n")["input_ids"], [])]
    rids = [engine.add_request(ids, params, images=images, incremental=False) for ids, images in requests]
    finished = {}
    while len(finished) < len(rids):
        finished.update({o.rid: o for o in engine.step() if o.finished})
    for rid, (ids, images) in zip(rids, requests):
        output = finished[rid]
        expected = hf_log_probs(hf_model, processor, ids, images, output.output_token_ids)
        assert (torch.tensor(output.output_log_probs) - expected).abs().max() < 1e-4


def test_preempted_image_requests_recompute_exactly(checkpoint, hf_model):
    """A KV pool too small for all requests: preempted VL sequences are prefilled again (their images encoded again)
    and still give transformers' log-probs."""
    processor = load_vl_processor(checkpoint)
    ids = _prompt(processor, 1)
    images = [random_image(61, 97, seed=20 + i) for i in range(3)]
    num_prompt = len(processor.expand_input_ids(ids, images[:1]).input_ids)
    block_size, max_new_tokens = 4, 12
    # room for two sequences at full length, not three
    num_blocks = 2 * -(-(num_prompt + max_new_tokens) // block_size) + 1
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", kvcache_block_size=block_size,
                    num_kvcache_blocks=num_blocks)
    params = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, "sampling_seed": 5}
    rids = [engine.add_request(ids, params, images=[image], incremental=False) for image in images]
    finished, num_preemptions = {}, 0
    while engine.has_unfinished_requests():
        finished.update({o.rid: o for o in engine.step() if o.finished})
        num_preemptions = max([num_preemptions] + [s.num_preemptions for s in engine.requests.values()])
    assert num_preemptions > 0
    for rid, image in zip(rids, images):
        output = finished[rid]
        expected = hf_log_probs(hf_model, processor, ids, [image], output.output_token_ids)
        assert (torch.tensor(output.output_log_probs) - expected).abs().max() < 1e-4


def test_colocated_cycle_with_a_trainers_weight_names(checkpoint, hf_model):
    """Release with the weights discarded, resume, and load every weight under transformers' in-memory names (what
    the FSDP trainer pushes: model.visual.*, model.language_model.*, lm_head): the output is the original's."""
    processor = load_vl_processor(checkpoint)
    token_ids = _prompt(processor, 1)
    image = random_image(61, 97, seed=1)
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=256)
    _, before = _run(engine, token_ids, [image])
    engine.release_memory(None, discard_weights=True)
    engine.resume_memory(None)
    with pytest.raises(EngineWeightsMissingError):
        _run(engine, token_ids, [image])
    state = hf_model.state_dict()
    assert any(name.startswith("model.visual.") for name in state)
    engine.update_weights_from_tensors(list(state.items()), weight_version="pushed")
    _, after = _run(engine, token_ids, [image])
    assert after.output_token_ids == before.output_token_ids
    assert after.output_log_probs == pytest.approx(before.output_log_probs, abs=1e-6)
    assert after.weight_version == "pushed"


def test_a_later_turn_with_a_new_image_reuses_the_first_turns_cache(checkpoint, hf_model):
    """Turn 2 = turn 1's expanded prompt + its output + a new user turn with a second image (ids already expanded for
    the first image, one pad for the second): the first turn's blocks are hit and the log-probs stay exact."""
    processor = load_vl_processor(checkpoint)
    first_image, second_image = random_image(61, 97, seed=30), random_image(80, 60, seed=31)
    turn1 = _prompt(processor, 1)
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=256)
    _, first = _run(engine, turn1, [first_image])
    expanded_turn1 = processor.expand_input_ids(turn1, [first_image]).input_ids
    turn2 = expanded_turn1 + first.output_token_ids + processor.tokenizer(
        f"<|im_end|>\n<|im_start|>user\n{IMAGE_PLACEHOLDER}and now?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    _, second = _run(engine, turn2, [first_image, second_image])
    assert second.num_cached_tokens >= len(expanded_turn1) // 4 * 4
    expected = hf_log_probs(hf_model, processor, turn2, [first_image, second_image], second.output_token_ids)
    assert (torch.tensor(second.output_log_probs) - expected).abs().max() < 1e-4
