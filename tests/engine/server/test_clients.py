"""Real clients against the engine server (a subprocess on a tiny model): the real sglang-router forwarding
/generate to it, and the `openai` Python client on /v1/chat/completions (plain and streaming) and /v1/completions."""

import subprocess
import sys
import time

import httpx
import pytest

from slime.utils.misc import find_free_port

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def router_url(tmp_path_factory):
    port = find_free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--policy", "round_robin"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/workers", timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "router did not start"
        time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(15)
    log.close()


def test_generate_through_sglang_router(router_url, server, client):
    response = httpx.post(router_url + "/workers", json={"url": server.url}, timeout=10, trust_env=False)
    assert response.status_code == 202
    deadline = time.monotonic() + 30
    while True:
        workers = httpx.get(router_url + "/workers", timeout=5, trust_env=False).json()["workers"]
        if any(w["url"] == server.url and w["is_healthy"] for w in workers):
            break
        assert time.monotonic() < deadline, f"worker never registered: {workers}"
        time.sleep(0.2)
    worker = next(w for w in workers if w["url"] == server.url)
    assert worker["model_id"] == client.get("/get_model_info").json()["model_path"]

    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY, "return_logprob": True}
    direct = client.post("/generate", json=body).json()
    routed = httpx.post(router_url + "/generate", json=body, timeout=60, trust_env=False)
    assert routed.status_code == 200, routed.text
    routed = routed.json()
    assert routed["output_ids"] == direct["output_ids"] and routed["text"] == direct["text"]
    assert routed["meta_info"]["completion_tokens"] == 6
    assert [e[1] for e in routed["meta_info"]["output_token_logprobs"]] == direct["output_ids"]

    text_body = {"text": "What is 12 + 7?", "sampling_params": GREEDY}
    routed_text = httpx.post(router_url + "/generate", json=text_body, timeout=60, trust_env=False).json()
    assert routed_text["output_ids"] == client.post("/generate", json=text_body).json()["output_ids"]


@pytest.fixture(scope="module")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=httpx.Client(trust_env=False))


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 7?"}]


def chat_prompt_ids(client, tiny_qwen3) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_openai_chat_completion(openai_client, client, tiny_qwen3):
    native = client.post(
        "/generate", json={"input_ids": chat_prompt_ids(client, tiny_qwen3), "sampling_params": GREEDY,
                           "return_logprob": True}
    ).json()
    completion = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.0, logprobs=True
    )
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == native["text"]
    assert choice.finish_reason == native["meta_info"]["finish_reason"]["type"]
    assert completion.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert completion.usage.completion_tokens == 6
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 6
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
        [e[0] for e in native["meta_info"]["output_token_logprobs"]], abs=1e-5
    )
    assert completion.model == "tiny" and completion.id.startswith("chatcmpl-")


def test_openai_chat_completion_streaming(openai_client):
    whole = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0)
    stream = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish_reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_openai_completions(openai_client, client):
    prompt = "The quick brown fox"
    native = client.post("/generate", json={"text": prompt, "sampling_params": GREEDY, "return_logprob": True}).json()
    completion = openai_client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0.0, logprobs=0
    )
    choice = completion.choices[0]
    assert choice.text == native["text"] and completion.usage.completion_tokens == 6
    assert choice.logprobs.token_logprobs == pytest.approx([e[0] for e in native["meta_info"]["output_token_logprobs"]],
                                                           abs=1e-5)
    streamed = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == native["text"]
    two = openai_client.completions.create(model="tiny", prompt=[prompt, prompt], max_tokens=3, temperature=0.0, n=2)
    assert len(two.choices) == 4 and [c.index for c in two.choices] == [0, 1, 2, 3]
    assert completion.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
