"""OpenAIAdapter / AnthropicAdapter end to end: the official `openai` and `anthropic` clients -> the adapter app
(aiohttp on a free port) -> the real sglang-router -> a real engine server on the tiny model; then finish_session's
Samples are checked against what was sampled (a direct /generate with the same ids and seed) and rendered.

The tiny random model does not write tool calls on its own, so the tool-call answers (parsed from a sampled text,
rendered in each protocol and checked against the SDKs' own types) are tested on a given engine answer, and the end
to end rounds send tool results back to check that the tool's tokens are context (loss mask 0).
"""

import asyncio
import json
import threading

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.adapters.common import ChatRequest
from slime.ray.router import RouterProcess, register_worker
from slime.utils.misc import find_free_port

MAX_TURNS = 3
SEED = 1234
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "Add two integers",
                    "input_schema": OPENAI_TOOLS[0]["function"]["parameters"]}]
USER = {"role": "user", "content": "What is 12 + 7?"}


class ServedApp:
    """An aiohttp app served on 127.0.0.1 from an event loop on its own thread (the SDK clients are synchronous)."""

    def __init__(self, app: web.Application):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{find_free_port()}"

        async def start():
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", int(self.url.rsplit(":", 1)[1])).start()
            return runner

        self.runner = self.call(start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def close(self):
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def router(server):
    # sglang-router 0.3.2 has no consistent_hashing policy; its `manual` policy routes by the same
    # X-SMG-Routing-Key header (sticky sessions), so a session stays on one engine.
    process = RouterProcess(policy="manual")
    register_worker(process.url, server.url)
    yield process
    process.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def serve(adapter_class, tokenizer, router):
    adapter = adapter_class(tokenizer=tokenizer, sglang_url=router.url, tool_parser="qwen", max_turns=MAX_TURNS,
                            headers=router.headers)
    return adapter, ServedApp(adapter.app)


@pytest.fixture(scope="module")
def openai_app(tokenizer, router):
    adapter, served = serve(OpenAIAdapter, tokenizer, router)
    yield adapter, served
    served.close()


@pytest.fixture(scope="module")
def anthropic_app(tokenizer, router):
    adapter, served = serve(AnthropicAdapter, tokenizer, router)
    yield adapter, served
    served.close()


def render(tokenizer, messages, tools=None):
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def runs(sample, mask_value):
    """The response's contiguous id runs whose loss mask is `mask_value`, with their log-probs."""
    out, ids, log_probs = [], [], []
    for token, mask, log_prob in zip(sample.tokens[sample.prompt_length:], sample.loss_mask, sample.rollout_log_probs):
        if mask == mask_value:
            ids, log_probs = ids + [token], log_probs + [log_prob]
        elif ids:
            out, ids, log_probs = out + [(ids, log_probs)], [], []
    return out + [(ids, log_probs)] if ids else out


def trained_texts(tokenizer, samples):
    """The decoded trained runs of all samples, in turn order."""
    pairs = [(turn, run) for s in samples for turn, run in zip(s.metadata["turn_indices"], runs(s, 1))]
    return [tokenizer.decode(ids, skip_special_tokens=True) for _, (ids, _) in sorted(pairs, key=lambda p: p[0])]


def generate_directly(router, prompt_ids, max_new_tokens, seed=SEED):
    body = {"input_ids": prompt_ids, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "sampling_seed": seed, "max_new_tokens": max_new_tokens}}
    result = httpx.post(f"{router.url}/generate", json=body, headers=router.headers, timeout=120,
                        trust_env=False).json()
    return result["output_ids"], [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


def assert_sampled_once_and_tool_untrained(tokenizer, samples, answers, tool_text):
    assert trained_texts(tokenizer, samples) == answers
    for sample in samples:
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        assert all(lp < 0 for ids, lps in runs(sample, 1) for lp in lps)
        assert all(lp == 0.0 for ids, lps in runs(sample, 0) for lp in lps)
    with_tool = [s for s in samples if 1 in s.metadata["turn_indices"]]
    assert len(with_tool) == 1
    sample = with_tool[0]
    untrained = [sample.tokens[:sample.prompt_length]] + [ids for ids, _ in runs(sample, 0)]
    assert any(f"<|im_start|>tool\n{tool_text}<|im_end|>" in tokenizer.decode(ids) for ids in untrained)
    assert tool_text not in "".join(tokenizer.decode(ids) for s in samples for ids, _ in runs(s, 1))


def test_openai_client_multi_turn_with_a_tool_result(openai_app, router, tokenizer, monkeypatch):
    """The random model's first reply re-tokenizes differently in the history; with a fork threshold of 1 the next
    turn forks a sibling Sample, so each sampled id is trained once, in its own Sample."""
    adapter, served = openai_app
    monkeypatch.setattr(adapter.manager, "fork_threshold_tokens", 1)
    adapter.open_session("oa-1", sampling_defaults={"temperature": 1.0, "sampling_seed": SEED})
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="oa-1", max_retries=0)
    first = client.chat.completions.create(model="tiny", messages=[USER], tools=OPENAI_TOOLS, max_tokens=6)
    assert first.choices[0].finish_reason in ("stop", "length") and first.usage.completion_tokens >= 1
    history = [USER, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "tool", "tool_call_id": "call_0", "content": "sum = 19"}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=OPENAI_TOOLS, max_tokens=5,
                                            seed=SEED + 1)
    samples = served.call(adapter.finish_session("oa-1"))

    answers = [first.choices[0].message.content, second.choices[0].message.content]
    assert_sampled_once_and_tool_untrained(tokenizer, samples, answers, "sum = 19")
    # the trained ids and log-probs are the engine's: the same prompt and seed sampled directly give the same
    prompt_ids = render(tokenizer, [USER], OPENAI_TOOLS)
    first_leaf = next(s for s in samples if s.metadata["turn_indices"][0] == 0)
    assert first_leaf.tokens[:first_leaf.prompt_length] == prompt_ids
    output_ids, log_probs = generate_directly(router, prompt_ids, 6)
    trained_ids, trained_log_probs = runs(first_leaf, 1)[0]
    assert trained_ids == output_ids and trained_log_probs == pytest.approx(log_probs, abs=1e-5)
    assert first.usage.prompt_tokens == len(prompt_ids)
    # the session is gone: its key is unknown now
    with pytest.raises(openai.NotFoundError, match="unknown session"):
        client.chat.completions.create(model="tiny", messages=[USER], max_tokens=2)


