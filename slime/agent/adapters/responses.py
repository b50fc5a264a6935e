"""OpenAI's Responses API over the engines (`POST /v1/responses`), the only API current Codex speaks; served by
`OpenAIAdapter` next to Chat Completions.

Request: `input` (a string, or items: messages of role system / developer / user / assistant whose content is a
string or `input_text` / `output_text` parts, `function_call` {call_id, name, arguments}, `function_call_output`
{call_id, output}, `reasoning` items this adapter emitted), `instructions`, `tools` (`{"type": "function", "name",
"parameters"}`), tool_choice `auto` / `none`, max_output_tokens, temperature, top_p, stream. Items become
chat-template messages: leading system / developer texts one system message (one shared prefix across turns), an
assistant's text and the function calls after it one assistant message with `tool_calls`, each function_call_output a
message of role "tool". Tools that are not functions (`web_search`, `namespace`, `custom`, ...) cannot be served by a
chat template: they are left out of the prompt and named in the answer's `metadata.ignored_tools`. Fields that only a
hosted service acts on (`store`, `include`, `prompt_cache_key`, `reasoning`, `client_metadata`, `text`) are accepted
and have no effect; `previous_response_id` (server-side history) is refused: send the whole input.

Answer: a `response` object whose `output` holds a `reasoning` item (when the model thought), a `message` item with
`output_text`, and `function_call` items; status `completed`, or `incomplete` with `incomplete_details.reason =
max_output_tokens`. A stream sends `response.created`, `response.in_progress`, per item `response.output_item.added`
/ the item's deltas (`response.output_text.delta`, `response.function_call_arguments.delta`,
`response.reasoning_text.delta`) / `response.output_item.done`, then `response.completed` (or
`response.incomplete`), each event with its `sequence_number`.

Only the wire format; the turn flow is `common.BaseAdapter.handle_turn`. Not Chat Completions (openai.py).
"""

from __future__ import annotations

import json

from slime.agent.adapters.common import ChatRequest, RequestError, TurnAnswer, number, sse

INPUT_TEXT_PART_TYPES = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
SYSTEM_ROLES = {"system", "developer"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "invalid_request_error", 429: "rate_limit_error", 502: "server_error"}


