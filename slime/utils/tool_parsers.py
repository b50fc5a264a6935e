"""Finding tool calls in sampled text: the formats models are trained on, as pure functions over strings.

- `qwen` (alias `hermes`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn (Qwen2.5 /
  Qwen3 / Hermes chat templates render tool calls this way).
- `tool_tag`: `<tool>{"name": ..., "arguments": {...}}</tool>`, the same JSON in a plain tag.
- `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>` (Qwen3-Coder's
  template; SGLang's parser of the same name): each value is read as its schema type (JSON for numbers, booleans,
  objects, arrays; the raw text for strings).
- `xml_tags`: `<NAME>text</NAME>` for a tool NAME that takes one string parameter (Search-R1's `<search>query</search>`);
  the text becomes that parameter.
- any other parser by dotted path: `fn(text, tools) -> ParsedTurn`.

A call that cannot be parsed (bad JSON, no name, unknown tool) is returned with `error` set, so the caller answers it
with a tool message naming the problem instead of crashing. Each parser also names the stop strings that end a turn
right after a call, so the model does not go on to imagine the tool's answer. Not the tool runner
(`slime.rollout.tools`) and not the chat template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ToolCall:
    name: str
    arguments: dict
    raw: str
    error: str | None = None


@dataclass
class ParsedTurn:
    content: str  # the text with the calls removed
    calls: list[ToolCall] = field(default_factory=list)


def _json_call(raw: str, body: str, tool_names: set[str]) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall("", {}, raw, f"tool call is not valid JSON ({error.msg} at char {error.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall("", {}, raw, 'tool call must be a JSON object {"name": ..., "arguments": {...}}')
    unexpected = sorted(set(payload) - {"name", "arguments", "parameters"})
    if unexpected:
        return ToolCall(payload["name"], {}, raw, f"tool call has unexpected key(s) {unexpected}; write "
                        '{"name": ..., "arguments": {...}}')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string (OpenAI's wire form)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(payload["name"], {}, raw, "tool call 'arguments' is a string that is not JSON")
    if not isinstance(arguments, dict):
        return ToolCall(payload["name"], {}, raw, "tool call 'arguments' must be a JSON object")
    if payload["name"] not in tool_names:
        return ToolCall(payload["name"], arguments, raw,
                        f"unknown tool {payload['name']!r}; available: {sorted(tool_names)}")
    return ToolCall(payload["name"], arguments, raw)


def _tagged_json_parser(tag: str) -> Callable[[str, list[dict]], ParsedTurn]:
    pattern = re.compile(rf"<{tag}>(.*?)</{tag}>", re.S)

    def parse(text: str, tools: list[dict]) -> ParsedTurn:
        names = {tool_name(t) for t in tools}
        calls = [_json_call(m.group(0), m.group(1).strip(), names) for m in pattern.finditer(text)]
        return ParsedTurn(pattern.sub("", text).strip(), calls)

    parse.stop_strings = [f"</{tag}>"]
    return parse


XML_FUNCTION_CALL = re.compile(r"<tool_call>\s*<function=([^>]+)>(.*?)</function>\s*</tool_call>", re.S)
XML_PARAMETER = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.S)


def xml_function_parameters(body: str) -> dict[str, str]:
    """The `<parameter=KEY>value</parameter>` pairs of one `<function=NAME>` body, values stripped, as text."""
    return {m.group(1).strip(): m.group(2).strip() for m in XML_PARAMETER.finditer(body)}


def _typed(value: str, schema: dict):
    if schema.get("type", "string") == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # left as written; the tool's own validation answers it


def qwen3_coder(text: str, tools: list[dict]) -> ParsedTurn:
    names = {tool_name(t): t.get("function", t).get("parameters", {}).get("properties", {}) for t in tools}
    calls = []
    for match in XML_FUNCTION_CALL.finditer(text):
        name = match.group(1).strip()
        parameters = xml_function_parameters(match.group(2))
        if name not in names:
            calls.append(ToolCall(name, parameters, match.group(0),
                                  f"unknown tool {name!r}; available: {sorted(names)}"))
            continue
        properties = names[name]
        calls.append(ToolCall(name, {k: _typed(v, properties.get(k, {})) for k, v in parameters.items()},
                              match.group(0)))
    return ParsedTurn(XML_FUNCTION_CALL.sub("", text).strip(), calls)


qwen3_coder.stop_strings = ["</tool_call>"]


def with_xml_fallback(parser, text: str, tools: list[dict]) -> ParsedTurn:
    """`parser`'s reading of `text`, or, when it finds no well-formed call, the `qwen3_coder` XML form's if that
    finds one: coding models write that form now and then whatever their template says (slime's parsing allows it)."""
    turn = parser(text, tools)
    if parser is qwen3_coder or any(call.error is None for call in turn.calls):
        return turn
    xml = qwen3_coder(text, tools)
    return xml if any(call.error is None for call in xml.calls) else turn


def xml_tags(text: str, tools: list[dict]) -> ParsedTurn:
    """`<NAME>text</NAME>` calls NAME with its one string parameter; only the first call of a turn is taken
    (generation stops at its closing tag)."""
    calls, content = [], text
    for tool in tools:
        name = tool_name(tool)
        match = re.search(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", text, re.S)
        if match is None:
            continue
        parameters = list(tool.get("function", tool).get("parameters", {}).get("properties", {}))
        if len(parameters) != 1:
            calls.append(ToolCall(name, {}, match.group(0),
                                  f"tool {name!r} takes {len(parameters)} parameters; the xml_tags format needs one"))
        else:
            calls.append(ToolCall(name, {parameters[0]: match.group(1).strip()}, match.group(0)))
        content = content.replace(match.group(0), "")
    calls.sort(key=lambda call: text.find(call.raw))
    return ParsedTurn(content.strip(), calls[:1])


xml_tags.inline_response = True  # the tool's answer is written into the turn (<information>...), not a chat message


def xml_tag_stop_strings(tools: list[dict]) -> list[str]:
    return [f"</{tool_name(t)}>" for t in tools]


def tool_name(tool: dict) -> str:
    """The name of a tool schema in OpenAI's form ({"type": "function", "function": {...}}) or bare ({"name": ...})."""
    return tool.get("function", tool)["name"]


qwen = _tagged_json_parser("tool_call")
tool_tag = _tagged_json_parser("tool")
PARSERS = {"qwen": qwen, "hermes": qwen, "qwen25": qwen, "qwen3_coder": qwen3_coder, "tool_tag": tool_tag,
           "xml_tags": xml_tags}


def get_parser(name_or_path: str):
    """A built-in parser by name, or `module.fn` by dotted path."""
    if name_or_path in PARSERS:
        return PARSERS[name_or_path]
    if "." not in name_or_path:
        raise ValueError(f"--tool-call-parser {name_or_path!r}: use one of {sorted(PARSERS)} or a dotted path")
    from slime.utils.misc import load_function

    return load_function(name_or_path, "--tool-call-parser")


def stop_strings_for(parser, tools: list[dict]) -> list[str]:
    """Strings that end a turn right after a call in this parser's format."""
    if parser is xml_tags:
        return xml_tag_stop_strings(tools)
    return list(getattr(parser, "stop_strings", []))
