"""SGLang's `FunctionCallParser` over this project's tool-call parsers (`slime.utils.tool_parsers`).

`parse_non_stream(text)` returns SGLang's pair: the text outside the calls, and one `ToolCallItem` per call
(`parameters` a JSON string). As SGLang's detectors do, a call naming a tool that is not in `tools`, or whose JSON
does not parse, is left out of the calls.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from slime.utils.tool_parsers import get_parser

# SGLang's detector names for the <tool_call>{...}</tool_call> format -> this project's parser of it.
PARSER_NAMES = {"qwen25": "qwen", "qwen": "qwen", "hermes": "hermes"}


class ToolCallItem(BaseModel):
    tool_index: int
    name: str | None = None
    parameters: str


class FunctionCallParser:
    def __init__(self, tools: list, tool_call_parser: str):
        if tool_call_parser not in PARSER_NAMES:
            raise ValueError(f"tool_call_parser {tool_call_parser!r}: this shim has {sorted(PARSER_NAMES)}")
        self.tools = tools
        self.tool_schemas = [{"type": tool.type, "function": tool.function.model_dump()} for tool in tools]
        self.parse = get_parser(PARSER_NAMES[tool_call_parser])

    def has_tool_call(self, text: str) -> bool:
        return bool(self.parse(text, self.tool_schemas).calls)

    def parse_non_stream(self, full_text: str) -> tuple[str, list[ToolCallItem]]:
        turn = self.parse(full_text, self.tool_schemas)
        names = [tool.function.name for tool in self.tools]
        calls = [ToolCallItem(tool_index=names.index(call.name), name=call.name,
                              parameters=json.dumps(call.arguments, ensure_ascii=False))
                 for call in turn.calls if call.error is None]
        return turn.content, calls
