"""The default rollout END TO END: the built-in engine server (a subprocess) behind the real sglang-router.

Args come from the real `parse_args`, so the flag names the rollout reads are checked too. The rollout log-probs
are recomputed independently with the Hugging Face model (log-softmax of logits / temperature at each sampled
token). Group-level abort and continuation cases live in test_rollout.py.
"""

import asyncio
import functools
import json
import math
import subprocess
import sys
import time

import httpx
import pytest

from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.dataset import load_tokenizer
from slime.rollout.sglang_rollout import generate, generate_rollout
from slime.utils.misc import find_free_port
from slime.utils.types import Sample
from tests.helpers.router_helpers import launch_router, register_worker, stop

MAX_RESPONSE_LEN = 8
LONG_RESPONSE_LEN = 200


async def reward_by_group(args, sample):
    """Even groups all get 1.0 (zero std); odd groups get 0/1 by sample index."""
    return 1.0 if sample.group_index % 2 == 0 else float(sample.index % 2)


async def short_first_group(args, sample, sampling_params):
    """Group 0 stops after 2 tokens, so it finishes while every other group is still generating."""
    if sample.group_index == 0:
        sampling_params = {**sampling_params, "max_new_tokens": 2}
    return await generate(args, sample, sampling_params)


# The groups RecordingDataSource handed out, and what reward_while_another_group_generates saw at its first call.
HANDED_OUT: list = []
FIRST_REWARD: dict = {}


class RecordingDataSource(RolloutDataSourceWithBuffer):
    def get_samples(self, num_samples):
        groups = super().get_samples(num_samples)
        HANDED_OUT.extend(groups)
        return groups


