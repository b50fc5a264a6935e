"""Tools for multi-turn rollouts: plain Python functions (sync or async) with a JSON schema, loaded by dotted path
(`--tool-functions-path`, repeatable) and run so that nothing a tool does can crash or stall a rollout.

A tool that declares a parameter named `sample` gets the conversation's Sample there (its label, metadata: the
episode's own state, e.g. a per-task database); that parameter is not part of its schema. A tool's schema is its
`tool_schema` attribute (OpenAI's `{"type": "function", "function": {...}}` form, or the bare
`{"name", "description", "parameters"}`), or is built from its signature (str / int / float / bool / list / dict
annotations) and the first paragraph of its docstring. A dotted path may also name a list of functions.

`run_tool_call` bounds each call by `--tool-timeout` seconds and its answer by `--max-tool-response-chars`; an
exception, a timeout, a malformed call or an answer that is not text becomes an error text for the model (and
`ToolResult.error` for the metrics), never an exception. Sync tools run on a daemon thread, so one that never returns
costs its timeout and no more. Not the parser of tool calls (`slime.utils.tool_parsers`) and not the rollout loop
(`slime.rollout.multi_turn`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from dataclasses import dataclass

from slime.utils.daemon_threads import run_in_daemon_thread
from slime.utils.misc import load_functions
from slime.utils.tool_parsers import ToolCall, tool_name

DEFAULT_TOOL_TIMEOUT_S = 30.0
DEFAULT_MAX_TOOL_RESPONSE_CHARS = 8192
SAMPLE_PARAMETER = "sample"  # filled by the runner with the conversation's Sample, never by the model
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class ToolResult:
    name: str
    text: str
    error: str | None
    seconds: float


def tool_schema(function) -> dict:
    """The OpenAI-style schema of `function`: its `tool_schema` attribute, or one built from its signature."""
    schema = getattr(function, "tool_schema", None)
    if schema is not None:
        return schema if "function" in schema else {"type": "function", "function": schema}
    properties, required = {}, []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or name == SAMPLE_PARAMETER:
            continue
        annotation = parameter.annotation
        if isinstance(annotation, str):  # from __future__ import annotations
            annotation = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(
                annotation, str)
        properties[name] = {"type": _JSON_TYPES.get(annotation, "string")}
        if parameter.default is parameter.empty:
            required.append(name)
    description = (inspect.getdoc(function) or "").split("\n\n")[0].strip()
    return {"type": "function", "function": {"name": function.__name__, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


@functools.lru_cache(maxsize=16)
def load_tools(paths: tuple[str, ...]) -> dict[str, tuple[callable, dict]]:
    """{tool name: (function, schema)} from `--tool-functions-path` values; ValueError naming a bad path."""
    tools = {}
    for path in paths:
        for function in load_functions(path, "--tool-functions-path"):
            schema = tool_schema(function)
            name = tool_name(schema)
            if name in tools:
                raise ValueError(f"--tool-functions-path {path}: a second tool is named {name!r}")
            tools[name] = (function, schema)
    return tools


async def _call_with_timeout(function, arguments: dict, timeout_s: float):
    if inspect.iscoroutinefunction(function):
        return await asyncio.wait_for(function(**arguments), timeout_s)
    return await asyncio.wait_for(run_in_daemon_thread(function, **arguments), timeout_s)


async def run_tool_call(call: ToolCall, tools: dict, timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
                        max_chars: int = DEFAULT_MAX_TOOL_RESPONSE_CHARS, sample=None) -> ToolResult:
    """Run one parsed call (`sample` goes to a tool that declares that parameter); every failure is a ToolResult
    whose text tells the model what went wrong."""
    started = time.perf_counter()

    def failed(message: str) -> ToolResult:
        return ToolResult(call.name, f"Error: {message}", message, time.perf_counter() - started)

    if call.error is not None:
        return failed(call.error)
    if call.name not in tools:
        return failed(f"unknown tool {call.name!r}; available: {sorted(tools)}")
    function, _ = tools[call.name]
    if SAMPLE_PARAMETER in call.arguments:
        return failed(f"{SAMPLE_PARAMETER!r} is not an argument of {call.name}")
    arguments = dict(call.arguments)
    if SAMPLE_PARAMETER in inspect.signature(function).parameters:
        arguments[SAMPLE_PARAMETER] = sample
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as error:
        return failed(f"bad arguments for {call.name}: {error}")
    try:
        result = await _call_with_timeout(function, arguments, timeout_s)
    except asyncio.TimeoutError:
        return failed(f"tool {call.name} did not answer within {timeout_s:g} s (--tool-timeout)")
    except Exception as error:  # noqa: BLE001 - any tool bug becomes a message
        return failed(f"tool {call.name} raised {type(error).__name__}: {error}")
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [cut: {len(text)} chars, --max-tool-response-chars {max_chars}]"
    return ToolResult(call.name, text, None, time.perf_counter() - started)
