"""The one turn flow both agent protocols share: session lifecycle, HTTP app, engine call, trajectory record.

A protocol adapter (`OpenAIAdapter`, `AnthropicAdapter`) subclasses `BaseAdapter` and provides its route and four
methods: `parse_request(body) -> ChatRequest` (messages in the chat template's shape, tools in OpenAI's function shape,
sampling fields; `RequestError(param, message)` for a bad field), `render_answer(answer) -> dict`,
`render_stream(answer) -> list[bytes]` (SSE frames) and `error_body(status, message, param)`. Everything else is here.

One turn: the session id (`Authorization: Bearer <id>`, then the protocol's own places; 401 none, 404 unknown,
409 finished) -> parse (400 naming the field) -> turn cap (429) -> render the chat template to ids -> POST the
router's /generate with `input_ids`, `return_logprob`, the LoRA adapter of the moment (`lora_path`, if any) and
the header `X-SMG-Routing-Key: <session id>` (keeps a session on one engine for its prefix cache) -> parse reasoning and tool calls from the sampled text (a call in the
Qwen3-Coder XML form is read whatever the tool parser) -> record a `TurnRecord` -> answer. The stream is rendered
from the finished turn (the engine call is not streamed token by token).

Not the wire formats (openai.py, anthropic.py), not the linearisation of turns (`slime.agent.trajectory`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from aiohttp import web

from slime.agent.adapters.paused_turns import generate_through_pushes
from slime.agent.adapters.reasoning import get_reasoning_parser
from slime.agent.message_tree import routing_message
from slime.agent.trajectory import DEFAULT_FORK_THRESHOLD_TOKENS, TrajectoryManager, TurnRecord
from slime.utils.http_utils import EndpointUnreachableError, HTTPRequestError, request_json
from slime.utils.tool_parsers import ToolCall, get_parser, stop_strings_for, with_xml_fallback
from slime.utils.types import Sample

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# The openai and anthropic SDKs retry a 429 unless told not to; a spent turn budget does not come back.
NO_RETRY_HEADERS = {"x-should-retry": "false"}


DEFAULT_SESSION_ID = "default"  # slime's session of a request that names none; here only if the rollout opened it


def header(request, name: str) -> str:
    """A request header by case-insensitive name ("" if absent), from aiohttp's headers or a plain dict."""
    lowered = name.lower()
    return next((str(v) for k, v in request.headers.items() if k.lower() == lowered), "")


def bearer_token(request) -> str:
    """The token of an `Authorization: Bearer <token>` header ("" if none)."""
    authorization = header(request, "Authorization")
    return authorization[len("Bearer "):].strip() if authorization.startswith("Bearer ") else ""


class RequestError(ValueError):
    """A request the adapter cannot serve: `param` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None  # OpenAI function shape: {"type": "function", "function": {"name", "parameters"}}
    parse_tool_calls: bool  # tool_choice none: tools stay in the prompt, the output is not parsed for calls
    sampling_params: dict  # engine names: temperature, top_p, top_k, max_new_tokens, stop, sampling_seed
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    ignored_tools: list[str] = field(default_factory=list)  # tools a chat template cannot offer (Responses API)


@dataclass
class TurnAnswer:
    """One sampled turn, protocol-neutral: what an adapter's renderers turn into wire JSON or SSE."""

    id: str
    model: str
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    tool_call_ids: list[str]
    finish: str  # stop | stop_sequence | length | tool_calls
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))
    request: ChatRequest | None = None


@dataclass
class _Session:
    sampling_defaults: dict
    max_context_tokens: int = 0  # 0: the engine's own limit
    lora_path: Callable[[], str | None] | None = None  # the session's LoRA adapter of the moment, else the adapter's
    num_turns: int = 0
    closed: bool = False
    in_flight: set = field(default_factory=set)
    turn_stats: list = field(default_factory=list)  # per recorded turn, in the manager's turn order