async def reward_while_another_group_generates(args, sample):
    """The first call notes whether the other groups were still without a response, then waits (up to 60 s) for
    their responses before it returns: they arrive only if generation goes on while a reward runs."""
    if "others_unanswered" not in FIRST_REWARD:
        others = [s for group in HANDED_OUT for s in group if s.group_index != sample.group_index]
        FIRST_REWARD["others_unanswered"] = bool(others) and not any(s.response_length for s in others)
        deadline = time.monotonic() + 60
        while not all(s.response_length for s in others) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        FIRST_REWARD["others_answered_meanwhile"] = all(s.response_length for s in others)
    return 1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("engine_stack")
    model_dir = str(build_tiny_model(root / "tiny", arch="qwen3"))
    engine_port = find_free_port()
    log = open(root / "engine.log", "w")
    engine = subprocess.Popen(
        [sys.executable, "-m", "slime.engine.server", "--model-path", model_dir, "--port", str(engine_port),
         "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    router = None
    try:
        deadline = time.time() + 180
        while True:
            assert engine.poll() is None, f"engine server exited: {(root / 'engine.log').read_text()[-2000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "engine server not healthy within 180 s"
            time.sleep(0.5)
        router_port = find_free_port()
        router = launch_router(router_port)
        register_worker(router_port, f"http://127.0.0.1:{engine_port}")
        yield {"model_dir": model_dir, "router_port": router_port, "root": root}
    finally:
        if router is not None:
            stop(router)
        stop(engine)
        log.close()


def make_args(stack, prompts, *extra):
    from slime.config.arguments import parse_args

    path = stack["root"] / f"prompts_{len(prompts)}.jsonl"
    path.write_text("".join(json.dumps({"input": p, "label": "19"}) + "\n" for p in prompts))
    return parse_args([
        "--hf-checkpoint", stack["model_dir"], "--prompt-data", str(path), "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", str(MAX_RESPONSE_LEN), "--num-rollout", "1",
        "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(stack["router_port"]),
        "--custom-rm-path", f"{__name__}.reward_by_group", *extra,
    ])


@functools.lru_cache(maxsize=1)
def reference_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_log_probs(model_dir, tokens, response_length, temperature):
    import torch

    model = reference_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    positions = range(len(tokens) - response_length, len(tokens))
    return [log_probs[p - 1, tokens[p]].item() for p in positions]


def test_samples_match_the_engine_and_the_reference_model(stack):
    args = make_args(stack, ["What is 12 + 7?", "Compute 3 * 4 - 5."])
    tokenizer = load_tokenizer(stack["model_dir"])
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    groups = output.samples
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for sample in (s for g in groups for s in g):
        prompt_ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        response_ids = sample.tokens[len(prompt_ids):]
        assert sample.tokens[: len(prompt_ids)] == prompt_ids
        assert 1 <= sample.response_length == len(response_ids) <= MAX_RESPONSE_LEN
        assert len(sample.rollout_log_probs) == len(sample.loss_mask) == sample.response_length
        assert sample.loss_mask == [1] * sample.response_length
        if sample.status == Sample.Status.TRUNCATED:
            assert sample.response_length == MAX_RESPONSE_LEN
        else:
            assert sample.status == Sample.Status.COMPLETED and response_ids[-1] == eos
        assert sample.response == tokenizer.decode(response_ids)
        assert sample.weight_versions and sample.reward == reward_by_group_sync(sample)
        assert all(math.isfinite(x) and x <= 0 for x in sample.rollout_log_probs)
        reference = reference_log_probs(stack["model_dir"], sample.tokens, sample.response_length, 1.0)
        assert sample.rollout_log_probs == pytest.approx(reference, abs=2e-3)
    assert output.metrics["rollout/num_groups_fetched"] == 2


def reward_by_group_sync(sample):
    return 1.0 if sample.group_index % 2 == 0 else float(sample.index % 2)


def test_a_group_is_scored_while_the_next_one_generates(stack):
    """One request in flight at a time (--sglang-server-concurrency 1): the second group is sent when the first
    comes back, so the first group's reward starts before the second is answered and, as generation continues
    while it runs, ends after. A rollout that scored only after generating everything fails both."""
    HANDED_OUT.clear()
    FIRST_REWARD.clear()
    args = make_args(stack, ["What is 12 + 7?", "Compute 3 * 4 - 5."], "--sglang-server-concurrency", "1",
                     "--custom-rm-path", f"{__name__}.reward_while_another_group_generates")
    groups = generate_rollout(args, 0, RecordingDataSource(args)).samples
    assert FIRST_REWARD == {"others_unanswered": True, "others_answered_meanwhile": True}
    assert [[s.reward for s in g] for g in groups] == [[1.0, 1.0], [1.0, 1.0]]


def test_dynamic_filter_drops_zero_std_groups_and_over_samples(stack):
    args = make_args(
        stack, [f"{i} + 1" for i in range(8)],
        "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    )
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    groups = output.samples
    assert [g[0].group_index for g in groups] == [1, 3]
    metrics = output.metrics
    assert metrics["rollout/num_groups_fetched"] == 4
    assert metrics["rollout/dynamic_filter/num_dropped"] >= 1
    assert metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == metrics["rollout/dynamic_filter/num_dropped"]


def test_partial_rollout_returns_aborted_groups_and_continues_them(stack):
    args = make_args(
        stack, ["1 + 1", "2 + 2", "3 + 3"], "--rollout-batch-size", "1", "--over-sampling-batch-size", "3",
        "--rollout-max-response-len", str(LONG_RESPONSE_LEN), "--partial-rollout",
        "--mask-offpolicy-in-partial-rollout", "--custom-generate-function-path", f"{__name__}.short_first_group",
    )
    source = RolloutDataSourceWithBuffer(args)
    output = generate_rollout(args, 3, source)
    groups = output.samples
    assert [g[0].group_index for g in groups] == [0] and groups[0][0].response_length <= 2
    assert output.metrics["rollout/num_groups_returned_to_buffer"] == 2
    buffered = {s.index: (list(s.tokens), s.response_length, s.status) for g in source.buffer for s in g}
    assert sorted(buffered) == [2, 3, 4, 5]
    assert all(s.metadata["start_rollout_id"] == 3 for g in source.buffer for s in g)
    aborted = [i for i, (_, length, status) in buffered.items() if status == Sample.Status.ABORTED]
    assert aborted, "no sample was still generating when the rollout aborted"
    assert all(buffered[i][1] < LONG_RESPONSE_LEN for i in aborted)

    args.rollout_batch_size = args.over_sampling_batch_size = 2
    output = generate_rollout(args, 4, source)
    groups = output.samples
    assert [g[0].group_index for g in groups] == [1, 2] and source.buffer == []
    for sample in (s for g in groups for s in g):
        old_tokens, old_length, old_status = buffered[sample.index]
        assert sample.tokens[: len(old_tokens)] == old_tokens  # continued, not regenerated
        assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        assert sample.response_length <= LONG_RESPONSE_LEN
        assert len(sample.rollout_log_probs) == len(sample.loss_mask) == sample.response_length
        if old_status == Sample.Status.ABORTED:
            new_length = sample.response_length - old_length
            assert sample.loss_mask == [0] * old_length + [1] * new_length
        assert sample.reward is not None and sample.metadata["start_rollout_id"] == 3


def test_eval_against_the_engine(stack, tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"input": f"{i} * 2", "label": "4"}) + "\n" for i in range(2)))
    args = make_args(
        stack, ["unused"], "--eval-prompt-data", "tiny", str(path), "--n-samples-per-eval-prompt", "3",
        "--eval-max-response-len", "3", "--eval-temperature", "0.7",
    )
    results = generate_rollout(args, 0, None, evaluation=True)
    assert list(results) == ["tiny"]
    samples = results["tiny"]["samples"]
    assert [s.group_index for s in samples] == [0, 0, 0, 1, 1, 1]
    assert all(1 <= s.response_length <= 3 for s in samples)
    assert results["tiny"]["truncated"] == [s.status == Sample.Status.TRUNCATED for s in samples]
    assert all(s.response_length == 3 for s in samples if s.status == Sample.Status.TRUNCATED)
    assert results["tiny"]["rewards"] == [reward_by_group_sync(s) for s in samples]
