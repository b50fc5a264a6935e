"""The VL loop against the REAL built-in engine behind the REAL sglang-router (tiny Qwen2.5-VL / Qwen3-VL, CPU, fp32):
rows with images -> the default rollout (processor-expanded ids + SGLang's image_data) -> train data -> the FSDP
trainer, whose log-probs of the sampled tokens equal the engine's; and a multi-turn conversation whose environment
answers with a new image, whose trainer log-probs equal the engine's on every sampled token."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from slime.engine.server.launch import launch_server
from slime.ray.router import RouterProcess, register_worker
from slime.ray.train_data import samples_to_train_data
from slime.rollout import multi_turn
from slime.rollout.dataset import PromptFormat, load_prompt_samples, load_tokenizer
from slime.rollout.sglang_rollout import generate
from slime.utils.http_utils import run
from slime.utils.image_policy import image_token_counts, load_vl_processor
from slime.utils.tiny_vl_model import build_tiny_vl_model
from slime.utils.types import Sample
from tests.helpers import args_helpers
from tests.helpers.fsdp_helpers import make_args as make_trainer_args
from tests.helpers.fsdp_helpers import make_trainer
from tests.helpers.vl_checkpoints import random_image

SAMPLING = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "no_stop_trim": True}


class ImageEnv:
    """One step: answers the first turn with a new image and a question; the episode ends after the second turn."""

    def __init__(self, args):
        self.steps = 0

    def reset(self, sample):
        return None

    def step(self, text):
        self.steps += 1
        if self.steps == 1:
            return {"text": "Now this one: <image> how many?", "images": [random_image(47, 33, 9)]}, 0.5, False, {}
        return "done", 0.5, True, {}


def make_env(args):
    return ImageEnv(args)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def stack(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = str(build_tiny_vl_model(root / "model", arch=request.param, seed=3, initializer_range=0.5))
    server = launch_server(model_dir, extra_args=["--dtype", "float32"], log_path=root / "engine.log",
                           env={"OMP_NUM_THREADS": "1"})
    router = RouterProcess(policy="round_robin")
    try:
        register_worker(router.url, server.url)
        yield SimpleNamespace(model_dir=model_dir, router=router, root=root)
    finally:
        router.shutdown()
        server.stop()


def rollout_args(stack, **overrides):
    return args_helpers.make_args(**{
        "hf_checkpoint": stack.model_dir, "sglang_router_ip": stack.router.host,
        "sglang_router_port": stack.router.port, "rm_type": None, "sglang_server_concurrency": 4,
        "multimodal_keys": {"image": "images"}, "apply_chat_template": True, **overrides})


def trainer_log_probs(stack, samples: list[Sample]) -> list[torch.Tensor]:
    for sample in samples:
        sample.reward = 0.0
    args = make_trainer_args(stack.model_dir, "--micro-batch-size", str(len(samples)), "--rollout-temperature", "1.0")
    data = samples_to_train_data(args, samples)
    data.update(rollout_id=0, num_steps_per_rollout=1, global_batch_size=len(samples))
    trainer = make_trainer(args)
    try:
        by_index = trainer.compute_log_probs(trainer._schedule(data))
    finally:
        dist.destroy_process_group()
    return [by_index[i] for i in range(len(samples))]


def test_default_rollout_log_probs_equal_the_trainers(stack):
    images = [random_image(45, 61, 1), random_image(90, 37, 2), random_image(29, 100, 3)]
    for index, image in enumerate(images):
        image.save(stack.root / f"{index}.png")
    rows = [{"prompt": "<image>How many circles?", "images": [str(stack.root / "0.png")]},
            {"prompt": "Compare <image> and <image>.", "images": [str(stack.root / "1.png"), str(stack.root / "2.png")]},
            {"prompt": "No image: 2 + 2?", "images": []}]
    data_file = stack.root / "rows.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    fmt = PromptFormat(input_key="prompt", label_key=None, apply_chat_template=True,
                       multimodal_keys={"image": "images"})
    samples, _ = load_prompt_samples(str(data_file), fmt, load_tokenizer(stack.model_dir))
    args = rollout_args(stack)
    for index, sample in enumerate(samples):
        sample.index = index
        run(generate(args, sample, dict(SAMPLING)))
    processor = load_vl_processor(stack.model_dir)
    for sample, num_images in zip(samples, (1, 2, 0)):
        assert sample.response_length == 5 and len(sample.rollout_log_probs) == 5
        grids = (sample.multimodal_train_inputs or {}).get("image_grid_thw")
        assert (0 if grids is None else len(grids)) == num_images
        if num_images:  # the engine's prompt is the trainer's: the same image-token count
            assert sample.prefix_cache_info.total_prompt_tokens == sample.prompt_length
            assert sample.tokens.count(processor.image_token_id) == sum(image_token_counts(grids, 2))
    trained = trainer_log_probs(stack, samples)
    differences = [float((t - torch.tensor(s.rollout_log_probs)).abs().max()) for t, s in zip(trained, samples)]
    print(f"trainer vs engine log-probs, max abs difference per sample: {differences}")
    assert max(differences) < 1e-4
    assert torch.cat(trained).std() > 0.1  # wide weights: the log-probs spread


def test_multi_turn_observation_images_reach_engine_and_trainer(stack):
    args = rollout_args(stack, max_turns=2, env_path=f"{__name__}.make_env", tool_functions_path=None,
                        tool_call_parser="qwen25", tool_timeout=1.0, max_tool_response_chars=4096)
    processor = load_vl_processor(stack.model_dir)
    first_image = random_image(40, 56, 4)
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": "What is it?"}]}])
    sample = Sample(prompt=prompt, index=0, multimodal_inputs={"images": [first_image]},
                    metadata={"messages": [{"role": "user", "content": [{"type": "image"},
                                                                        {"type": "text", "text": "What is it?"}]}]})
    # every token id stops its turn: each turn samples exactly one token and ends with finish "stop"
    one_token_turns = {"temperature": 1.0, "max_new_tokens": 400, "no_stop_trim": True,
                       "stop_token_ids": list(range(len(processor.tokenizer)))}
    sample = run(multi_turn.generate(args, sample, one_token_turns))
    assert sample.metadata["multi_turn"]["turns"] == 2 and sample.reward == 1.0, (sample.status, sample.metadata["multi_turn"], sample.response)
    assert len(sample.multimodal_inputs["images"]) == 2
    grids = sample.multimodal_train_inputs["image_grid_thw"]
    assert len(grids) == 2 and sample.tokens.count(processor.image_token_id) == sum(image_token_counts(grids, 2))
    # the observation's image tokens are in the response, loss mask 0; both turns' samples have mask 1
    response = sample.tokens[sample.prompt_length:]
    assert any(t == processor.image_token_id and m == 0 for t, m in zip(response, sample.loss_mask))
    assert sum(sample.loss_mask) == 2
    [trained] = trainer_log_probs(stack, [sample])
    sampled = torch.tensor(sample.loss_mask, dtype=torch.bool)
    difference = float((trained[sampled] - torch.tensor(sample.rollout_log_probs)[sampled]).abs().max())
    print(f"multi-turn trainer vs engine log-probs, max abs difference: {difference}")
    assert difference < 1e-4


def test_a_group_of_one_vl_prompt_is_one_request_with_n(stack):
    import copy

    from slime.rollout.generate_request import group_prompt_ids
    from slime.rollout.sglang_rollout import GenerateState, generate_group

    args = rollout_args(stack, n_samples_per_prompt=4, custom_rm_path="examples.vl_shapes.reward.reward")
    processor = load_vl_processor(stack.model_dir)
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": "How many?"}]}])
    first = Sample(prompt=prompt, index=0, group_index=0, label="2", multimodal_inputs={"images": [random_image(52, 38, 11)]})
    group = [first] + [copy.deepcopy(first) for _ in range(3)]
    for index, sample in enumerate(group):
        sample.index = index
    assert group_prompt_ids(args, copy.deepcopy(group)) is not None  # one /generate with n = 4
    other = copy.deepcopy(group)
    other[3].multimodal_inputs = {"images": [random_image(52, 38, 12)]}  # a different image: sample by sample
    assert group_prompt_ids(args, other) is None
    group = run(generate_group(args, group, dict(SAMPLING), GenerateState(args)))
    prompt_ids = processor.encode(prompt, first.multimodal_inputs["images"]).input_ids
    assert all(s.tokens[:len(prompt_ids)] == prompt_ids and s.response_length == 5 for s in group)
    assert len({tuple(s.tokens[len(prompt_ids):]) for s in group}) > 1  # n independent samples
    trained = trainer_log_probs(stack, group)
    assert max(float((t - torch.tensor(s.rollout_log_probs)).abs().max()) for t, s in zip(trained, group)) < 1e-4
