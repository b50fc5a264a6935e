"""Anthropic Messages over the engines, for Claude-style agent clients (slime's `AnthropicAdapter`).

`POST /v1/messages` (also with Claude Code's `?beta=true`): system (a string or text blocks), messages whose content
is a string or blocks (text, tool_use, tool_result, thinking), tools with `input_schema`, tool_choice `auto` / `none`,
max_tokens (required), temperature, top_p, top_k, stop_sequences, stream. Claude Code's requests are taken as they
are: a `system` message inside `messages` is folded into the user message before it as a `<system-reminder>` text
(chat templates take a system message only first; the fold keeps it in place, so later turns render the same prefix);
`cache_control` on blocks, `thinking`, `output_config`, `context_management` and `metadata` only steer a hosted
service and are accepted without effect (the engine's prefix cache needs no hint). Blocks become chat-template messages: a user's tool_result
blocks become messages of role "tool", an assistant's tool_use blocks its `tool_calls`, thinking its
`reasoning_content`. The answer's content holds thinking / text / tool_use blocks with stop_reason `tool_use`,
`end_turn`, `stop_sequence` or `max_tokens`; a stream sends message_start, content_block_start / _delta / _stop per
block, message_delta and message_stop. The session id is the API key (`Authorization: Bearer <session id>` or
`x-api-key: <session id>`).

Only the wire format; the turn flow is `common.BaseAdapter`.
"""

from __future__ import annotations

import json

from slime.agent.adapters.common import (
    DEFAULT_SESSION_ID,
    BaseAdapter,
    ChatRequest,
    RequestError,
    TurnAnswer,
    bearer_token,
    header,
    number,
    sse,
    string_list,
    text_of,
)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "invalid_request_error", 429: "rate_limit_error", 502: "api_error"}
STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}


MID_SYSTEM_PREFIX, MID_SYSTEM_SUFFIX = "<system-reminder>\n", "\n</system-reminder>"


def _fold_mid_list_system_into_user(body: dict) -> bool:
    """Move each `system` message past the first position of `body["messages"]` into the user message before it (or
    after it, when none is before) as a `<system-reminder>` text block; in place. True when a message moved."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    positions = [i for i, m in enumerate(messages) if i > 0 and isinstance(m, dict) and m.get("role") == "system"]
    for i in positions:
        reminder = {"type": "text", "text": MID_SYSTEM_PREFIX + text_of(messages[i].get("content"),
                                                                        f"messages[{i}].content") + MID_SYSTEM_SUFFIX}
        before = [j for j in range(i) if isinstance(messages[j], dict) and messages[j].get("role") == "user"]
        after = [j for j in range(i + 1, len(messages))
                 if isinstance(messages[j], dict) and messages[j].get("role") == "user"]
        if before:
            _content_list(messages[before[-1]]).append(reminder)
            messages[i] = None
        elif after:
            _content_list(messages[after[0]]).insert(0, reminder)
            messages[i] = None
        else:
            messages[i] = {"role": "user", "content": [reminder]}
    body["messages"] = [m for m in messages if m is not None]
    return bool(positions)


def _content_list(message: dict) -> list:
    if not isinstance(message.get("content"), list):
        content = message.get("content")
        message["content"] = [{"type": "text", "text": content if isinstance(content, str) else ""}]
    return message["content"]


def _blocks(content, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(param, "must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{param}[{i}]", 'each content block needs a "type"')
    return content


def _user_messages(blocks: list[dict], param: str) -> list[dict]:
    """Tool results first (as role "tool" messages), then the user's text."""
    tool_messages, texts = [], []
    for i, block in enumerate(blocks):
        if block["type"] == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif block["type"] == "tool_result" and isinstance(block.get("tool_use_id"), str):
            result = text_of(block.get("content"), f"{param}[{i}].content")
            tool_messages.append({"role": "tool", "content": f"Error: {result}" if block.get("is_error") else result})
        else:
            raise RequestError(f"{param}[{i}]", "a user block must be text or tool_result (with tool_use_id)")
    return tool_messages + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _assistant_message(blocks: list[dict], param: str) -> dict:
    message, texts, calls = {"role": "assistant"}, [], []
    for i, block in enumerate(blocks):
        if block["type"] == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif block["type"] == "thinking" and isinstance(block.get("thinking"), str):
            message["reasoning_content"] = block["thinking"]
        elif block["type"] == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input"),
                                                                                              dict):
            calls.append({"type": "function", "function": {"name": block["name"], "arguments": block["input"]}})
        else:
            raise RequestError(f"{param}[{i}]", "an assistant block must be text, thinking or tool_use "
                                                "(with name and an input object)")
    message["content"] = "".join(texts)
    if calls:
        message["tool_calls"] = calls
    return message


def _request_session_id(request) -> str:
    """slime's rule: `Authorization: Bearer <id>`, else `x-api-key: <id>`, else DEFAULT_SESSION_ID."""
    return bearer_token(request) or header(request, "x-api-key") or DEFAULT_SESSION_ID


