"""The engine's HTTP server over real loopback HTTP, started as a subprocess on a tiny model: /generate (ids, text,
batch, log-probs, streaming, concurrency), info and health endpoints, prefix cache flush, abort, pause/continue,
and bad requests answered with 400 while the server keeps serving."""

import json
import threading
import time

import httpx
import pytest
import torch

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
LONG = {"temperature": 1.0, "max_new_tokens": 600, "ignore_eos": True}


SERVER_ARGS = ["--max-model-len", "1024"]  # read by the shared `server` fixture (conftest.py)


@pytest.fixture(scope="module")
def reference_engine(tiny_qwen3):
    """An in-process Engine on the same checkpoint: what the server must reproduce for greedy requests."""
    from slime.engine.engine import Engine

    return Engine(str(tiny_qwen3), max_model_len=1024)


def generate(client, **body):
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def read_sse(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_generate_input_ids_matches_engine_and_has_sglang_shape(client, reference_engine):
    prompt = [5, 17, 42, 7, 99]
    result = generate(client, input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
    expected = reference_engine.generate([prompt], GREEDY)[0]
    assert result["output_ids"] == expected["output_ids"]
    assert result["text"] == expected["text"]
    meta = result["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["weight_version"] == "0" and isinstance(meta["id"], str) and meta["cached_tokens"] == 0
    logprobs = meta["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == result["output_ids"]
    assert all(entry[2] is None for entry in logprobs)
    assert [entry[0] for entry in logprobs] == pytest.approx(expected["output_log_probs"], abs=1e-5)
    assert all(entry[0] <= 0 for entry in logprobs)
    assert "output_token_logprobs" not in generate(client, input_ids=prompt, sampling_params=GREEDY)["meta_info"]


def test_generate_text_and_batches(client, reference_engine):
    tokenizer = reference_engine.tokenizer
    text = "What is 12 + 7?"
    by_text = generate(client, text=text, sampling_params=GREEDY)
    ids = tokenizer.encode(text, add_special_tokens=False)
    by_ids = generate(client, input_ids=ids, sampling_params=GREEDY)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)

    prompts = [[1, 2, 3], [40, 41], [7] * 20]
    batch = generate(client, input_ids=prompts, sampling_params=GREEDY, rid=["a1", "a2", "a3"])
    assert isinstance(batch, list) and [b["meta_info"]["id"] for b in batch] == ["a1", "a2", "a3"]
    assert [b["output_ids"] for b in batch] == [generate(client, input_ids=p, sampling_params=GREEDY)["output_ids"]
                                                for p in prompts]
    short = {**GREEDY, "max_new_tokens": 3}
    texts = generate(client, text=[text, "The quick brown fox"], sampling_params=[GREEDY, short])
    assert texts[0]["output_ids"] == by_text["output_ids"] and texts[1]["meta_info"]["completion_tokens"] == 3


def test_parallel_sampling_n_is_n_requests_sharing_the_prompt(client, reference_engine):
    """SGLang's sampling_params.n: a list of n results per prompt, prompt-major, sample j seeded sampling_seed + j
    (the same tokens as n single requests with those seeds); the copies after the first hit the prefix cache."""
    client.post("/flush_cache")
    prompts = [list(range(3, 40)), list(range(50, 90))]  # over two 16-token blocks each
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 7}
    results = generate(client, input_ids=prompts, sampling_params={**params, "n": 3}, return_logprob=True)
    assert isinstance(results, list) and len(results) == 6
    expected = reference_engine.generate([p for p in prompts for _ in range(3)],
                                         [{**params, "sampling_seed": 7 + j} for _ in prompts for j in range(3)])
    assert [r["output_ids"] for r in results] == [e["output_ids"] for e in expected]
    for result, e in zip(results, expected):
        assert [entry[0] for entry in result["meta_info"]["output_token_logprobs"]] == pytest.approx(
            e["output_log_probs"], abs=1e-5)
    assert len({tuple(r["output_ids"]) for r in results[:3]}) == 3  # n different samples of one prompt
    assert len({r["meta_info"]["id"] for r in results}) == 6
    assert sum(r["meta_info"]["cached_tokens"] for r in results) >= 4 * 32  # copies 2 and 3 of each prompt
    single = generate(client, input_ids=prompts[0], sampling_params={**params, "n": 2})
    assert isinstance(single, list) and [r["output_ids"] for r in single] == [e["output_ids"] for e in expected[:2]]


def test_stop_token_ids_finish_with_matched_token(client):
    first = generate(client, input_ids=[3, 4, 5], sampling_params=GREEDY)["output_ids"]
    stopped = generate(client, input_ids=[3, 4, 5], sampling_params={**GREEDY, "stop_token_ids": [first[2]]})
    assert stopped["output_ids"] == first[: first.index(first[2]) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[2]}


def test_streaming_is_cumulative_and_ends_with_done(client):
    body = {"input_ids": [9, 8, 7], "sampling_params": GREEDY, "return_logprob": True}
    final = generate(client, **body)
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = read_sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 8
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 9))
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["text"] == final["text"]
    streamed, whole = chunks[-1]["meta_info"]["output_token_logprobs"], final["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in streamed] == [entry[1] for entry in whole]
    assert [entry[0] for entry in streamed] == pytest.approx([entry[0] for entry in whole], abs=1e-5)


def test_concurrent_requests_batch_and_match_sequential(client, server):
    prompts = [[i + 1, i + 2, i + 3, 2 * i + 5] for i in range(8)]
    sequential = [generate(client, input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    results = [None] * len(prompts)

    def worker(index):
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as http:
            body = {"input_ids": prompts[index], "sampling_params": GREEDY}
            results[index] = http.post("/generate", json=body).json()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r["output_ids"] for r in results] == sequential


def test_info_and_health_endpoints(client, tiny_qwen3):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = client.get(path).json()
        assert info["model_path"] == str(tiny_qwen3) and info["is_generation"] is True
        assert info["weight_version"] == client.get("/get_weight_version").json()["weight_version"]
    for path in ("/get_server_info", "/server_info"):
        info = client.get(path).json()
        assert info["model_path"] == str(tiny_qwen3) and info["context_length"] == 1024
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == str(tiny_qwen3)


def test_prefix_cache_hit_then_flush(client):
    prompt = list(range(10, 50))  # 40 tokens: two full 16-token blocks are cacheable
    generate(client, input_ids=prompt, sampling_params=GREEDY)
    assert generate(client, input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] >= 32
    for method in ("POST", "GET"):
        assert client.request(method, "/flush_cache").status_code == 200
        assert generate(client, input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0


def stream_in_background(server, body, num_tokens_seen: threading.Event, results: list):
    """POST a streaming /generate in a thread; set `num_tokens_seen` after the first chunk; append the last."""

    def run():
        with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as http:
            with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
                last = None
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[len("data: "):])
                        num_tokens_seen.set()
                results.append(last)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def post_in_background(server, path, body, results: list):
    def run():
        with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as http:
            results.append(http.post(path, json=body).json())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_abort_one_rid_returns_partial_tokens(client, server):
    started, results = threading.Event(), []
    thread = stream_in_background(
        server, {"input_ids": [1, 2, 3], "sampling_params": LONG, "rid": "to-abort", "return_logprob": True},
        started, results,
    )
    assert started.wait(30)
    assert client.post("/abort_request", json={"rid": "to-abort"}).json()["num_aborted"] == 1
    thread.join(30)
    final = results[0]
    meta = final["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 600 == LONG["max_new_tokens"]
    assert len(meta["output_token_logprobs"]) == len(final["output_ids"]) == meta["completion_tokens"]
    assert client.post("/abort_request", json={"rid": "to-abort"}).json()["num_aborted"] == 0


def test_duplicate_in_flight_rid_is_rejected(client, server):
    started, results = threading.Event(), []
    thread = stream_in_background(server, {"input_ids": [1, 2], "sampling_params": LONG, "rid": "dup"}, started, results)
    assert started.wait(30)
    for stream in (False, True):
        response = client.post("/generate", json={"input_ids": [3], "rid": "dup", "stream": stream})
        assert response.status_code == 400 and "dup" in response.json()["error"]["message"]
    client.post("/abort_request", json={"rid": "dup"})
    thread.join(30)
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_all_returns_every_request(client, server):
    results, threads = [], []
    for index in range(2):
        threads.append(post_in_background(
            server, "/generate", {"input_ids": [4 + index, 5], "sampling_params": LONG, "rid": f"all-{index}"}, results
        ))
    deadline = time.monotonic() + 30
    while client.get("/server_info").json()["internal_states"][0]["num_in_flight_requests"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    assert client.post("/abort_request", json={"abort_all": True}).json()["num_aborted"] == 2
    for thread in threads:
        thread.join(30)
    assert sorted(r["meta_info"]["id"] for r in results) == ["all-0", "all-1"]
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    assert all(len(r["output_ids"]) == r["meta_info"]["completion_tokens"] < 600 for r in results)


def test_pause_holds_requests_until_continue(client, server):
    expected = generate(client, input_ids=[11, 12], sampling_params=GREEDY)
    assert client.post("/pause_generation", json={}).status_code == 200
    results = []
    thread = post_in_background(server, "/generate", {"input_ids": [11, 12], "sampling_params": GREEDY}, results)
    time.sleep(1.0)
    assert thread.is_alive() and not results
    assert client.get("/health_generate").status_code == 200  # paused is healthy
    assert client.post("/continue_generation", json={}).status_code == 200
    thread.join(30)
    assert results[0]["output_ids"] == expected["output_ids"]


def test_pause_in_place_keeps_partial_progress(client, server):
    started, results = threading.Event(), []
    thread = stream_in_background(server, {"input_ids": [2, 3], "sampling_params": {**LONG, "max_new_tokens": 200}},
                                  started, results)
    assert started.wait(30)
    client.post("/pause_generation", json={"mode": "in_place"})
    time.sleep(0.5)
    assert thread.is_alive()
    client.post("/continue_generation")
    thread.join(60)
    assert results[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert results[0]["meta_info"]["completion_tokens"] == 200


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", "{not json", "JSON"),
        ("/release_memory_occupation", {"tags": ["kv_cache"], "discard_weights": True}, "discard_weights"),
        ("/release_memory_occupation", {"discard_weights": "yes"}, "discard_weights"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}, "temprature"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
        ("/generate", {"input_ids": [1] * 1024}, "max_model_len"),
        ("/generate", {"input_ids": [1, 2], "text": "hi"}, "text"),
        ("/generate", {"sampling_params": {}}, "input_ids"),
        ("/generate", {"input_ids": [1, 10**9]}, "vocabulary"),
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"input_ids": [1], "bogus": 1}, "bogus"),
        ("/generate", {"input_ids": [[1], [2]], "stream": True}, "stream"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params.n"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"n": 2}, "rid": "r"}, "rid"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"n": 2}, "stream": True}, "stream"),
        ("/abort_request", {}, "rid"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/does/not/exist"}, "model_path"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["bm90IGEgcGlja2xl"]}, "serialized_named_tensors"),
        ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}, "group_name"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                        "world_size": 2, "backend": "gloo"}, "rank_offset"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                        "world_size": 2, "backend": "mpi"}, "backend"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ],
)
def test_bad_requests_get_400_naming_the_field(client, path, body, field):
    if isinstance(body, str):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the server runs on CUDA there, where nccl is valid")
def test_nccl_group_on_a_cpu_engine_is_rejected(client):
    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"}
    response = client.post("/init_weights_update_group", json=body)
    assert response.status_code == 400 and "nccl" in response.json()["error"]["message"]


def test_server_keeps_serving_after_bad_requests(client):
    for _ in range(3):
        headers = {"content-type": "application/json"}
        assert client.post("/generate", content=b"\xff\xfe", headers=headers).status_code == 400
        assert client.post("/generate", json={"input_ids": [1], "sampling_params": {"top_p": 0}}).status_code == 400
    assert generate(client, input_ids=[1, 2, 3], sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 8


def wait_until_idle(client, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get("/server_info").json()["internal_states"][0]["num_in_flight_requests"]:
        assert time.monotonic() < deadline, "request still in flight after its client went away"
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(client, server, stream):
    body = {"input_ids": [1, 2], "sampling_params": {**LONG, "max_new_tokens": 1000}, "stream": stream}
    # Paused, the request cannot finish by itself: leaving the in-flight set proves the disconnect aborted it.
    try:
        with httpx.Client(base_url=server.url, timeout=1.0, trust_env=False) as impatient:
            if stream:
                with impatient.stream("POST", "/generate", json=body) as response:
                    next(response.iter_lines())
                    client.post("/pause_generation")
            else:
                client.post("/pause_generation")
                with pytest.raises(httpx.ReadTimeout):
                    impatient.post("/generate", json=body)
        wait_until_idle(client, timeout_s=5)
    finally:
        client.post("/continue_generation")


def test_cli_maps_engine_flags_and_sglang_aliases():
    from slime.engine.server.config import parse_settings

    settings = parse_settings(
        ["--model-path", "m", "--max-running-requests", "8", "--context-length", "512", "--enforce-eager",
         "--dtype", "float32", "--mem-fraction-static", "0.5", "--port", "1234"]
    )
    assert settings.engine == {"max_num_seqs": 8, "max_model_len": 512, "enforce_eager": True, "dtype": "float32",
                               "gpu_memory_utilization": 0.5}  # flags not given keep the engine's defaults
    assert (settings.port, settings.host) == (1234, "127.0.0.1")
    assert parse_settings(["--model-path", "m", "--no-overlap-schedule"]).engine == {"overlap_schedule": False}


def test_config_file_carries_typed_values_and_keys_and_flags_win(tmp_path):
    from slime.engine.server.config import parse_settings, write_config_file

    path = write_config_file(tmp_path / "engine.json", "ckpt", {"overlap_schedule": False, "enforce_eager": False,
                                                                "max_num_seqs": 4},
                             {"api_key": "k1", "admin_api_key": "k2", "weights_dir_allowlist": [str(tmp_path)]})
    assert path.stat().st_mode & 0o777 == 0o600  # keys: owner only
    settings = parse_settings(["--config-file", str(path), "--max-num-seqs", "9"])
    assert settings.model_path == "ckpt"
    assert settings.engine == {"overlap_schedule": False, "enforce_eager": False, "max_num_seqs": 9}
    assert (settings.policy.api_key, settings.policy.admin_api_key) == ("k1", "k2")
    assert settings.allowed_weight_dirs() == [tmp_path.resolve()]
    path.write_text('{"engine": {"max_num_seq": 4}}')
    with pytest.raises(SystemExit):
        parse_settings(["--config-file", str(path)])
