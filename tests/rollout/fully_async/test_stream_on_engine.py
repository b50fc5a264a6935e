"""The fully async stream against the real built-in engine server (a subprocess on a tiny checkpoint): a weight push
in the middle of the responses shows in each token's recorded version, and every token's behaviour log-prob is that
of the weights its version names (recomputed independently with transformers on the two checkpoints). A stream
restored from another's state trains the same buffered groups and admits the saved in-flight prompts first."""

import json
import time

import httpx
import pytest

from slime.config.arguments import parse_args
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.fully_async.stream import GenerationStream
from slime.rollout.sglang_rollout import generate
from slime.utils.http_utils import run

MAX_RESPONSE_LEN = 900


async def generate_ignoring_eos(args, sample, sampling_params):
    """Every response runs to its length, so the push lands inside it."""
    return await generate(args, sample, {**sampling_params, "ignore_eos": True})


async def constant_reward(args, sample):
    return 1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from slime.engine.server.launch import launch_server
    from slime.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("stream")
    old = build_tiny_model(root / "v0", arch="qwen3", seed=0)
    new = build_tiny_model(root / "v1", arch="qwen3", seed=1)  # same tokenizer, other weights
    server = launch_server(old, log_path=root / "server.log")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"count to {i}", "label": "1"}) + "\n" for i in range(8)))
    yield {"old": str(old), "new": str(new), "url": server.url, "prompts": str(prompts)}
    server.stop()


def stream_args(stack, *extra):
    host, port = stack["url"].removeprefix("http://").split(":")
    return parse_args([
        "--hf-checkpoint", stack["old"], "--prompt-data", stack["prompts"], "--fully-async", "--use-tis",
        "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--rollout-max-response-len",
        str(MAX_RESPONSE_LEN), "--num-rollout", "4", "--sglang-router-ip", host, "--sglang-router-port", port,
        "--custom-rm-path", f"{__name__}.constant_reward",
        "--custom-generate-function-path", f"{__name__}.generate_ignoring_eos", *extra])


