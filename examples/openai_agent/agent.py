"""An agent written against the official `openai` client, with nothing of slime in it: a weather assistant that
answers "What is the weather in <city>?" by calling its `get_weather` function tool.

`run_agent(client, messages, tools, execute_tool, max_turns)` is the usual tool loop: send the conversation with the
tools, run the tool calls the answer asks for locally, append their results as role "tool" messages, and repeat
until an answer without tool calls (the final answer) or `max_turns` model calls. `WeatherService` is the tool's
world: today's conditions per city, which only the tool knows.

Not a trainer, not a reward: the same code runs against OpenAI's API, a vLLM server or slime's `OpenAIAdapter`
(see generate.py), which is the point of the example.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

from openai import AsyncOpenAI

GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city, one word.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ToolError(ValueError):
    """A tool call the tool cannot answer (unknown tool, bad arguments); its message goes back to the model."""


@dataclass
class WeatherService:
    """Today's condition per city (e.g. {"Paris": "rainy"}): the world of one episode."""

    conditions: dict[str, str]

    def get_weather(self, city: str) -> str:
        if city not in self.conditions:
            raise ToolError(f"unknown city {city!r}; known cities: {', '.join(sorted(self.conditions))}")
        return self.conditions[city]

    def execute(self, name: str, arguments: str) -> str:
        """Run one tool call (`arguments`: the call's JSON string, as the API sends it)."""
        if name != "get_weather":
            raise ToolError(f"unknown tool {name!r}; the only tool is get_weather")
        try:
            parsed = json.loads(arguments or "{}")
        except json.JSONDecodeError as error:
            raise ToolError(f"arguments are not JSON: {error}") from None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("city"), str):
            raise ToolError('get_weather takes {"city": "<name>"}')
        return self.get_weather(parsed["city"])


@dataclass
class AgentTurn:
    """One model call: how many tools it called, how many of them failed, and how long they took."""

    num_tool_calls: int = 0
    num_tool_errors: int = 0
    tool_seconds: float = 0.0
    completion_tokens: int = 0


@dataclass
class AgentResult:
    final_answer: str | None  # None: the turn cap came before an answer without tool calls
    messages: list[dict]
    turns: list[AgentTurn] = field(default_factory=list)


async def run_agent(client: AsyncOpenAI, messages: list[dict], tools: list[dict],
                    execute_tool: Callable[[str, str], str], max_turns: int, model: str = "default",
                    **create_kwargs) -> AgentResult:
    """The tool loop (module docstring). A `ToolError` from `execute_tool` becomes the tool message
    "error: ..." (the model may retry); other exceptions propagate."""
    messages = [dict(m) for m in messages]
    result = AgentResult(final_answer=None, messages=messages)
    for _ in range(max_turns):
        completion = await client.chat.completions.create(model=model, messages=messages, tools=tools,
                                                          **create_kwargs)
        message = completion.choices[0].message
        turn = AgentTurn(completion_tokens=completion.usage.completion_tokens if completion.usage else 0)
        result.turns.append(turn)
        calls = message.tool_calls or []
        messages.append({"role": "assistant", "content": message.content,
                         **({"tool_calls": [call.model_dump() for call in calls]} if calls else {})})
        if not calls:
            result.final_answer = message.content or ""
            break
        for call in calls:
            started = time.perf_counter()
            try:
                output = execute_tool(call.function.name, call.function.arguments)
            except ToolError as error:
                output, turn.num_tool_errors = f"error: {error}", turn.num_tool_errors + 1
            turn.tool_seconds += time.perf_counter() - started
            turn.num_tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return result
