"""The default rollout against the REAL built-in engine server (tiny Qwen3 checkpoint) behind the REAL sglang-router.

One engine and one router serve the whole module. Exact expectations come from the engine itself: greedy decoding
(temperature 0) is deterministic, so every rollout answer is compared with a direct POST /generate to the engine for
the same tokens, and an interrupted-then-continued response with an uninterrupted one. Timing-dependent cases (which
groups are still generating at the abort) are made deterministic with `ignore_eos` and very different lengths.
test_rollout_engine.py covers the temperature-1 path against an independent Hugging Face reference.
"""

import asyncio
import functools
import json
from types import SimpleNamespace

import httpx
import pytest

from slime.engine.server.launch import launch_server
from slime.ray.router import RouterProcess
from slime.ray.router import register_worker as router_register_worker
from slime.rollout import sglang_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.dataset import load_tokenizer
from slime.rollout.generate_request import build_sampling_params
from slime.rollout.sglang_rollout import generate, generate_rollout
from slime.utils import http_utils
from slime.utils.misc import find_free_port
from slime.utils.types import Sample
from tests.helpers import args_helpers

MAX_RESPONSE_LEN = 6
LONG_RESPONSE_LEN = 256  # groups that are still generating when group 0 (2 tokens) has finished
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # > 2 KV blocks: the prefix cache can hit


# ---------------------------------------------------------------- test hooks (loaded by dotted path)
async def reward_by_index(args, sample):
    """Even groups all get 1.0 (zero std); odd groups get 0/1 by sample index."""
    return 1.0 if sample.group_index % 2 == 0 else float(sample.index % 2)


async def reward_per_group(args, samples):
    return [10.0 * samples[0].group_index + i for i in range(len(samples))]


async def failing_reward(args, sample):
    if sample.index % 2:
        raise RuntimeError("grader crashed")
    return 1.0


def keep_odd_groups(args, group):
    return group[0].group_index % 2 == 1


def tag_sample(args, sample, *, rollout_id=None, evaluation=False):  # --rollout-sample-hook-path (slime's)
    sample.metadata["hooked"] = (rollout_id, evaluation, sample.reward)


async def replace_sample(args, sample, **kwargs):  # a second hook: may return a new Sample
    sample.metadata["second_hook"] = True
    return sample


def remove_first_sample_of_each_group(args, groups):  # --rollout-sample-filter-path
    for group in groups:
        group[0].remove_sample = True


def record_all_groups(args, all_groups, data_source):  # --rollout-all-samples-process-path
    args.seen_group_indices = [g[0].group_index for g in all_groups]


async def generate_with_tool_output(args, sample, sampling_params):
    sample = await generate(args, sample, {**sampling_params, "ignore_eos": True})
    sample.append_response_tokens(args, tokens=[11, 12], trainable=False, text="<tool>")
    return sample


async def short_first_group(args, sample, sampling_params):
    """Every response runs to max_new_tokens (ignore_eos); group 0 asks for 2 tokens, and only once the engine is
    running the other groups' 4 requests, so it finishes while those are still generating."""
    sampling_params = {**sampling_params, "ignore_eos": True}
    if sample.group_index == 0:
        sampling_params["max_new_tokens"] = 2
        await wait_for_engine_requests(args.engine_url, 4)
    return await generate(args, sample, sampling_params)


