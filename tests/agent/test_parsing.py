"""slime.agent.parsing: reasoning split, tool uses in Anthropic's shape from each format, the XML fallback, and
ill-formed calls kept and flagged (never dropped silently)."""

import pytest

from slime.agent.parsing import ParsedModelOutput, parse_model_output, parse_tool_uses, parse_xml_tool_uses
from slime.utils.tool_parsers import qwen, qwen3_coder, with_xml_fallback

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
    "cmd": {"type": "string"}, "timeout": {"type": "integer"}, "env": {"type": "object"}}}}}]


def test_plain_text_and_reasoning_split():
    assert parse_model_output("  just text ", tools_schema=None, tool_parser_name=None,
                              reasoning_parser_name=None) == ParsedModelOutput("", "just text", [], False)
    parsed = parse_model_output("<think>plan it</think>\n\nvisible", tools_schema=None, tool_parser_name=None,
                                reasoning_parser_name="qwen3")
    assert (parsed.reasoning, parsed.text) == ("plan it", "visible")
    # the template opened the think block in the prompt: only the closing tag is sampled
    parsed = parse_model_output("still thinking</think>answer", tools_schema=None, tool_parser_name=None,
                                reasoning_parser_name="deepseek-r1")
    assert (parsed.reasoning, parsed.text) == ("still thinking", "answer")


def test_json_tool_calls_in_anthropic_shape():
    raw = 'Let me run it.<tool_call>{"name": "run", "arguments": {"cmd": "ls", "timeout": 5}}</tool_call>'
    parsed = parse_model_output(raw, tools_schema=TOOLS, tool_parser_name="qwen25", reasoning_parser_name=None)
    assert parsed == ParsedModelOutput("", "Let me run it.", [{"name": "run", "input": {"cmd": "ls", "timeout": 5}}])
    # without a schema nothing is parsed: the text stays whole
    assert parse_tool_uses(raw, None, "qwen25") == (raw, [], False)


def test_qwen3_coder_xml_reads_values_as_their_schema_types():
    raw = ('<tool_call>\n<function=run>\n<parameter=cmd>\necho {"a": 1}\n</parameter>\n<parameter=timeout>30'
           '</parameter>\n<parameter=env>{"A": "1"}</parameter>\n</function>\n</tool_call>')
    turn = qwen3_coder(raw, TOOLS)
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("run", {"cmd": 'echo {"a": 1}', "timeout": 30, "env": {"A": "1"}}, None)]
    text, uses, ill_formed = parse_tool_uses("before " + raw, TOOLS, "qwen3_coder")
    assert (text, uses[0]["input"]["timeout"], ill_formed) == ("before", 30, False)
    unknown = qwen3_coder("<tool_call><function=rm><parameter=p>/</parameter></function></tool_call>", TOOLS)
    assert unknown.calls[0].error.startswith("unknown tool 'rm'")


def test_xml_fallback_after_a_json_parser_finds_nothing_well_formed():
    raw = "lead <tool_call><function=run><parameter=cmd> ls -la </parameter></function></tool_call> tail"
    text, uses, ill_formed = parse_tool_uses(raw, TOOLS, "qwen25")
    assert (text, uses, ill_formed) == ("lead  tail", [{"name": "run", "input": {"cmd": "ls -la"}}], False)
    cleaned, uses = parse_xml_tool_uses(raw.replace("run", "other"), TOOLS)
    assert uses == [] and cleaned == raw.replace("run", "other")  # an unknown tool stays in the text


def test_ill_formed_calls_are_kept_and_flagged():
    raw = 'ok <tool_call>{"name": "run", "arguments": {"cmd": "ls"</tool_call>'
    text, uses, ill_formed = parse_tool_uses(raw, TOOLS, "qwen25")
    assert ill_formed and text == "ok"
    assert uses == [{"name": "tool", "input": {"_raw_arguments": raw[3:]}}]  # the JSON did not say a name
    both = raw + '<tool_call>{"name": "run", "arguments": {"cmd": "pwd"}}</tool_call>'
    _, uses, ill_formed = parse_tool_uses(both, TOOLS, "qwen25")
    assert ill_formed and [u["input"].get("cmd") for u in uses] == ["pwd", None]


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="--tool-call-parser 'llama3'"):
        parse_tool_uses("x", TOOLS, "llama3")
    with pytest.raises(ValueError, match="reasoning_parser 'kimi'"):
        parse_model_output("x", tools_schema=None, tool_parser_name=None, reasoning_parser_name="kimi")


def test_adapters_read_an_xml_call_whatever_their_parser():
    xml = "<tool_call><function=run><parameter=timeout>5</parameter></function></tool_call>"
    turn = with_xml_fallback(qwen, "go " + xml, TOOLS)
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("run", {"timeout": 5}, None)]
    json_call = '<tool_call>{"name": "run", "arguments": {"cmd": "ls"}}</tool_call>'
    assert with_xml_fallback(qwen, json_call, TOOLS).calls[0].arguments == {"cmd": "ls"}
    broken = '<tool_call>{"name": "run"</tool_call>'
    assert with_xml_fallback(qwen, broken, TOOLS).calls[0].error  # neither form reads it: the JSON error stays
