"""Where each adapter finds a request's session (slime's rules, plus x-api-key for both protocols), that a request
naming none is told so (401) unless the rollout opened slime's "default" session, and slime's max_turns_per_sid."""

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.adapters import openai as openai_wire


class Headers:
    def __init__(self, headers):
        self.headers = headers


class NoTemplate:
    def apply_chat_template(self, messages, tools=None, tokenize=True, add_generation_prompt=True):
        raise AssertionError("no turn should reach the template")


def test_openai_reads_the_api_key_header_after_the_bearer():
    assert openai_wire._request_session_id(Headers({"x-api-key": "k"}), {"user": "u"}) == "k"
    assert openai_wire._request_session_id(Headers({"authorization": "Bearer b", "X-API-KEY": "k"}), {}) == "b"


def test_no_session_is_401_and_an_unknown_one_404():
    async def case():
        adapter = OpenAIAdapter(tokenizer=NoTemplate(), sglang_url="http://unused")
        client = TestClient(TestServer(adapter.app))
        await client.start_server()
        try:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            assert (await client.post("/v1/chat/completions", json=body)).status == 401
            response = await client.post("/v1/chat/completions", json={**body, "user": "someone"})
            assert response.status == 404 and "someone" in (await response.json())["error"]["message"]
        finally:
            await client.close()

    asyncio.run(case())


def test_max_turns_per_sid_is_max_turns():
    assert AnthropicAdapter(tokenizer=NoTemplate(), sglang_url="http://x", max_turns_per_sid=3).max_turns == 3
    with pytest.raises(ValueError, match="disagree"):
        AnthropicAdapter(tokenizer=NoTemplate(), sglang_url="http://x", max_turns=2, max_turns_per_sid=3)
