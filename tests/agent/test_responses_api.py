"""The OpenAI adapter's Responses API (`POST /v1/responses`, what current Codex speaks): the official `openai` client
-> the adapter -> the real router -> a real engine on the tiny model; Codex-shaped inputs (developer messages,
function_call / function_call_output items, non-function tools) translated to chat-template messages; a parsed tool
call answered as a `function_call` item that the SDK's own types read, plain and streamed.
"""

import asyncio
import json
import threading

import openai
import pytest
from aiohttp import web

from slime.agent.adapters import OpenAIAdapter
from slime.agent.adapters.common import ChatRequest, RequestError
from slime.agent.adapters.responses import ResponsesWire, input_messages
from slime.ray.router import RouterProcess, register_worker
from slime.utils.misc import find_free_port

SEED = 4321
DEVELOPER = "You are a coding agent. " * 12
TOOLS = [{"type": "function", "name": "exec_command", "description": "Run a shell command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
         {"type": "web_search"}, {"type": "namespace", "name": "multi_agent_v1", "tools": []}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "exec_command", "description": "Run a shell command",
                                                "parameters": TOOLS[0]["parameters"]}}]


def codex_input(*extra):
    return [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": DEVELOPER}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "permissions"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env>cwd</env>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the bug"}]}, *extra]


def test_codex_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "ls"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]}
    messages = input_messages({"input": codex_input(said, call, output)})
    assert messages == [
        {"role": "system", "content": DEVELOPER + "\n\npermissions"},
        {"role": "user", "content": "<env>cwd</env>"}, {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": {"cmd": "ls"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"}]
    # a call with no text before it opens its own assistant message; instructions lead the system prompt
    messages = input_messages({"instructions": "be brief", "input": [{"role": "user", "content": "hi"}, call]})
    assert messages[0] == {"role": "system", "content": "be brief"} and messages[2]["content"] == ""


def test_non_function_tools_are_left_out_and_named():
    chat = ResponsesWire("tiny").parse_request({"input": "hi", "tools": TOOLS, "max_output_tokens": 7})
    assert chat.tools == CHAT_TOOLS and chat.ignored_tools == ["web_search", "multi_agent_v1"]
    assert chat.sampling_params == {"max_new_tokens": 7}


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
])
def test_unservable_requests_name_the_field(body, param):
    with pytest.raises(RequestError) as error:
        ResponsesWire("tiny").parse_request(body)
    assert error.value.param == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_parsed_tool_call_is_a_function_call_item(tokenizer, stream):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://unused")
    chat = ChatRequest(messages=[{"role": "user", "content": "list"}], tools=CHAT_TOOLS, parse_tool_calls=True,
                       sampling_params={}, stream=stream, ignored_tools=["web_search"])
    text = 'Let me look. <tool_call>{"name": "exec_command", "arguments": {"cmd": "ls"}}</tool_call>'
    engine = {"text": text, "output_ids": [5, 6, 7],
              "meta_info": {"finish_reason": {"type": "stop", "matched": "</tool_call>"}, "cached_tokens": 2,
                            "output_token_logprobs": [[-0.5, i, None] for i in (5, 6, 7)]}}
    answer, _ = adapter._interpret(engine, chat, [1, 2, 3], ["</tool_call>"])
    wire = adapter.responses_wire
    if stream:
        frames = [f.decode().split("\n") for f in wire.render_stream(answer)]
        events = [TypeAdapter(ResponseStreamEvent).validate_json(lines[1].removeprefix("data: ")) for lines in frames]
        assert [lines[0] for lines in frames] == [f"event: {e.type}" for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert [json.loads(d) for d in deltas] == [{"cmd": "ls"}]
        response = events[-1].response
    else:
        response = Response.model_validate(wire.render_answer(answer))
    assert response.status == "completed" and response.output_text == "Let me look."
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "exec_command" and json.loads(call.arguments) == {"cmd": "ls"}
    assert call.call_id.startswith("call_")
    assert response.usage.input_tokens == 3 and response.usage.input_tokens_details.cached_tokens == 2
    assert response.metadata == {"ignored_tools": "web_search"}
    # the call replayed by the client renders back to the same assistant message
    replay = input_messages({"input": [{"role": "user", "content": "list"},
                                       *[item.model_dump(exclude_none=True) for item in response.output]]})
    assert replay[1]["tool_calls"][0]["function"] == {"name": "exec_command", "arguments": {"cmd": "ls"}}


# ---- end to end over the real engine ------------------------------------------------------------------------------
class ServedApp:
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
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.fixture(scope="module")
def served(server, tokenizer):
    router = RouterProcess(policy="manual")
    register_worker(router.url, server.url)
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url=router.url, headers=router.headers)
    app = ServedApp(adapter.app)
    yield adapter, app
    app.close()
    router.shutdown()


def test_sdk_responses_plain_and_streamed_multi_turn(served, tokenizer, monkeypatch):
    """Two turns of a Codex-shaped conversation through the SDK: the trained ids decode to exactly the texts the
    client read, the long developer prompt is one shared prefix (the second turn hits the prefix cache). A fork
    threshold of 1 keeps a re-tokenized first reply trained in its own Sample."""
    adapter, app = served
    monkeypatch.setattr(adapter.manager, "fork_threshold_tokens", 1)
    adapter.open_session("rs-1", sampling_defaults={"temperature": 1.0, "sampling_seed": SEED})
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="rs-1", max_retries=0)
    first = client.responses.create(model="tiny", input=codex_input(), tools=TOOLS, max_output_tokens=6, store=False)
    assert first.status in ("completed", "incomplete") and first.usage.output_tokens >= 1
    followup = [*codex_input(), {"type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": first.output_text}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "continue"}]}]
    events = list(client.responses.create(model="tiny", input=followup, tools=TOOLS, max_output_tokens=5,
                                          stream=True))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert events[-1].type in ("response.completed", "response.incomplete")  # incomplete: max_output_tokens hit
    second = events[-1].response
    assert "".join(deltas) == second.output_text
    samples = app.call(adapter.finish_session("rs-1"))
    trained = sorted((turn, tokenizer.decode([t for t, m in zip(s.tokens[s.prompt_length:], s.loss_mask) if m],
                                             skip_special_tokens=True))
                     for s in samples for turn in s.metadata["turn_indices"][:1])
    assert "".join(text for _, text in trained) == first.output_text + second.output_text
    system_ids = tokenizer.apply_chat_template([{"role": "system", "content": DEVELOPER + "\n\npermissions"}],
                                               tools=CHAT_TOOLS, tokenize=True, return_dict=False)
    assert second.usage.input_tokens_details.cached_tokens >= len(system_ids) - 16  # page-aligned prefix hit
