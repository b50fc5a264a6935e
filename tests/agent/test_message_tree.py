"""routing_message (slime.agent.message_tree): the reply an adapter answered and the same reply replayed by a client
of each protocol route to one tree node, so a replayed turn descends through the turn that generated it."""

import json

import pytest

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.adapters.responses import ResponsesWire
from slime.agent.message_tree import MessageNode, mount_prompt, routing_message

ARGUMENTS = {"a": 12, "b": 7}
USER = {"role": "user", "content": "What is 12 + 7?"}
# what BaseAdapter._turn records for an answer with this text and call
ANSWERED = routing_message({"role": "assistant", "content": "Let me add.",
                            "tool_calls": [{"name": "add", "arguments": ARGUMENTS}]})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from slime.utils.tiny_model import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def replayed_openai(tokenizer):
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://127.0.0.1:1")
    return adapter.parse_request({"model": "m", "messages": [USER, {
        "role": "assistant", "content": "Let me add.\n", "reasoning_content": "12 and 7",
        "tool_calls": [{"id": "call_9", "type": "function",
                        "function": {"name": "add", "arguments": json.dumps(ARGUMENTS)}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "19"}]}).messages


def replayed_anthropic(tokenizer):
    adapter = AnthropicAdapter(tokenizer=tokenizer, sglang_url="http://127.0.0.1:1")
    return adapter.parse_request({"model": "m", "max_tokens": 8, "messages": [USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "12 and 7", "signature": ""}, {"type": "text", "text": "Let me add."},
        {"type": "tool_use", "id": "toolu_9", "name": "add", "input": ARGUMENTS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "19"}]}]}).messages


def replayed_responses(tokenizer):
    return ResponsesWire("m").parse_request({"model": "m", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER["content"]}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "c9", "name": "add", "arguments": json.dumps(ARGUMENTS)},
        {"type": "function_call_output", "call_id": "c9", "output": "19"}]}).messages


@pytest.mark.parametrize("replay", [replayed_openai, replayed_anthropic, replayed_responses])
def test_a_replayed_reply_routes_through_the_turn_that_answered_it(tokenizer, replay):
    messages = [routing_message(m) for m in replay(tokenizer)]
    assert messages[1] == ANSWERED
    root = MessageNode()
    user = mount_prompt(root, messages[:1], fork_threshold=1024)
    generated = user.add_child(MessageNode(role="assistant", message=ANSWERED))
    tool = mount_prompt(root, messages, fork_threshold=1024)
    assert tool.parent is generated and tool.role == "tool" and len(user.children) == 1
    assert "merged_rewrite" not in generated.metadata


def test_a_changed_call_is_a_different_message():
    changed = routing_message({"role": "assistant", "content": "Let me add.",
                               "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]})
    assert changed != ANSWERED
    assert routing_message({"role": "tool", "content": "19"}) == {"role": "tool", "content": "19"}