def post(stack, path, payload):
    response = httpx.post(stack["url"] + path, json=payload, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text


def stop(stack, stream):
    run(stream.stop())
    post(stack, "/abort_request", {"abort_all": True})  # what the RolloutManager does after stopping its stream


def wait_for_tokens(stack, seconds=0.15):
    """Until the engine has requests in flight, then a little longer: they are part way through."""
    deadline = time.monotonic() + 60
    while httpx.get(stack["url"] + "/get_server_info", timeout=10, trust_env=False).json().get(
            "internal_states", [{}])[0].get("num_in_flight_requests", 0) == 0:
        assert time.monotonic() < deadline, "no request reached the engine"
        time.sleep(0.05)
    time.sleep(seconds)


def push(stack, stream, model_path, version):
    run(stream.pause())
    post(stack, "/pause_generation", {"mode": "abort"})
    post(stack, "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)})
    post(stack, "/continue_generation", {})
    run(stream.resume(version))


def reference_log_probs(model_dir, tokens, positions):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    return [log_probs[p - 1, tokens[p]].item() for p in positions]


def test_a_push_mid_sequence_shows_in_the_versions_and_the_log_probs(stack):
    args = stream_args(stack)
    stream = GenerationStream(args, RolloutDataSourceWithBuffer(args), version=0)
    run(stream.start())
    try:
        wait_for_tokens(stack)
        push(stack, stream, stack["new"], 1)
        batch = run(stream.next_batch(0, timeout=300))
    finally:
        stop(stack, stream)
        post(stack, "/update_weights_from_disk", {"model_path": stack["old"], "weight_version": "0"})
    assert batch is not None
    groups, metrics = batch
    samples = groups[0]
    assert metrics["rollout/versions_per_sample_max"] == 2 and metrics["rollout/segments_per_group_mean"] == 2
    for sample in samples:
        versions = sample.token_weight_versions
        assert sample.response_length == MAX_RESPONSE_LEN == len(versions)
        split = versions.index("1")
        assert 0 < split and versions == ["0"] * split + ["1"] * (MAX_RESPONSE_LEN - split), versions
        assert sample.weight_versions == ["0", "1"]  # one per request: the aborted one, then its continuation
        prompt_length = len(sample.tokens) - sample.response_length
        for model, span in ((stack["old"], range(split)), (stack["new"], range(split, MAX_RESPONSE_LEN))):
            expected = reference_log_probs(model, sample.tokens, [prompt_length + i for i in span])
            got = [sample.rollout_log_probs[i] for i in span]
            assert max(abs(a - b) for a, b in zip(got, expected)) < 2e-3, model
        # the two checkpoints disagree, so matching the right one per token is not a coincidence
        other = reference_log_probs(stack["new"], sample.tokens, [prompt_length + i for i in range(split)])
        assert max(abs(a - b) for a, b in zip(sample.rollout_log_probs[:split], other)) > 0.1


def test_mask_offpolicy_masks_the_tokens_before_the_push(stack):
    args = stream_args(stack, "--mask-offpolicy-in-partial-rollout")
    stream = GenerationStream(args, RolloutDataSourceWithBuffer(args), version=0)
    run(stream.start())
    try:
        wait_for_tokens(stack)
        push(stack, stream, stack["old"], 1)  # same weights, new version: only the bookkeeping matters here
        groups, metrics = run(stream.next_batch(0, timeout=300))
    finally:
        stop(stack, stream)
    for sample in groups[0]:
        split = sample.token_weight_versions.index("1")
        assert sample.loss_mask == [0] * split + [1] * (MAX_RESPONSE_LEN - split)
    assert metrics["rollout/versions_per_sample_max"] == 1  # only version-1 tokens are trained


def test_a_restored_stream_trains_the_same_buffer_and_readmits_in_flight_prompts_first(stack):
    args = stream_args(stack, "--async-data-buffer-capacity-factor", "3", "--async-max-concurrent-samples", "2")
    stream = GenerationStream(args, RolloutDataSourceWithBuffer(args), version=0)
    run(stream.start())
    try:
        deadline = time.monotonic() + 300
        while not (stream.finished and stream.running):  # a finished group in the buffer, another generating
            assert time.monotonic() < deadline and stream.error is None, stream.error
            time.sleep(0.05)
        state, source_state = json.loads(json.dumps(run(stream.snapshot())))  # what run_state.json keeps
    finally:
        stop(stack, stream)
    assert len(state["buffer"]) >= 1 and len(state["in_flight"]) == 1
    saved_buffer = [[s["tokens"] for s in g["samples"]] for g in state["buffer"]]
    in_flight_group = state["in_flight"][0][0]["group_index"]
    assert all(not s["tokens"] for s in state["in_flight"][0])  # saved as admitted: the prompt, no response

    restored_args = stream_args(stack, "--async-data-buffer-capacity-factor", "3", "--async-max-concurrent-samples",
                                "2")
    restored_source = RolloutDataSourceWithBuffer(restored_args)
    restored_source.load_state_dict(source_state)  # what train.py's create_training_models does
    restored = GenerationStream(restored_args, restored_source, version=0)
    restored.load_state_dict(state)
    first_admitted = []
    real_admit = restored._admit
    restored._admit = lambda samples: (first_admitted.append(samples[0].group_index), real_admit(samples))[1]
    run(restored.start())
    try:
        groups, _ = run(restored.next_batch(0, timeout=300))
        assert [[s.tokens for s in g] for g in groups] == saved_buffer[:1]  # the oldest buffered group, unchanged
        assert first_admitted[0] == in_flight_group
        assert restored.data_source.state_dict()["sample_group_index"] >= source_state["sample_group_index"]
    finally:
        stop(stack, restored)