def sse(data: dict | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


def text_of(content, param: str) -> str:
    """The text of a message content: a string, or a list of text parts (OpenAI "text", Anthropic "text")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(param, f"must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"{param}[{i}]", 'only text parts {"type": "text", "text": ...} are supported')
        texts.append(part["text"])
    return "".join(texts)


def number(body: dict, key: str, low: float, high: float, integer: bool = False, low_open: bool = False):
    """body[key] checked to be a number in [low, high] ((low, high] with low_open); None when absent."""
    value = body.get(key)
    if value is None:
        return None
    numeric = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if not numeric or not (low < value if low_open else low <= value) or value > high:
        kind = "an integer" if integer else "a number"
        raise RequestError(key, f"must be {kind} in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return value


def string_list(value, param: str) -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise RequestError(param, "must be a non-empty string or a list of non-empty strings")
    return values


class BaseAdapter:
    """Session lifecycle and the shared turn flow; subclasses provide the wire format (module docstring)."""

    route = ""
    tool_call_id_prefix = "call_"

    def __init__(self, *, tokenizer, sglang_url: str, tool_parser: str = "qwen", reasoning_parser: str | None = None,
                 max_turns: int | None = None, headers: dict | None = None,
                 fork_threshold_tokens: int = DEFAULT_FORK_THRESHOLD_TOKENS, request_timeout_s: float | None = None,
                 max_turns_per_sid: int | None = None, lora_path: Callable[[], str | None] | None = None,
                 resume_aborted_turns: bool = False):
        """`lora_path`: asked at every turn, the LoRA adapter the engine samples it with (SGLang's `lora_path`), or
        None for the base model; a LoRA run's rollout passes `lambda: args.lora_path`, the version last pushed."""
        if max_turns_per_sid is not None:  # slime's name of the same cap
            if max_turns is not None and max_turns != max_turns_per_sid:
                raise ValueError(f"max_turns={max_turns} and max_turns_per_sid={max_turns_per_sid} disagree: they "
                                 "name one cap, pass one of them")
            max_turns = max_turns_per_sid
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 (or None for no cap), got {max_turns}")
        self.tokenizer = tokenizer
        self.sglang_url = sglang_url.rstrip("/")
        self.tool_parser = get_parser(tool_parser)
        self.reasoning_parser = get_reasoning_parser(reasoning_parser)
        self.max_turns = max_turns
        self.headers = dict(headers or {})
        self.request_timeout_s = request_timeout_s
        self.lora_path = lora_path or (lambda: None)
        self.resume_aborted_turns = resume_aborted_turns  # --fully-async: a weight push's abort is not the turn's end
        self.manager = TrajectoryManager(fork_threshold_tokens=fork_threshold_tokens, tokenizer=tokenizer)
        self.model_name = str(getattr(tokenizer, "name_or_path", "") or "slime")
        self._end_token_texts = end_token_texts(tokenizer)
        template_params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
        self._template_takes_return_dict = any(p.name == "return_dict" or p.kind == p.VAR_KEYWORD
                                               for p in template_params)
        self._sessions: dict[str, _Session] = {}
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_post(self.route, self._handle)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def open_session(self, session_id: str, sampling_defaults: dict | None = None, max_context_tokens: int = 0,
                     lora_path: Callable[[], str | None] | None = None) -> None:
        """Accept turns for `session_id` (the key the agent client authenticates with); `sampling_defaults` in the
        engine's names (temperature, top_p, max_new_tokens, stop, ...), overridden per request by the client, but
        for max_new_tokens: a turn samples at most the smaller of the default's and the client's. With
        `max_context_tokens` (slime's `--rollout-max-context-len`) a turn also stops there: prompt plus output never
        exceed it, and a prompt that already fills it is answered as a turn cut by length, with no engine call.
        `lora_path`: the session's own LoRA adapter of the moment (several adapters: the sample's, e.g.
        `lambda: request_lora_path(args, sample.metadata)`), instead of the adapter-wide one."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open; session ids must be unique")
        if not isinstance(max_context_tokens, int) or max_context_tokens < 0:
            raise ValueError(f"max_context_tokens must be an integer >= 0 (0: no limit), got {max_context_tokens!r}")
        self._sessions[session_id] = _Session(dict(sampling_defaults or {}), max_context_tokens, lora_path)

    async def shutdown_session(self, session_id: str, timeout_s: float = 30.0) -> None:
        """Refuse new turns of the session (409) and wait for the ones in flight (cancelled after `timeout_s`)."""
        session = self._session_or_error(session_id)
        session.closed = True
        tasks = [task for task in session.in_flight if not task.done()]
        if not tasks:
            return
        loop = tasks[0].get_loop()

        async def drain():
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()

        if loop is asyncio.get_running_loop():
            await drain()
        else:  # the app serves on another thread's loop
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drain(), loop))

    async def finish_session(self, session_id: str, base_sample=None, timeout_s: float = 30.0, *,
                             reward=None, extra_metadata: dict | None = None) -> list:
        """Close the session, wait for its turns in flight, and return its Samples (siblings; see
        `slime.agent.trajectory`); the session is forgotten afterwards. `reward` (when given) is every sibling's
        reward, as in slime; `extra_metadata` is merged into each sibling's metadata. Each sibling's
        `metadata["turn_stats"]` lists its turns' prompt / cached / output token counts and tool calls, and its
        `prefix_cache_info` sums them (the rollout's `rollout/prefix_cache_hit_rate`)."""
        await self.shutdown_session(session_id, timeout_s)
        base_sample = base_sample if base_sample is not None else Sample()
        samples = self.manager.get_trajectory(session_id, base_sample=base_sample,
                                              reward=reward if reward is not None else base_sample.reward)
        turn_stats = self._sessions[session_id].turn_stats
        self.drop_session(session_id)
        for sample in samples:
            sample.metadata.update(extra_metadata or {})
            stats = [turn_stats[i] for i in sample.metadata["turn_indices"] if i < len(turn_stats)]
            sample.metadata["turn_stats"] = stats
            sample.prefix_cache_info = type(sample.prefix_cache_info)(
                cached_tokens=sum(t["cached_tokens"] for t in stats),
                total_prompt_tokens=sum(t["prompt_tokens"] for t in stats))
        return samples

    def drop_session(self, session_id: str) -> None:
        """Forget the session and its turns (a turn still in flight is not recorded)."""
        self._sessions.pop(session_id, None)
        self.manager.drop_session(session_id)

    def _session_or_error(self, session_id: str) -> _Session:
        if session_id not in self._sessions:
            raise ValueError(f"session {session_id!r} is not open (open_session first)")
        return self._sessions[session_id]

    # ---- wire hooks ------------------------------------------------------------------------------------------
    def parse_request(self, body: dict) -> ChatRequest:
        raise NotImplementedError

    def render_answer(self, answer: TurnAnswer) -> dict:
        raise NotImplementedError

    def render_stream(self, answer: TurnAnswer) -> list[bytes]:
        raise NotImplementedError

    def error_body(self, status: int, message: str, param: str | None = None) -> dict:
        raise NotImplementedError

    # ---- the turn --------------------------------------------------------------------------------------------
    @staticmethod
    def _error(wire, status: int, message: str, param: str | None = None, headers: dict | None = None):
        return web.json_response(wire.error_body(status, message, param), status=status, headers=headers)

    def request_session_id(self, request, body: dict) -> str:
        """The session a request belongs to (DEFAULT_SESSION_ID when it names none); each protocol says where it
        looks (`_request_session_id` of anthropic.py and openai.py, slime's rules)."""
        raise NotImplementedError

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        return await self.handle_turn(request, self)

    async def handle_turn(self, request: web.Request, wire) -> web.StreamResponse:
        """One turn of the session named by the request's API key; `wire` parses the body and renders the answer
        (`parse_request`, `render_answer`, `render_stream`, `error_body`): the adapter itself, or a second protocol
        it serves on another route (the OpenAI adapter's Responses API)."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return self._error(wire, 400, f"body: is not JSON ({error})", "body")
        session_id = self.request_session_id(request, body if isinstance(body, dict) else {})
        session = self._sessions.get(session_id)
        if session is None and session_id == DEFAULT_SESSION_ID:
            return self._error(wire, 401, "no session: send the session id as the API key (Authorization: Bearer <id> "
                                    "or x-api-key: <id>)")
        if session is None:
            return self._error(wire, 404, f"unknown session {session_id!r}: the rollout did not open it or finished it")
        if session.closed:
            return self._error(wire, 409, f"session {session_id!r} is finished and takes no more turns")
        try:
            if not isinstance(body, dict):
                raise RequestError("body", f"must be a JSON object, got {type(body).__name__}")
            chat = wire.parse_request(body)
        except RequestError as error:
            return self._error(wire, 400, str(error), error.param)
        if self.max_turns is not None and session.num_turns >= self.max_turns:
            return self._error(wire, 429, f"session {session_id!r} reached its turn cap (max_turns={self.max_turns}); "
                                    "the episode is over", headers=NO_RETRY_HEADERS)
        session.num_turns += 1
        task = asyncio.current_task()
        session.in_flight.add(task)
        try:
            return await self._turn(request, session_id, chat, wire)
        finally:
            session.in_flight.discard(task)

    async def _turn(self, request: web.Request, session_id: str, chat: ChatRequest,
                    wire) -> web.StreamResponse:
        try:
            prompt_ids = await asyncio.to_thread(self._render, chat)
        # the chat template rejected the conversation (jinja raises many types)
        except Exception as error:  # noqa: BLE001
            return self._error(wire, 400, f"the chat template cannot render these messages: {error}", "messages")
        sampling_params, tool_stops = self._sampling_params(session_id, chat)
        room = self._sessions[session_id].max_context_tokens - len(prompt_ids)
        if self._sessions[session_id].max_context_tokens and room <= 0:  # the context is full: the episode is over
            engine = TurnRecord(prompt_ids, [], "length", [], text="")
        else:
            if self._sessions[session_id].max_context_tokens:
                sampling_params["max_new_tokens"] = min(sampling_params.get("max_new_tokens", room), room)
            try:
                engine = await call_sglang_generate(prompt_ids, self._sessions[session_id], sampling_params,
                                                    adapter=self, session_id=session_id)
            except (HTTPRequestError, EndpointUnreachableError) as error:
                return self._error(wire, 502, f"the inference engine failed: {error}")
            except (KeyError, TypeError, ValueError) as error:
                return self._error(wire, 502, f"the inference engine answered in an unexpected shape: {error}")
        answer, turn = self._answer(engine, chat, tool_stops)
        if session_id in self._sessions and turn.output_ids:  # not dropped while the engine sampled
            reply = {"role": "assistant", "content": answer.content,
                     "tool_calls": [{"name": call.name, "arguments": call.arguments} for call in answer.tool_calls]}
            self.manager.record_turn(session_id, turn=turn, prompt_messages=[routing_message(m) for m in chat.messages],
                                     response_message=routing_message(reply))
            self._sessions[session_id].turn_stats.append({
                "prompt_tokens": len(turn.prompt_ids), "cached_tokens": turn.cached_tokens,
                "output_tokens": len(turn.output_ids), "tool_calls": len(answer.tool_calls)})
        if not chat.stream:
            return web.json_response(wire.render_answer(answer))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for frame in wire.render_stream(answer):
            await response.write(frame)
        await response.write_eof()
        return response

    def _render(self, chat: ChatRequest) -> list[int]:
        kwargs = {"tools": chat.tools or None, "add_generation_prompt": True, "tokenize": True}
        if self._template_takes_return_dict:  # transformers 5 returns a BatchEncoding unless told not to
            kwargs["return_dict"] = False
        return list(self.tokenizer.apply_chat_template(chat.messages, **kwargs))

    def _sampling_params(self, session_id: str, chat: ChatRequest) -> tuple[dict, list[str]]:
        session = self._sessions[session_id]
        params = {**session.sampling_defaults, **chat.sampling_params}
        limits = [n for n in (session.sampling_defaults.get("max_new_tokens"), chat.sampling_params.get(
            "max_new_tokens")) if n is not None]
        if limits:
            params["max_new_tokens"] = min(limits)
        tool_stops = stop_strings_for(self.tool_parser, chat.tools) if chat.tools and chat.parse_tool_calls else []
        user_stops = string_list(self._sessions[session_id].sampling_defaults.get("stop"), "stop")
        user_stops += [s for s in chat.sampling_params.get("stop", []) if s not in user_stops]
        params["stop"] = user_stops + [s for s in tool_stops if s not in user_stops]
        params["no_stop_trim"] = True  # the parser needs a call's closing tag; a client's own stop is cut below
        return params, tool_stops

    def _interpret(self, result: dict, chat: ChatRequest, prompt_ids: list[int],
                   tool_stops: list[str]) -> tuple[TurnAnswer, TurnRecord]:
        """The answer and the trajectory record of an engine's /generate result."""
        return self._answer(engine_turn(result, prompt_ids), chat, tool_stops)

    def _answer(self, engine: TurnRecord, chat: ChatRequest, tool_stops: list[str]) -> tuple[TurnAnswer, TurnRecord]:
        output_ids = engine.output_ids
        text = engine.text if engine.text is not None else self.tokenizer.decode(output_ids, skip_special_tokens=False)
        stop_sequence, matched = None, engine.matched_stop
        if engine.finish_reason == "stop" and matched is not None and matched not in tool_stops:
            text, stop_sequence = text[:text.rfind(matched)] if matched in text else text, matched
        if engine.finish_reason == "stop" and output_ids and output_ids[-1] in self._end_token_texts:
            # The model's end-of-turn token ends the reply; its text (kept with skip_special_tokens false) is not
            # part of what the client reads. The id stays in the trajectory.
            text = text.removesuffix(self._end_token_texts[output_ids[-1]])
        reasoning, content = self.reasoning_parser(text) if self.reasoning_parser else ("", text)
        calls, ill_formed = [], False
        if chat.tools and chat.parse_tool_calls:
            parsed = with_xml_fallback(self.tool_parser, content, chat.tools)
            calls = [call for call in parsed.calls if call.error is None]
            ill_formed = len(calls) < len(parsed.calls)
            for call in calls:  # a call that failed to parse stays in the text, where the client can see it
                content = content.replace(call.raw, "", 1)
            content = content.strip() if calls else content
        if engine.finish_reason in ("length", "abort"):
            finish_name = "length"
        elif calls:
            finish_name = "tool_calls"
        else:
            finish_name = "stop_sequence" if stop_sequence is not None else "stop"
        answer = TurnAnswer(
            id=uuid.uuid4().hex, model=chat.model or self.model_name, content=content, reasoning=reasoning,
            tool_calls=calls, tool_call_ids=[f"{self.tool_call_id_prefix}{uuid.uuid4().hex[:24]}" for _ in calls],
            finish=finish_name, stop_sequence=stop_sequence, prompt_tokens=len(engine.prompt_ids),
            completion_tokens=len(output_ids), cached_tokens=engine.cached_tokens, request=chat,
        )
        return answer, dataclasses.replace(engine, ill_formed=ill_formed)


def end_token_texts(tokenizer) -> dict[int, str]:
    """The text of the tokenizer's end-of-turn ids (eos, <|im_end|>) by id; {} for a tokenizer without them."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    candidates = {getattr(tokenizer, "eos_token_id", None), convert("<|im_end|>") if convert else None}
    end_ids = {i for i in candidates - {None, getattr(tokenizer, "unk_token_id", None)} if isinstance(i, int)}
    return {i: tokenizer.convert_ids_to_tokens(i) for i in end_ids}


def engine_turn(result: dict, prompt_ids: list[int]) -> TurnRecord:
    """A TurnRecord of the engine's /generate answer: the sampled ids (`output_ids`, else the ids of
    `meta_info.output_token_logprobs`), their log-probs, the finish reason, the text and cache counters."""
    meta = result.get("meta_info", {})
    entries = meta.get("output_token_logprobs", [])
    output_ids = list(result["output_ids"]) if "output_ids" in result else [int(entry[1]) for entry in entries]
    log_probs = [float(entry[0]) for entry in entries]
    if len(log_probs) != len(output_ids):
        raise ValueError(f"the engine returned {len(log_probs)} log-probs for {len(output_ids)} tokens")
    finish = meta.get("finish_reason") or {"type": "stop"}
    matched = finish.get("matched")
    return TurnRecord(list(prompt_ids), output_ids, finish.get("type", "stop"), log_probs,
                      weight_version=meta.get("weight_version"), text=result.get("text"),
                      matched_stop=matched if isinstance(matched, str) else None,
                      cached_tokens=int(meta.get("cached_tokens") or 0))


async def call_sglang_generate(prompt_ids: list[int], session, body: dict, *, adapter: BaseAdapter,
                               session_id: str | None = None) -> TurnRecord:
    """One engine call of a turn: `prompt_ids` with the sampling params `body` to the router's /generate, with the
    routing key of the session (its prefix cache stays on one engine). Module-level, as in slime: tests replace it."""
    payload = {"input_ids": list(prompt_ids), "sampling_params": body, "return_logprob": True}
    lora_path = (session.lora_path or adapter.lora_path)()
    if lora_path is not None:
        payload["lora_path"] = lora_path
    headers = {**adapter.headers, **({ROUTING_KEY_HEADER: session_id} if session_id else {})}
    async def post(body: dict) -> dict:
        return await request_json("POST", f"{adapter.sglang_url}/generate", body, headers=headers,
                                  timeout=adapter.request_timeout_s)

    result, versions = await generate_through_pushes(post, payload, adapter.resume_aborted_turns, adapter.tokenizer)
    return replace(engine_turn(result, prompt_ids), output_weight_versions=versions)
