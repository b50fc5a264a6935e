"""One decoded model output -> reasoning, visible text and tool uses, with slime's names (`slime.agent.parsing`):
`parse_model_output`, `parse_tool_uses`, `parse_xml_tool_uses`, `ParsedModelOutput`.

Tool uses come in Anthropic's shape, `{"name": ..., "input": {...}}`. The parsers are this project's
(`slime.utils.tool_parsers`, `slime.agent.adapters.reasoning`), under SGLang's names where slime passes SGLang's
(`qwen25`, `qwen3_coder`, `qwen3`, `deepseek-r1`); an unknown name raises ValueError rather than parsing nothing.
When a schema is given and the named parser finds no well-formed call, the Qwen3-Coder XML form
(`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`) is tried as well, as slime does:
coding models write it now and then whatever their template says.

Not the adapters' wire formats, and not the rendering of tool results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.agent.adapters.reasoning import get_reasoning_parser
from slime.utils.tool_parsers import XML_FUNCTION_CALL, get_parser, tool_name, xml_function_parameters


@dataclass(frozen=True)
class ParsedModelOutput:
    """`reasoning` (the thinking, "" if none), `text` (what is shown, stripped), `tool_uses`
    (`{"name", "input"}` dicts), `ill_formed` (a call was there but could not be read: its input is then
    `{"_raw_arguments": <the call's text>}`)."""

    reasoning: str
    text: str
    tool_uses: list[dict[str, Any]] = field(default_factory=list)
    ill_formed: bool = False


def parse_model_output(
    raw_output: str,
    *,
    tools_schema: list[dict] | None,
    tool_parser_name: str | None,
    reasoning_parser_name: str | None,
) -> ParsedModelOutput:
    """Split `raw_output` into reasoning (with `reasoning_parser_name`), text and tool uses (see parse_tool_uses)."""
    reasoning, body = "", raw_output
    split = get_reasoning_parser(reasoning_parser_name)
    if split is not None:
        reasoning, body = split(raw_output)
    body, tool_uses, ill_formed = parse_tool_uses(body, tools_schema, tool_parser_name)
    return ParsedModelOutput(reasoning=reasoning, text=body.strip(), tool_uses=tool_uses, ill_formed=ill_formed)


def parse_tool_uses(
    body_text: str, tools_schema: list[dict] | None, tool_parser_name: str | None
) -> tuple[str, list[dict[str, Any]], bool]:
    """(text without the calls, tool uses, ill_formed). The named parser runs only with a schema; with a schema
    and no well-formed call from it, the XML form is tried (parse_xml_tool_uses)."""
    if not tools_schema:
        return body_text, [], False
    broken: list[dict[str, Any]] = []
    if tool_parser_name:
        turn = get_parser(tool_parser_name)(body_text, tools_schema)
        good = [{"name": c.name, "input": c.arguments} for c in turn.calls if c.error is None]
        broken = [{"name": c.name or "tool", "input": {"_raw_arguments": c.raw}} for c in turn.calls if c.error]
        if good:
            return turn.content, good + broken, bool(broken)
    text, xml_uses = parse_xml_tool_uses(body_text, tools_schema)
    if xml_uses:
        return text, xml_uses, False
    if broken:
        return get_parser(tool_parser_name)(body_text, tools_schema).content, broken, True
    return body_text, [], False


def parse_xml_tool_uses(body_text: str, tools_schema: list[dict]) -> tuple[str, list[dict[str, Any]]]:
    """The XML-form calls of tools named in `tools_schema` (values as text, stripped), and the text without them.
    A call of an unknown tool is not a call: it stays in the text."""
    known = {tool_name(t) for t in tools_schema}
    uses, kept, last = [], [], 0
    for match in XML_FUNCTION_CALL.finditer(body_text):
        name = match.group(1).strip()
        if name in known:
            uses.append({"name": name, "input": xml_function_parameters(match.group(2))})
            kept.append(body_text[last:match.start()])
            last = match.end()
    kept.append(body_text[last:])
    return "".join(kept), uses
