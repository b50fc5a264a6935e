"""Tool-call parsing (pure string functions) and tool running: schemas from signatures, and every way a tool can
fail (raise, hang, answer 10 MB, bad arguments, unknown name, malformed call) turned into a bounded error message."""

import asyncio
import time

import pytest

from slime.rollout.tools import load_tools, run_tool_call, tool_schema
from slime.utils.tool_parsers import ToolCall, get_parser, qwen, stop_strings_for, tool_tag, xml_tags

LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"properties": {"key": {}}}}}
SEARCH = {"name": "search", "parameters": {"properties": {"query": {"type": "string"}}}}


def lookup(key: str, scale: int = 1) -> str:
    """Look a key up.

    More text that is not the description."""
    return f"value-{key}-{scale}"


async def slow_async(key: str) -> str:
    await asyncio.sleep(60)
    return key


def hangs(key: str) -> str:
    time.sleep(60)
    return key


def raises(key: str) -> str:
    raise RuntimeError(f"no such key {key}")


def huge(key: str) -> str:
    return "x" * (10 * 1024 * 1024)


TOOLS = [lookup, slow_async, hangs, raises, huge]


def test_qwen_and_tag_formats():
    text = 'Let me look. <tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
    parsed = qwen(text, [LOOKUP])
    assert parsed.content == "Let me look." and [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("lookup", {"key": "a"}, None)]
    two = qwen('<tool_call>{"name":"lookup","arguments":"{\\"key\\": \\"b\\"}"}</tool_call>'
               '<tool_call>{"name": "lookup", "arguments": {"key": "c"}}</tool_call>', [LOOKUP])
    assert [c.arguments for c in two.calls] == [{"key": "b"}, {"key": "c"}]  # JSON-string arguments decoded
    assert tool_tag('<tool>{"name": "lookup", "arguments": {"key": "d"}}</tool>', [LOOKUP]).calls[0].arguments == {
        "key": "d"}
    assert qwen("no call here", [LOOKUP]).calls == []
    assert get_parser("hermes") is qwen and stop_strings_for(qwen, [LOOKUP]) == ["</tool_call>"]


def test_malformed_and_unknown_calls_carry_an_error():
    bad_json = qwen('<tool_call>{"name": "lookup", "arguments": {"key": </tool_call>', [LOOKUP]).calls[0]
    assert "not valid JSON" in bad_json.error
    no_name = qwen('<tool_call>{"arguments": {}}</tool_call>', [LOOKUP]).calls[0]
    assert "JSON object" in no_name.error
    misspelt = qwen('<tool_call>{"name": "lookup", "cri": {"key": "a"}}</tool_call>', [LOOKUP]).calls[0]
    assert "unexpected key(s) ['cri']" in misspelt.error
    unknown = qwen('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [LOOKUP]).calls[0]
    assert "unknown tool 'rm_rf'" in unknown.error and "lookup" in unknown.error
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_parser("nonsense")


def test_xml_tags_take_the_first_call_and_its_one_parameter():
    parsed = xml_tags("think <search> capital of France </search> and <search>more</search>", [SEARCH])
    assert [(c.name, c.arguments) for c in parsed.calls] == [("search", {"query": "capital of France"})]
    assert stop_strings_for(xml_tags, [SEARCH]) == ["</search>"] and xml_tags.inline_response


def test_schema_from_signature_and_from_attribute():
    schema = tool_schema(lookup)["function"]
    assert schema["name"] == "lookup" and schema["description"] == "Look a key up."
    assert schema["parameters"]["properties"] == {"key": {"type": "string"}, "scale": {"type": "integer"}}
    assert schema["parameters"]["required"] == ["key"]
    raises.tool_schema = {"name": "raises", "description": "d", "parameters": {"type": "object", "properties": {}}}
    try:
        assert tool_schema(raises) == {"type": "function", "function": raises.tool_schema}
    finally:
        del raises.tool_schema
    tools = load_tools((f"{__name__}.TOOLS",))
    assert sorted(tools) == ["hangs", "huge", "lookup", "raises", "slow_async"]
    with pytest.raises(ValueError, match="second tool"):
        load_tools((f"{__name__}.lookup", f"{__name__}.TOOLS"))


def test_every_failure_is_a_bounded_message():
    tools = load_tools((f"{__name__}.TOOLS",))

    async def run(name, arguments, **kwargs):
        return await run_tool_call(ToolCall(name, arguments, "raw"), tools, **kwargs)

    ok = asyncio.run(run("lookup", {"key": "k", "scale": 3}))
    assert (ok.text, ok.error) == ("value-k-3", None)
    started = time.perf_counter()
    for name in ("hangs", "slow_async"):
        result = asyncio.run(run(name, {"key": "k"}, timeout_s=0.3))
        assert "did not answer within 0.3 s (--tool-timeout)" in result.error and result.text.startswith("Error:")
    assert time.perf_counter() - started < 5
    crashed = asyncio.run(run("raises", {"key": "k"}))
    assert "RuntimeError: no such key k" in crashed.error
    big = asyncio.run(run("huge", {"key": "k"}, max_chars=100))
    assert big.error is None and len(big.text) < 200 and "--max-tool-response-chars" in big.text
    assert "bad arguments" in asyncio.run(run("lookup", {"nope": 1})).error
    assert "unknown tool" in asyncio.run(run("missing", {})).error
    malformed = asyncio.run(run_tool_call(ToolCall("", {}, "raw", "tool call is not valid JSON"), tools))
    assert malformed.error == "tool call is not valid JSON"


def episode_answer(sample, word: str) -> str:
    """A tool that reads the conversation's own state."""
    return f"{word}:{sample.label}"


def test_a_tool_can_read_its_conversation_but_the_model_cannot_set_it():
    from slime.utils.types import Sample

    tools = load_tools((f"{__name__}.episode_answer",))
    schema = tools["episode_answer"][1]["function"]["parameters"]
    assert schema["properties"] == {"word": {"type": "string"}} and schema["required"] == ["word"]
    result = asyncio.run(run_tool_call(ToolCall("episode_answer", {"word": "w"}, "raw"), tools,
                                       sample=Sample(label="secret")))
    assert (result.text, result.error) == ("w:secret", None)
    forged = asyncio.run(run_tool_call(ToolCall("episode_answer", {"word": "w", "sample": "x"}, "raw"), tools))
    assert "'sample' is not an argument" in forged.error