def _translate_messages(messages: list, system=None) -> list[dict]:
    """Anthropic messages (and the top-level `system`) -> chat-template messages: one system message first (the
    `system` field and a leading system message), a user's tool_result blocks as "tool" messages, an assistant's
    tool_use blocks as `tool_calls` (arguments a dict) and thinking as `reasoning_content`. The wire's ids stay
    out: chat templates do not render them, and the sampled text holds none."""
    system_texts = [text_of(system, "system")] if system is not None else []
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        system_texts.append(text_of(messages[0].get("content"), "messages[0].content"))
        messages = messages[1:]
    translated = [{"role": "system", "content": "\n\n".join(system_texts)}] if system_texts else []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(f"messages[{i}].role", "must be 'user', 'assistant' or 'system'")
        blocks = _blocks(message.get("content"), f"messages[{i}].content")
        if role == "user":
            translated += _user_messages(blocks, f"messages[{i}].content")
        else:
            translated.append(_assistant_message(blocks, f"messages[{i}].content"))
    return translated


def _tools_to_chat_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "must be a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{i}]", 'must be {"name", "description", "input_schema"}')
        schema = tool.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise RequestError(f"tools[{i}].input_schema", "must be a JSON schema object")
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                                     "parameters": schema}})
    return out


class AnthropicAdapter(BaseAdapter):
    route = "/v1/messages"
    tool_call_id_prefix = "toolu_"

    def request_session_id(self, request, body: dict) -> str:
        return _request_session_id(request)

    def parse_request(self, body: dict) -> ChatRequest:
        max_tokens = number(body, "max_tokens", 1, 1 << 30, integer=True)
        if max_tokens is None:
            raise RequestError("max_tokens", "is required (an integer >= 1)")
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not raw_messages:
            raise RequestError("messages", "must be a non-empty list of messages")
        body = {**body, "messages": [dict(m) if isinstance(m, dict) else m for m in raw_messages]}
        _fold_mid_list_system_into_user(body)
        messages = _translate_messages(body["messages"], system=body.get("system"))
        tool_choice = body.get("tool_choice") or {"type": "auto"}
        if not isinstance(tool_choice, dict) or tool_choice.get("type") not in ("auto", "none"):
            raise RequestError("tool_choice", f"only {{'type': 'auto'}} and {{'type': 'none'}} are supported, got "
                                              f"{tool_choice!r}")
        params = {"max_new_tokens": max_tokens, "temperature": number(body, "temperature", 0, 1),
                  "top_p": number(body, "top_p", 0, 1, low_open=True),
                  "top_k": number(body, "top_k", 1, 1 << 30, integer=True)}
        params = {key: value for key, value in params.items() if value is not None}
        if body.get("stop_sequences") is not None:
            params["stop"] = string_list(body["stop_sequences"], "stop_sequences")
        return ChatRequest(messages=messages, tools=_tools_to_chat_tools(body.get("tools")),
                           parse_tool_calls=tool_choice["type"] == "auto", sampling_params=params,
                           stream=body.get("stream") is True, model=str(body.get("model") or ""))

    @staticmethod
    def _content_blocks(answer: TurnAnswer) -> list[dict]:
        blocks = [{"type": "thinking", "thinking": answer.reasoning, "signature": ""}] if answer.reasoning else []
        if answer.content or not answer.tool_calls:
            blocks.append({"type": "text", "text": answer.content})
        blocks += [{"type": "tool_use", "id": call_id, "name": call.name, "input": call.arguments}
                   for call, call_id in zip(answer.tool_calls, answer.tool_call_ids)]
        return blocks

    def _message(self, answer: TurnAnswer, content: list[dict], stop_reason: str | None, output_tokens: int) -> dict:
        return {"id": f"msg_{answer.id}", "type": "message", "role": "assistant", "model": answer.model,
                "content": content, "stop_reason": stop_reason,
                "stop_sequence": answer.stop_sequence if stop_reason else None,
                "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": output_tokens,
                          "cache_read_input_tokens": answer.cached_tokens}}

    def render_answer(self, answer: TurnAnswer) -> dict:
        return self._message(answer, self._content_blocks(answer), STOP_REASONS[answer.finish],
                             answer.completion_tokens)

    def render_stream(self, answer: TurnAnswer) -> list[bytes]:
        frames = [sse({"type": "message_start", "message": self._message(answer, [], None, 0)}, "message_start")]
        for index, block in enumerate(self._content_blocks(answer)):
            if block["type"] == "text":
                start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
            elif block["type"] == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
                delta = {"type": "thinking_delta", "thinking": block["thinking"]}
            else:
                start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            frames += [sse({"type": "content_block_start", "index": index, "content_block": start},
                           "content_block_start"),
                       sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta"),
                       sse({"type": "content_block_stop", "index": index}, "content_block_stop")]
        frames.append(sse({"type": "message_delta",
                           "delta": {"stop_reason": STOP_REASONS[answer.finish], "stop_sequence": answer.stop_sequence},
                           "usage": {"output_tokens": answer.completion_tokens}}, "message_delta"))
        return frames + [sse({"type": "message_stop"}, "message_stop")]

    def error_body(self, status: int, message: str, param: str | None = None) -> dict:
        return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
