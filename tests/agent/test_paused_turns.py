"""An agent turn through a weight push (slime/agent/adapters/paused_turns.py) against the real engine server: the
push's `abort` pause cuts the turn, the adapter resumes it from the tokens so far, and the joined turn has every
token once with the version that sampled it; the trajectory carries those versions onto the Sample."""

import asyncio
import threading
import time

import httpx

from slime.agent.adapters.paused_turns import generate_through_pushes
from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.rollout.dataset import load_tokenizer
from slime.utils.http_utils import request_json
from slime.utils.types import Sample

MAX_NEW_TOKENS = 900


def push_during_the_turn(url: str, model_path: str, version: str) -> threading.Thread:
    """Once the turn is on the engine and part way through: pause (abort), load the weights as `version`, go on."""
    def push():
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/get_server_info", timeout=10, trust_env=False).json()["internal_states"][0][
                "num_in_flight_requests"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.15)
        for path, body in (("/pause_generation", {"mode": "abort"}),
                           ("/update_weights_from_disk", {"model_path": model_path, "weight_version": version}),
                           ("/continue_generation", {})):
            assert httpx.post(url + path, json=body, timeout=120, trust_env=False).status_code == 200

    thread = threading.Thread(target=push)
    thread.start()
    return thread


def turn(server, tiny_qwen3, resume: bool, version: str):
    tokenizer = load_tokenizer(str(tiny_qwen3))
    prompt_ids = tokenizer("an agent's turn", add_special_tokens=False)["input_ids"]
    payload = {"input_ids": prompt_ids, "return_logprob": True,
               "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}}
    thread = push_during_the_turn(server.url, str(tiny_qwen3), version)

    async def post(body):
        return await request_json("POST", f"{server.url}/generate", body, timeout=120)

    result, versions = asyncio.run(generate_through_pushes(post, payload, resume, tokenizer))
    thread.join()
    return prompt_ids, result, versions


def test_a_turn_cut_by_a_push_is_resumed_and_joined(server, tiny_qwen3):
    prompt_ids, result, versions = turn(server, tiny_qwen3, resume=True, version="1")
    output_ids = result["output_ids"]
    assert len(output_ids) == MAX_NEW_TOKENS == len(versions) == len(result["meta_info"]["output_token_logprobs"])
    assert [entry[1] for entry in result["meta_info"]["output_token_logprobs"]] == output_ids
    split = versions.index("1")
    assert 0 < split and versions == ["0"] * split + ["1"] * (MAX_NEW_TOKENS - split)
    assert result["meta_info"]["finish_reason"]["type"] == "length"

    manager = TrajectoryManager()
    log_probs = [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]
    manager.record_turn("s", turn=TurnRecord(prompt_ids, output_ids, "length", log_probs, weight_version="1",
                                             output_weight_versions=versions),
                        prompt_messages=[{"role": "user", "content": "Count"}], response_message=None)
    (sample,) = manager.get_trajectory("s", base_sample=Sample())
    assert sample.token_weight_versions == versions and sample.weight_versions == ["1"]


def test_without_resume_the_turn_ends_at_the_abort(server, tiny_qwen3):
    before = httpx.get(f"{server.url}/get_weight_version", timeout=10, trust_env=False).json()["weight_version"]
    _, result, versions = turn(server, tiny_qwen3, resume=False, version="7")
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(result["output_ids"]) < MAX_NEW_TOKENS and set(versions) == {before}