async def wait_for_engine_requests(engine_url, num_requests, timeout_s=60.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while True:
            info = (await client.get(engine_url + "/get_server_info", timeout=10)).json()
            if info["internal_states"][0]["num_in_flight_requests"] >= num_requests:
                return
            assert loop.time() < deadline, f"the engine never had {num_requests} requests in flight"
            await asyncio.sleep(0.01)


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The built-in engine server (CPU, tiny Qwen3) registered with a round-robin sglang-router."""
    from slime.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("rollout_stack")
    model_dir = str(build_tiny_model(root / "tiny", arch="qwen3"))
    server = launch_server(model_dir, extra_args=["--device", "cpu"], log_path=root / "engine.log",
                           env={"OMP_NUM_THREADS": "1"})
    router = None
    try:
        router = RouterProcess(policy="round_robin")
        router_register_worker(router.url, server.url)
        yield SimpleNamespace(model_dir=model_dir, server=server, router=router)
    finally:
        if router is not None:
            router.shutdown()
        server.stop()


@pytest.fixture
def make_args(tmp_path, stack):
    def make(prompts, rollout_batch_size=2, **overrides):
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps({"input": p, "label": "1"}) + "\n" for p in prompts))
        defaults = {"label_key": "label", "hf_checkpoint": stack.model_dir, "rollout_temperature": 0.0,
                    "rollout_max_response_len": MAX_RESPONSE_LEN, "sglang_router_ip": stack.router.host,
                    "sglang_router_port": stack.router.port, "sglang_server_concurrency": 8,
                    "custom_rm_path": f"{__name__}.reward_by_index", "rm_type": None}
        return args_helpers.make_args("--prompt-data", path, "--rollout-batch-size", rollout_batch_size,
                                      "--n-samples-per-prompt", 2, **{**defaults, **overrides})

    return make


@pytest.fixture
def abort_calls(monkeypatch):
    """Counts the rollout's abort-everything calls; each call still goes to the router and the engine."""
    calls = []
    real = sglang_rollout.abort_all_requests

    async def counting(base_url, *headers):
        calls.append(base_url)
        return await real(base_url, *headers)

    monkeypatch.setattr(sglang_rollout, "abort_all_requests", counting)
    return calls


def prompt_ids(model_dir, text):
    return load_tokenizer(model_dir)(text, add_special_tokens=False)["input_ids"]


def engine_generate(stack, input_ids, sampling_params) -> dict:
    """The engine's own answer, bypassing the rollout and the router."""
    response = httpx.post(stack.server.url + "/generate", timeout=120, trust_env=False, json={
        "input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True,
    })
    assert response.status_code == 200, response.text
    return response.json()


def engine_weight_version(stack) -> str:
    return httpx.get(stack.server.url + "/get_model_info", timeout=10, trust_env=False).json()["weight_version"]


def expected_status(finish_reason: dict) -> Sample.Status:
    return {"length": Sample.Status.TRUNCATED, "stop": Sample.Status.COMPLETED}[finish_reason["type"]]


@functools.lru_cache(maxsize=1)
def reference_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_log_probs(model_dir, tokens, response_length, temperature):
    """Hugging Face log-softmax(logits / temperature) at each response token."""
    import torch

    with torch.no_grad():
        logits = reference_model(model_dir)(torch.tensor([tokens])).logits[0].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    return [log_probs[p - 1, tokens[p]].item() for p in range(len(tokens) - response_length, len(tokens))]


# ---------------------------------------------------------------- tests
def test_samples_are_filled_from_the_engine_answer(make_args, stack):
    args = make_args(["1 + 1", LONG_PROMPT, "3 + 3"])
    sampling_params = build_sampling_params(args)
    assert sampling_params == {  # what every /generate of this rollout carries (max_new_tokens reduced when resuming)
        "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": MAX_RESPONSE_LEN,
        "skip_special_tokens": False, "no_stop_trim": True,
    }
    version = engine_weight_version(stack)
    for _ in range(2):  # the second rollout re-sends the same prompts: the engine's prefix cache hits
        output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
        groups = output.samples
        assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
        for sample in (s for g in groups for s in g):
            ids = prompt_ids(stack.model_dir, sample.prompt)
            answer = engine_generate(stack, ids, sampling_params)
            meta = answer["meta_info"]
            assert sample.tokens == ids + answer["output_ids"]
            assert sample.response_length == len(answer["output_ids"]) == len(sample.loss_mask)
            assert len(sample.rollout_log_probs) == sample.response_length
            assert 1 <= sample.response_length <= MAX_RESPONSE_LEN
            assert sample.rollout_log_probs == pytest.approx([lp for lp, _, _ in meta["output_token_logprobs"]],
                                                             abs=1e-5)
            assert sample.loss_mask == [1] * sample.response_length
            assert sample.status == expected_status(meta["finish_reason"])
            assert sample.weight_versions == [version] == [meta["weight_version"]]
            assert sample.response == answer["text"]
            assert sample.reward == (float(sample.index % 2) if sample.group_index % 2 else 1.0)
            assert sample.prefix_cache_info.total_prompt_tokens == len(ids)
            assert 0 <= sample.prefix_cache_info.cached_tokens < len(ids)
        metrics = output.metrics
        assert metrics["rollout/num_groups_fetched"] == 2 and metrics["rollout/num_groups_aborted"] == 0
        samples = [s for g in groups for s in g]
        assert metrics["rollout/prefix_cache_hit_rate"] == pytest.approx(
            sum(s.prefix_cache_info.cached_tokens for s in samples)
            / sum(len(prompt_ids(stack.model_dir, s.prompt)) for s in samples)
        )
    assert metrics["rollout/prefix_cache_hit_rate"] > 0  # LONG_PROMPT's full blocks were cached by the first rollout


def test_dynamic_filter_drops_and_over_samples(make_args):
    # check_reward_nonzero_std (a DynamicFilterOutput) is covered in test_rollout_engine; this is a bool filter.
    args = make_args([f"{i} + 1" for i in range(8)], dynamic_sampling_filter_path=f"{__name__}.keep_odd_groups")
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    groups = output.samples
    assert [g[0].group_index for g in groups] == [1, 3]
    assert all(sorted(s.reward for s in g) == [0.0, 1.0] for g in groups)
    metrics = output.metrics
    assert metrics["rollout/num_groups_fetched"] == 4  # two waves of over-sampling
    assert metrics["rollout/dynamic_filter/num_dropped"] >= 1
    drop_keys = [k for k in metrics if k.startswith("rollout/dynamic_filter/drop_")]
    assert drop_keys == ["rollout/dynamic_filter/drop_filtered"]
    assert metrics["rollout/dynamic_filter/drop_filtered"] == metrics["rollout/dynamic_filter/num_dropped"]


def test_keep_when_insufficient_keeps_a_dropped_group_without_spares(make_args):
    filter_path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    args = make_args([f"{i} + 1" for i in range(8)], dynamic_sampling_filter_path=filter_path)
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    groups = output.samples
    assert [g[0].group_index for g in groups] == [0, 1]  # group 0 has zero std but nothing could replace it
    metrics = output.metrics
    assert metrics["rollout/dynamic_filter/num_kept_when_insufficient"] == 1
    assert metrics["rollout/dynamic_filter/num_dropped"] == 0 and metrics["rollout/num_groups_fetched"] == 2

    args.over_sampling_batch_size = 4  # spares in flight: the zero-std groups are dropped after all
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    groups = output.samples
    assert [g[0].group_index for g in groups] == [1, 3]
    metrics = output.metrics
    assert metrics["rollout/dynamic_filter/num_kept_when_insufficient"] == 0
    assert metrics["rollout/dynamic_filter/num_dropped"] >= 1


@pytest.mark.parametrize("partial", [True, False])
def test_abort_returns_partial_groups_and_continues_them(make_args, stack, abort_calls, partial):
    prompts = ["9 + 9", "slow 1", "slow 2"]
    args = make_args(
        prompts, rollout_batch_size=1, over_sampling_batch_size=3, partial_rollout=partial,
        mask_offpolicy_in_partial_rollout=True, rollout_max_response_len=LONG_RESPONSE_LEN,
        custom_generate_function_path=f"{__name__}.short_first_group", engine_url=stack.server.url,
    )
    # What each "slow" prompt yields uninterrupted: greedy, so an interrupted-then-continued response must equal it.
    uninterrupted = {}
    for prompt in prompts[1:]:
        ids = prompt_ids(stack.model_dir, prompt)
        answer = engine_generate(stack, ids, {**build_sampling_params(args), "ignore_eos": True})
        assert len(answer["output_ids"]) == LONG_RESPONSE_LEN
        log_probs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        uninterrupted[prompt] = (ids + answer["output_ids"], log_probs)

    source = RolloutDataSourceWithBuffer(args)
    output = generate_rollout(args, 5, source)
    groups = output.samples
    assert [g[0].prompt for g in groups] == ["9 + 9"]
    assert all(s.response_length == 2 and s.status == Sample.Status.TRUNCATED for s in groups[0])
    assert abort_calls == [stack.router.url]
    metrics = output.metrics
    assert metrics["rollout/num_groups_aborted"] == 2
    if not partial:
        assert source.buffer == [] and metrics["rollout/num_groups_returned_to_buffer"] == 0
        return
    assert metrics["rollout/num_groups_returned_to_buffer"] == 2
    buffered = [s for g in source.buffer for s in g]
    assert [s.prompt for s in buffered] == ["slow 1", "slow 1", "slow 2", "slow 2"]
    assert all(s.response_length >= 2 for s in buffered)  # generating alongside group 0's 2 tokens, then aborted
    old = {}
    for sample in buffered:
        full_tokens, full_log_probs = uninterrupted[sample.prompt]
        assert sample.status == Sample.Status.ABORTED and sample.reward is None  # the engine ended it: "abort"
        assert 0 <= sample.response_length < LONG_RESPONSE_LEN and sample.metadata["start_rollout_id"] == 5
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        assert sample.tokens == full_tokens[: len(sample.tokens)]  # the partial response is the greedy prefix
        assert sample.rollout_log_probs == pytest.approx(full_log_probs[: sample.response_length], abs=1e-4)
        old[sample.index] = (list(sample.tokens), sample.response_length, list(sample.rollout_log_probs))

    # next rollout: the buffered groups come first and are continued where they stopped
    args.rollout_batch_size, args.over_sampling_batch_size = 2, 2
    output = generate_rollout(args, 6, source)
    groups = output.samples
    assert [g[0].prompt for g in groups] == ["slow 1", "slow 2"] and source.buffer == []
    assert output.metrics["rollout/num_groups_fetched"] == 2
    for sample in (s for g in groups for s in g):
        old_tokens, old_length, old_log_probs = old[sample.index]
        full_tokens, full_log_probs = uninterrupted[sample.prompt]
        assert sample.tokens[: len(old_tokens)] == old_tokens  # continued, not regenerated
        # ignore_eos: the response ends at max_new_tokens, so the resumed request asked for LONG - old_length
        assert sample.response_length == LONG_RESPONSE_LEN and sample.status == Sample.Status.TRUNCATED
        assert sample.tokens == full_tokens  # the same tokens as an uninterrupted generation
        assert sample.loss_mask == [0] * old_length + [1] * (LONG_RESPONSE_LEN - old_length)  # off-policy prefix
        assert sample.rollout_log_probs[:old_length] == old_log_probs
        assert sample.rollout_log_probs == pytest.approx(full_log_probs, abs=1e-4)
        assert sample.reward is not None and sample.metadata["start_rollout_id"] == 5


def test_slime_sample_hooks_filter_and_all_samples_process(make_args):
    args = make_args([f"{i} + 1" for i in range(8)], dynamic_sampling_filter_path=f"{__name__}.keep_odd_groups",
                     rollout_sample_hook_path=[f"{__name__}.tag_sample", f"{__name__}.replace_sample"],
                     rollout_sample_filter_path=f"{__name__}.remove_first_sample_of_each_group",
                     rollout_all_samples_process_path=f"{__name__}.record_all_groups")
    groups = generate_rollout(args, 3, RolloutDataSourceWithBuffer(args)).samples
    assert [g[0].group_index for g in groups] == [1, 3]
    for group in groups:
        # hooks ran in order on the generated sample, before its reward, with the rollout id
        assert all(s.metadata["hooked"] == (3, False, None) and s.metadata["second_hook"] for s in group)
        assert [s.remove_sample for s in group] == [True, False]
    assert sorted(args.seen_group_indices) == [0, 1, 2, 3]  # the dropped groups too


def test_custom_generate_hook(make_args, stack):
    args = make_args(["1 + 2"], rollout_batch_size=1,
                     custom_generate_function_path=f"{__name__}.generate_with_tool_output")
    (group,) = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples
    ids = prompt_ids(stack.model_dir, "1 + 2")
    answer = engine_generate(stack, ids, {**build_sampling_params(args), "ignore_eos": True})
    for sample in group:
        assert sample.response_length == MAX_RESPONSE_LEN + 2
        assert sample.loss_mask == [1] * MAX_RESPONSE_LEN + [0, 0]
        assert sample.tokens == ids + answer["output_ids"] + [11, 12]
        assert sample.rollout_log_probs[-2:] == [0.0, 0.0] and sample.tokens[-2:] == [11, 12]
        assert sample.rollout_log_probs[:-2] == pytest.approx(
            [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]], abs=1e-5)
        assert sample.response.endswith("<tool>")


