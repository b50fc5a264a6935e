"""The engine server's memory release / resume over real loopback HTTP (a tiny model in a subprocess): a request sent
while memory is released waits for the resume of every tag; a release with discard_weights serves again once the
weights are pushed; resumed with weights still discarded, waiting and new requests fail at once with 503."""

import time

from tests.engine.server.test_app import GREEDY, generate, post_in_background

PROMPT = {"input_ids": [21, 22, 23], "sampling_params": GREEDY}
ALL_TAGS = ["weights", "kv_cache", "cuda_graph"]


def released_with_a_request_waiting(client, server, release_body: dict):
    """The greedy answer before the release, then the release and a /generate sent after it: (expected, the
    request's thread, the list its JSON answer lands in)."""
    expected = generate(client, **PROMPT)
    assert client.post("/release_memory_occupation", json=release_body).status_code == 200
    results = []
    return expected, post_in_background(server, "/generate", PROMPT, results), results


def test_release_and_resume_memory(client, server):
    expected, thread, results = released_with_a_request_waiting(client, server, {})
    time.sleep(0.5)
    assert thread.is_alive()
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    time.sleep(0.3)
    assert thread.is_alive()  # the KV cache is still released
    assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    thread.join(30)
    assert results[0]["output_ids"] == expected["output_ids"]


def test_release_discarding_weights_serves_again_after_the_push(client, server, tiny_qwen3):
    body = {"tags": ALL_TAGS, "discard_weights": True}
    expected, thread, results = released_with_a_request_waiting(client, server, body)
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert client.post("/update_weights_from_disk", json={"model_path": str(tiny_qwen3)}).status_code == 200
    time.sleep(0.3)
    assert thread.is_alive()  # the KV cache is still released
    assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    thread.join(30)
    assert results[0]["output_ids"] == expected["output_ids"]


def test_resumed_with_weights_still_discarded_fails_requests_at_once(client, server, tiny_qwen3):
    # A push that missed buckets (an engine too slow for one POST) leaves discarded weights unloaded after the
    # resume: a request waiting since the release, and a new one, fail with 503 naming the cause instead of
    # waiting for weights nothing will send; a full push serves again.
    body = {"tags": ALL_TAGS, "discard_weights": True}
    expected, thread, waiting = released_with_a_request_waiting(client, server, body)
    time.sleep(0.3)
    assert client.post("/resume_memory_occupation", json={"tags": body["tags"]}).status_code == 200
    thread.join(30)
    assert not thread.is_alive() and "discarded" in waiting[0]["message"], waiting
    response = client.post("/generate", json=PROMPT)
    assert response.status_code == 503 and "push every weight" in response.json()["message"]
    assert client.post("/update_weights_from_disk", json={"model_path": str(tiny_qwen3)}).status_code == 200
    assert generate(client, **PROMPT)["output_ids"] == expected["output_ids"]