def test_history_that_re_renders_the_sampled_ids_stays_one_sample(openai_app, router, tokenizer):
    """A random model's text often re-tokenizes differently (a fork, above); a seed whose sample round-trips
    through decode -> encode gives a history that extends the sampled ids exactly: one Sample, no drift."""
    adapter, served = openai_app
    prompt_ids = render(tokenizer, [USER])
    seed = next(seed for seed in range(SEED, SEED + 200) if round_trips(tokenizer, generate_directly(
        router, prompt_ids, 3, seed)[0]))
    adapter.open_session("oa-clean", sampling_defaults={"temperature": 1.0, "sampling_seed": seed})
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="oa-clean", max_retries=0)
    first = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=3)
    history = [USER, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "tool", "content": "sum = 19"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    [sample] = served.call(adapter.finish_session("oa-clean"))
    second_prompt = render(tokenizer, history)
    assert sample.tokens[:len(second_prompt)] == second_prompt and sample.prompt_length == len(prompt_ids)
    assert sample.metadata["turn_indices"] == [0, 1] and sample.metadata["num_absorbed_drift_tokens"] == 0
    answers = [first.choices[0].message.content, second.choices[0].message.content]
    assert_sampled_once_and_tool_untrained(tokenizer, [sample], answers, "sum = 19")


def round_trips(tokenizer, ids):
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return "\ufffd" not in text and tokenizer.encode(text, add_special_tokens=False) == ids


def test_openai_stream_matches_the_answer_and_is_recorded(openai_app, tokenizer):
    adapter, served = openai_app
    for session_id in ("oa-plain", "oa-stream"):
        adapter.open_session(session_id, sampling_defaults={"temperature": 1.0, "sampling_seed": SEED})
    plain = openai.OpenAI(base_url=f"{served.url}/v1", api_key="oa-plain", max_retries=0)
    answer = plain.chat.completions.create(model="tiny", messages=[USER], max_tokens=6)
    streaming = openai.OpenAI(base_url=f"{served.url}/v1", api_key="oa-stream", max_retries=0)
    chunks = list(streaming.chat.completions.create(model="tiny", messages=[USER], max_tokens=6, stream=True,
                                                    stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == answer.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    plain_samples = served.call(adapter.finish_session("oa-plain"))
    [sample] = served.call(adapter.finish_session("oa-stream"))
    assert sample.tokens == plain_samples[0].tokens  # log-probs: equal up to the prefix cache's float rounding
    assert sample.rollout_log_probs == pytest.approx(plain_samples[0].rollout_log_probs, abs=1e-5)


def test_anthropic_client_multi_turn_stream_and_tool_result(anthropic_app, tokenizer):
    adapter, served = anthropic_app
    adapter.open_session("an-1", sampling_defaults={"temperature": 1.0, "sampling_seed": SEED})
    client = anthropic.Anthropic(base_url=served.url, api_key="an-1", max_retries=0)
    first = client.messages.create(model="tiny", max_tokens=6, system="You can add.", tools=ANTHROPIC_TOOLS,
                                   messages=[USER])
    assert first.stop_reason in ("end_turn", "max_tokens") and first.content[0].type == "text"
    messages = [USER, {"role": "assistant", "content": [{"type": "text", "text": first.content[0].text}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "sum = 19"}]}]
    with client.messages.stream(model="tiny", max_tokens=5, system="You can add.", tools=ANTHROPIC_TOOLS,
                                messages=messages) as stream:
        streamed_text = "".join(stream.text_stream)
        second = stream.get_final_message()
    assert second.content[0].text == streamed_text and second.usage.output_tokens >= 1
    samples = served.call(adapter.finish_session("an-1"))
    # the random model's first reply re-tokenizes differently in the history and the second output is shorter than
    # the fork threshold: the first reply is realigned to its re-rendering, as context, and one Sample trains the
    # second reply only (slime's TrajectoryManager)
    assert [s.metadata["turn_indices"] for s in samples] == [[1]]
    assert samples[0].metadata["num_absorbed_drift_tokens"] >= 1
    context_ids = samples[0].tokens[:len(samples[0].tokens) - sum(samples[0].loss_mask)]  # the trained ids end it
    assert first.content[0].text in tokenizer.decode(context_ids)
    assert_sampled_once_and_tool_untrained(tokenizer, samples, [streamed_text], "sum = 19")
    system_prompt = render(tokenizer, [{"role": "system", "content": "You can add."}, USER], OPENAI_TOOLS)
    assert samples[0].tokens[:samples[0].prompt_length] == system_prompt


def test_turn_cap_answers_429_with_a_clear_message(openai_app, anthropic_app):
    for (adapter, served), make_client, error_type in (
            (openai_app, lambda url: openai.OpenAI(base_url=f"{url}/v1", api_key="cap", max_retries=0),
             openai.RateLimitError),
            (anthropic_app, lambda url: anthropic.Anthropic(base_url=url, api_key="cap", max_retries=0),
             anthropic.RateLimitError)):
        adapter.open_session("cap", sampling_defaults={"max_new_tokens": 1})
        client = make_client(served.url)
        create = (client.chat.completions.create if isinstance(client, openai.OpenAI) else client.messages.create)
        for _ in range(MAX_TURNS):
            create(model="tiny", messages=[USER], max_tokens=1)
        with pytest.raises(error_type, match=f"turn cap \\(max_turns={MAX_TURNS}\\)") as raised:
            create(model="tiny", messages=[USER], max_tokens=1)
        assert raised.value.response.headers["x-should-retry"] == "false"
        assert len(served.call(adapter.finish_session("cap"))) == MAX_TURNS  # retries of one prompt: siblings


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_garbage_requests_get_400_naming_the_field(protocol, openai_app, anthropic_app):
    adapter, served = openai_app if protocol == "openai" else anthropic_app
    path = "/v1/chat/completions" if protocol == "openai" else "/v1/messages"
    adapter.open_session("bad")
    base = {"model": "tiny", "messages": [USER], "max_tokens": 4}
    cases = [("this is not json", "body"), ([1, 2], "body"), ({**base, "messages": []}, "messages"),
             ({**base, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
             ({**base, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content[0]"),
             ({**base, "temperature": "hot"}, "temperature"), ({**base, "tools": "add"}, "tools"),
             ({**base, "stop" if protocol == "openai" else "stop_sequences": [3]}, "stop")]
    if protocol == "anthropic":
        cases.append(({"messages": [USER]}, "max_tokens"))
    with httpx.Client(base_url=served.url, headers={"x-api-key": "bad"}, trust_env=False, timeout=30) as http:
        for body, field in cases:
            content = body if isinstance(body, str) else json.dumps(body)
            response = http.post(path, content=content, headers={"content-type": "application/json"})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["message"].startswith(field), (field, error)
        assert http.post(path, json=base, headers={"x-api-key": "nobody"}).status_code == 404
        assert http.post(path, json=base, headers={"x-api-key": ""}).status_code == 401
        adapter.drop_session("bad")
        assert http.post(path, json=base).status_code == 404


def engine_answer(text, matched, output_ids=(5, 6, 7)):
    return {"text": text, "output_ids": list(output_ids),
            "meta_info": {"finish_reason": {"type": "stop", "matched": matched}, "cached_tokens": 2,
                          "output_token_logprobs": [[-0.5, i, None] for i in output_ids], "weight_version": "3"}}


CALL_TEXT = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 12, "b": 7}}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_a_parsed_tool_call_is_answered_in_each_protocol(tokenizer, stream):
    chat = ChatRequest(messages=[USER], tools=OPENAI_TOOLS, parse_tool_calls=True, sampling_params={}, stream=stream,
                       include_usage=True)
    for adapter in (OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://unused"),
                    AnthropicAdapter(tokenizer=tokenizer, sglang_url="http://unused")):
        answer, turn = adapter._interpret(engine_answer(CALL_TEXT, "</tool_call>"), chat, [1, 2, 3],
                                          ["</tool_call>"])
        assert (turn.output_ids, turn.output_log_probs, turn.ill_formed) == ([5, 6, 7], [-0.5] * 3, False)
        assert answer.content == "Let me add." and answer.finish == "tool_calls"
        if isinstance(adapter, OpenAIAdapter):
            check_openai_tool_call(adapter, answer, stream)
        else:
            check_anthropic_tool_call(adapter, answer, stream)


def check_openai_tool_call(adapter, answer, stream):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    if not stream:
        message = ChatCompletion.model_validate(adapter.render_answer(answer)).choices[0]
        assert message.finish_reason == "tool_calls" and message.message.content == "Let me add."
        [call] = message.message.tool_calls
    else:
        frames = [f.decode().removeprefix("data: ").strip() for f in adapter.render_stream(answer)]
        assert frames[-1] == "[DONE]"
        chunks = [ChatCompletionChunk.model_validate_json(f) for f in frames[:-1]]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        [call] = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert chunks[-1].usage.prompt_tokens == 3
    assert call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 12, "b": 7}


def check_anthropic_tool_call(adapter, answer, stream):
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    if not stream:
        message = Message.model_validate(adapter.render_answer(answer))
        assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["text", "tool_use"]
        assert message.content[1].input == {"a": 12, "b": 7} and message.content[1].id.startswith("toolu_")
        return
    frames = [f.decode().split("\n") for f in adapter.render_stream(answer)]
    events = [TypeAdapter(RawMessageStreamEvent).validate_json(lines[1].removeprefix("data: ")) for lines in frames]
    assert [lines[0] for lines in frames] == [f"event: {e.type}" for e in events]
    assert [e.type for e in events] == ["message_start"] + ["content_block_start", "content_block_delta",
                                                            "content_block_stop"] * 2 + ["message_delta",
                                                                                         "message_stop"]
    assert json.loads(events[5].delta.partial_json) == {"a": 12, "b": 7} and events[-2].delta.stop_reason == "tool_use"


def test_ill_formed_calls_and_client_stops_are_translated(tokenizer):
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://unused", reasoning_parser="qwen3")
    chat = ChatRequest(messages=[USER], tools=OPENAI_TOOLS, parse_tool_calls=True, sampling_params={})
    answer, turn = adapter._interpret(engine_answer("<tool_call>{not json</tool_call>", "</tool_call>"), chat, [1],
                                      ["</tool_call>"])
    assert turn.ill_formed and answer.tool_calls == [] and answer.finish == "stop"
    assert answer.content == "<tool_call>{not json</tool_call>"  # the client sees what the model wrote
    answer, turn = adapter._interpret(engine_answer("<think>12 and 7</think>It is 19 END", "END"), chat, [1],
                                      ["</tool_call>"])
    assert (answer.reasoning, answer.content, answer.finish, answer.stop_sequence) == (
        "12 and 7", "It is 19 ", "stop_sequence", "END")
    assert adapter.render_answer(answer)["choices"][0]["message"]["reasoning_content"] == "12 and 7"
    none_chat = ChatRequest(messages=[USER], tools=OPENAI_TOOLS, parse_tool_calls=False, sampling_params={})
    answer, _ = adapter._interpret(engine_answer(CALL_TEXT, None), none_chat, [1], [])
    assert answer.tool_calls == [] and answer.content == CALL_TEXT  # tool_choice none: not parsed
    with pytest.raises(ValueError, match="reasoning_parser"):
        OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://unused", reasoning_parser="nope")


def test_the_end_of_turn_token_text_is_not_part_of_the_reply(tokenizer):
    """With skip_special_tokens false the engine's text ends in "<|im_end|>"; the client reads the reply without
    it, and the trajectory keeps the token."""
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://unused")
    chat = ChatRequest(messages=[USER], tools=[], parse_tool_calls=False, sampling_params={})
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer, turn = adapter._interpret(engine_answer("It is sunny.<|im_end|>", None, (5, 6, end)), chat, [1], [])
    assert answer.content == "It is sunny." and turn.output_ids[-1] == end