def test_group_rm_and_reward_failures(make_args):
    args = make_args(["1 + 2", "3 + 4"], group_rm=True, custom_rm_path=f"{__name__}.reward_per_group")
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    groups = output.samples
    assert [[s.reward for s in g] for g in groups] == [[0.0, 1.0], [10.0, 11.0]]
    assert output.metrics["rollout/reward_failures"] == 0

    args = make_args(["1 + 2", "3 + 4"], custom_rm_path=f"{__name__}.failing_reward")
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    groups = output.samples
    assert [[s.reward for s in g] for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert "grader crashed" in groups[0][1].metadata["reward_error"]
    assert output.metrics["rollout/reward_failures"] == 2


def test_exhausted_data_source_is_an_error_not_a_hang(make_args):
    class TwoGroupsOnly(RolloutDataSourceWithBuffer):
        def get_samples(self, num_groups):
            return super().get_samples(num_groups) if self.sample_group_index < 2 else []

    args = make_args(["1 + 2", "3 + 4"], dynamic_sampling_filter_path=f"{__name__}.keep_odd_groups")
    with pytest.raises(RuntimeError, match="ran out of prompt groups with 1 of 2 accepted"):
        generate_rollout(args, 0, TwoGroupsOnly(args))


def test_unreachable_router_gives_a_clear_error(make_args, monkeypatch):
    monkeypatch.setattr(http_utils, "DEFAULT_NUM_RETRIES", 2)
    port = find_free_port()
    args = make_args(["1 + 2"], rollout_batch_size=1, sglang_router_port=port)
    with pytest.raises(http_utils.EndpointUnreachableError, match=rf"http://127\.0\.0\.1:{port}/generate"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