def _parts_text(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(param, "must be a string or a list of input_text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in INPUT_TEXT_PART_TYPES \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{param}[{i}]", f"only text parts ({sorted(INPUT_TEXT_PART_TYPES)}) are served, "
                                                f"got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _arguments(item: dict, param: str):
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise RequestError(f"{param}.arguments", "must be a JSON string")
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments  # replayed as sent: the chat template renders a string argument verbatim


def input_messages(body: dict) -> list[dict]:
    """The request's `instructions` and `input` as chat-template messages (module docstring)."""
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError("input", "must be a non-empty string or list of input items")
    system_texts = [body["instructions"]] if isinstance(body.get("instructions"), str) and body["instructions"] else []
    messages: list[dict] = []
    pending_reasoning = None
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(param, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            text = _parts_text(item.get("content"), f"{param}.content")
            if role in SYSTEM_ROLES and not messages:
                system_texts.append(text)
            elif role in SYSTEM_ROLES:
                messages.append({"role": "system", "content": text})
            elif role == "user":
                messages.append({"role": "user", "content": text})
            elif role == "assistant":
                message = {"role": "assistant", "content": text}
                if pending_reasoning is not None:
                    message["reasoning_content"], pending_reasoning = pending_reasoning, None
                messages.append(message)
            else:
                raise RequestError(f"{param}.role", f"must be one of system, developer, user, assistant; got {role!r}")
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise RequestError(param, "a function_call item needs a name and a call_id")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item, param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one turn share its message
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if pending_reasoning is not None:
                    message["reasoning_content"], pending_reasoning = pending_reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(param, "a function_call_output item needs a call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _parts_text(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            # what this adapter emitted: the thinking text in `content` (reasoning_text parts) or `summary`
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning = _parts_text(parts, f"{param}.content")
        else:
            raise RequestError(f"{param}.type", f"input items of type {kind!r} are not served (message, "
                                                "function_call, function_call_output, reasoning are)")
    if system_texts:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system_texts)})
    return messages


def function_tools(tools) -> tuple[list[dict] | None, list[str]]:
    """(the function tools in Chat Completions' shape, the names / types of the tools left out)."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise RequestError("tools", "must be a list of tools")
    served, ignored = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}]", "must be an object")
        if tool.get("type") != "function":
            ignored.append(str(tool.get("name") or tool.get("type")))
            continue
        if not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{i}].name", "a function tool needs a name")
        served.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}})
    return served or None, ignored


class ResponsesWire:
    """The Responses API's parse and render hooks for `BaseAdapter.handle_turn` (module docstring)."""

    def __init__(self, default_model: str):
        self.default_model = default_model

    def parse_request(self, body: dict) -> ChatRequest:
        if body.get("previous_response_id") is not None:
            raise RequestError("previous_response_id", "server-side history is not kept: send the whole "
                                                       "conversation in `input` (store: false)")
        tool_choice = body.get("tool_choice", "auto")
        if tool_choice not in ("auto", "none"):
            raise RequestError("tool_choice", f"only 'auto' and 'none' are supported, got {tool_choice!r}")
        tools, ignored = function_tools(body.get("tools"))
        params = {"temperature": number(body, "temperature", 0, 2),
                  "top_p": number(body, "top_p", 0, 1, low_open=True),
                  "max_new_tokens": number(body, "max_output_tokens", 1, 1 << 30, integer=True)}
        return ChatRequest(messages=input_messages(body), tools=tools, parse_tool_calls=tool_choice == "auto",
                           sampling_params={k: v for k, v in params.items() if v is not None},
                           stream=body.get("stream") is True, model=str(body.get("model") or ""),
                           ignored_tools=ignored)

    # ---- rendering -----------------------------------------------------------------------------------------
    @staticmethod
    def _items(answer: TurnAnswer) -> list[dict]:
        items = []
        if answer.reasoning:
            items.append({"type": "reasoning", "id": f"rs_{answer.id}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": answer.reasoning}]})
        if answer.content or not answer.tool_calls:
            items.append({"type": "message", "id": f"msg_{answer.id}", "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": answer.content, "annotations": []}]})
        for index, (call, call_id) in enumerate(zip(answer.tool_calls, answer.tool_call_ids)):
            items.append({"type": "function_call", "id": f"fc_{answer.id}_{index}", "call_id": call_id,
                          "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False),
                          "status": "completed"})
        return items

    def _response(self, answer: TurnAnswer, status: str, output: list[dict]) -> dict:
        request = answer.request
        incomplete = status == "incomplete"
        return {
            "id": f"resp_{answer.id}", "object": "response", "created_at": answer.created, "status": status,
            "model": answer.model or self.default_model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "parallel_tool_calls": True, "tool_choice": "auto" if request is None or request.parse_tool_calls
            else "none", "tools": [], "store": False,
            "metadata": {"ignored_tools": ",".join(request.ignored_tools if request is not None else [])},
            "usage": None if status == "in_progress" else {
                "input_tokens": answer.prompt_tokens,
                "input_tokens_details": {"cached_tokens": answer.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": answer.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": answer.prompt_tokens + answer.completion_tokens},
        }

    @staticmethod
    def _status(answer: TurnAnswer) -> str:
        return "incomplete" if answer.finish == "length" else "completed"

    def render_answer(self, answer: TurnAnswer) -> dict:
        return self._response(answer, self._status(answer), self._items(answer))

    def render_stream(self, answer: TurnAnswer) -> list[bytes]:
        events: list[tuple[str, dict]] = [("response.created", {"response": self._response(answer, "in_progress", [])}),
                                          ("response.in_progress",
                                           {"response": self._response(answer, "in_progress", [])})]
        items = self._items(answer)
        for index, item in enumerate(items):
            events += self._item_events(index, item)
        status = self._status(answer)
        events.append((f"response.{status}", {"response": self._response(answer, status, items)}))
        return [sse({"type": name, "sequence_number": number_, **data}, name)
                for number_, (name, data) in enumerate(events)]

    @staticmethod
    def _item_events(index: int, item: dict) -> list[tuple[str, dict]]:
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            return [("response.output_item.added", {"output_index": index, "item": {**item, "status": "in_progress",
                                                                                    "content": []}}),
                    ("response.content_part.added", {**at, "content_index": 0, "part": part}),
                    ("response.output_text.delta", {**at, "content_index": 0, "delta": text, "logprobs": []}),
                    ("response.output_text.done", {**at, "content_index": 0, "text": text, "logprobs": []}),
                    ("response.content_part.done", {**at, "content_index": 0, "part": {**part, "text": text}}),
                    ("response.output_item.done", {"output_index": index, "item": item})]
        if item["type"] == "function_call":
            return [("response.output_item.added", {"output_index": index, "item": {**item, "arguments": "",
                                                                                    "status": "in_progress"}}),
                    ("response.function_call_arguments.delta", {**at, "delta": item["arguments"]}),
                    ("response.function_call_arguments.done", {**at, "arguments": item["arguments"]}),
                    ("response.output_item.done", {"output_index": index, "item": item})]
        text = item["content"][0]["text"]  # reasoning
        return [("response.output_item.added", {"output_index": index, "item": {**item, "content": []}}),
                ("response.reasoning_text.delta", {**at, "content_index": 0, "delta": text}),
                ("response.reasoning_text.done", {**at, "content_index": 0, "text": text}),
                ("response.output_item.done", {"output_index": index, "item": item})]

    def error_body(self, status: int, message: str, param: str | None = None) -> dict:
        return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                          "code": None}}
