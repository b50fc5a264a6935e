"""Which prompt groups the default rollout samples with one /generate (SGLang's sampling_params.n): fresh samples
of one prompt under the default generate function, and no others. The request itself runs against the real engine
and router in test_rollout.py / test_rollout_engine.py (log-probs checked against a Hugging Face reference)."""


import pytest

from slime.rollout.generate_request import group_prompt_ids
from slime.utils.tiny_model import build_tiny_model
from slime.utils.types import Sample
from tests.helpers import args_helpers


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3")
    return args_helpers.make_args(hf_checkpoint=str(path))


def with_flags(args, **overrides):
    return args_helpers.make_args(hf_checkpoint=args.hf_checkpoint, **overrides)


def group(prompt="What is 2 + 2?", size=4):
    return [Sample(prompt=prompt, index=i, group_index=0) for i in range(size)]


def test_fresh_copies_of_one_prompt_go_as_one_request(args):
    from slime.rollout.dataset import load_tokenizer

    expected = load_tokenizer(args.hf_checkpoint)("What is 2 + 2?", add_special_tokens=False)["input_ids"]
    assert group_prompt_ids(args, group()) == expected
    chat = group([{"role": "user", "content": "hi"}])
    assert group_prompt_ids(args, chat)  # rendered with the chat template, the same for every copy
    # R3 too: the engine returns each sample's routing in the grouped answer (test_engine_routed_experts.py)
    assert group_prompt_ids(with_flags(args, use_rollout_routing_replay=True), group()) == expected


@pytest.mark.parametrize("case", ["single", "hook", "multi_turn", "started", "per_sample_hook", "finished",
                                  "different_prompts", "sample_hooks"])
def test_other_groups_go_sample_by_sample(args, case):
    samples, run_args = group(), args
    if case == "single":
        samples = group(size=1)
    elif case == "hook":
        run_args = with_flags(args, custom_generate_function_path="my.generate")
    elif case == "multi_turn":
        run_args = with_flags(args, max_turns=3)
    elif case == "started":  # a partial rollout's continuation
        samples[1].tokens, samples[1].response_length = [5, 6, 7], 1
    elif case == "per_sample_hook":
        samples[2].generate_function_path = "my.generate"
    elif case == "finished":
        samples[3].status = Sample.Status.COMPLETED
    elif case == "different_prompts":
        samples[0].prompt = "What is 3 + 3?"
    elif case == "sample_hooks":
        run_args = with_flags(args, rollout_sample_hook_path=["my.hook"])
    assert group_prompt_ids(run_args, samples) is None
