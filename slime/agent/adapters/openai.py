"""OpenAI Chat Completions over the engines, for agent clients written against the OpenAI API (slime's
`OpenAIAdapter`).

`POST /v1/chat/completions`: messages (system / developer / user / assistant with `tool_calls` / tool), tools
(`{"type": "function", "function": {...}}`), tool_choice `auto` or `none`, temperature, top_p, max_tokens
(or max_completion_tokens), stop, seed, stream (+ stream_options.include_usage). The answer carries `tool_calls`
with JSON-string arguments and finish_reason `tool_calls` / `stop` / `length`; a stream sends `chat.completion.chunk`
deltas (role, reasoning_content, content, tool_calls, finish_reason, usage) and `[DONE]`. `GET /v1/models` lists
the served model. The session id is the API key (`Authorization: Bearer <session id>` or `x-api-key`), else the
body's `metadata.session_id` or `user`. `POST /v1/responses` serves the Responses API (responses.py) over the same sessions.

Only the wire format; the turn flow is `common.BaseAdapter`. Not the engine's own /v1 routes (no trajectory there).
"""

from __future__ import annotations

import json

from aiohttp import web

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
from slime.agent.adapters.responses import ResponsesWire

ROLES = {"system", "developer", "user", "assistant", "tool"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "invalid_request_error", 429: "rate_limit_error", 502: "api_error"}
FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


def _tool_call(call: dict, param: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(param, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as error:
            raise RequestError(f"{param}.function.arguments", f"is not JSON ({error.msg})") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{param}.function.arguments", "must be a JSON object (or its JSON string)")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _message(message, param: str) -> dict:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"{param}.role", f"each message needs a role in {sorted(ROLES)}")
    role = "system" if message["role"] == "developer" else message["role"]
    out = {"role": role, "content": text_of(message.get("content"), f"{param}.content")}
    if role == "assistant" and message.get("tool_calls"):
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise RequestError(f"{param}.tool_calls", "must be a list")
        out["tool_calls"] = [_tool_call(call, f"{param}.tool_calls[{i}]") for i, call in enumerate(calls)]
    if role == "assistant" and isinstance(message.get("reasoning_content"), str):
        out["reasoning_content"] = message["reasoning_content"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _translate_messages(messages: list) -> list[dict]:
    """Chat Completions messages -> chat-template messages: developer becomes system, content parts become text,
    tool-call arguments become dicts. The wire's ids (a call's `id`, a tool message's `tool_call_id`) stay out:
    chat templates do not render them, and the sampled text holds none."""
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _request_session_id(request, body: dict) -> str:
    """slime's rule: `Authorization: Bearer <id>`, else the body's `metadata.session_id`, else its `user`, else
    DEFAULT_SESSION_ID; an `x-api-key: <id>` header (the Anthropic adapter's) counts right after the bearer."""
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    for candidate in (bearer_token(request), header(request, "x-api-key"), metadata.get("session_id"),
                      body.get("user")):
        if isinstance(candidate, str) and candidate:
            return candidate
    return DEFAULT_SESSION_ID


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "must be a list of function tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if not named or tool.get("type") != "function":
            raise RequestError(f"tools[{i}]", 'must be {"type": "function", "function": {"name", "parameters"}}')
    return tools


class OpenAIAdapter(BaseAdapter):
    route = "/v1/chat/completions"
    tool_call_id_prefix = "call_"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.app.router.add_get("/v1/models", self._models)
        self.responses_wire = ResponsesWire(self.model_name)
        self.app.router.add_post("/v1/responses", self._handle_responses)

    def request_session_id(self, request, body: dict) -> str:
        return _request_session_id(request, body)

    async def _handle_responses(self, request: web.Request) -> web.StreamResponse:
        return await self.handle_turn(request, self.responses_wire)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "created": 0, "owned_by": "slime"}]})

    def parse_request(self, body: dict) -> ChatRequest:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages", "must be a non-empty list of message objects")
        tool_choice = body.get("tool_choice", "auto")
        if tool_choice not in ("auto", "none"):
            raise RequestError("tool_choice", f"only 'auto' and 'none' are supported, got {tool_choice!r}")
        if body.get("n", 1) != 1:
            raise RequestError("n", "only n=1 is supported (one trajectory per request)")
        params = {"temperature": number(body, "temperature", 0, 2), "top_p": number(body, "top_p", 0, 1, low_open=True),
                  "max_new_tokens": number(body, "max_completion_tokens", 1, 1 << 30, integer=True)
                  or number(body, "max_tokens", 1, 1 << 30, integer=True),
                  "sampling_seed": number(body, "seed", -(1 << 63), 1 << 63, integer=True)}
        params = {key: value for key, value in params.items() if value is not None}
        if body.get("stop") is not None:
            params["stop"] = string_list(body["stop"], "stop")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options", "must be an object")
        return ChatRequest(
            messages=_translate_messages(messages), tools=_tools(body.get("tools")),
            parse_tool_calls=tool_choice == "auto", sampling_params=params, stream=body.get("stream") is True,
            include_usage=stream_options.get("include_usage") is True, model=str(body.get("model") or ""),
        )

    def _tool_calls(self, answer: TurnAnswer) -> list[dict]:
        return [{"id": call_id, "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                for call, call_id in zip(answer.tool_calls, answer.tool_call_ids)]

    @staticmethod
    def _usage(answer: TurnAnswer) -> dict:
        return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
                "total_tokens": answer.prompt_tokens + answer.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}}

    def render_answer(self, answer: TurnAnswer) -> dict:
        message = {"role": "assistant", "content": answer.content if answer.content or not answer.tool_calls else None}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = self._tool_calls(answer)
        return {"id": f"chatcmpl-{answer.id}", "object": "chat.completion", "created": answer.created,
                "model": answer.model, "usage": self._usage(answer),
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": FINISH_REASONS[answer.finish]}]}

    def render_stream(self, answer: TurnAnswer) -> list[bytes]:
        def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
            return sse({"id": f"chatcmpl-{answer.id}", "object": "chat.completion.chunk", "created": answer.created,
                        "model": answer.model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]})

        frames = [chunk({"role": "assistant"})]
        if answer.reasoning:
            frames.append(chunk({"reasoning_content": answer.reasoning}))
        if answer.content:
            frames.append(chunk({"content": answer.content}))
        for index, call in enumerate(self._tool_calls(answer)):
            frames.append(chunk({"tool_calls": [{"index": index, **call}]}))
        frames.append(chunk({}, FINISH_REASONS[answer.finish]))
        if answer.request is not None and answer.request.include_usage:
            frames.append(sse({"id": f"chatcmpl-{answer.id}", "object": "chat.completion.chunk",
                               "created": answer.created, "model": answer.model, "choices": [],
                               "usage": self._usage(answer)}))
        return frames + [sse("[DONE]")]

    def error_body(self, status: int, message: str, param: str | None = None) -> dict:
        return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param,
                          "code": None}}
