"""OpenAI-compatible endpoints of the engine server: POST /v1/completions, POST /v1/chat/completions (the
tokenizer's chat template), GET /v1/models, streaming (SSE) and not, so agent code written against an OpenAI client
can be rolled out on the built-in engine.

Log-probs are those of the sampled token (the engine computes no top-k alternatives), so `top_logprobs` must be 0
and completions' `logprobs` must be 0. Fields the engine cannot honour (penalties, logit_bias, tools, echo, ...)
are rejected with HTTP 400 naming the field rather than silently ignored. Not the native API (`app.py`).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from slime.engine.sampling_params import SamplingParams
from slime.engine.server.io import json_response, read_json, sse_line, unless_disconnected
from slime.engine.server.lora_routes import adapter_for_model
from slime.engine.server.protocol import RequestError

# OpenAI / SGLang request fields -> SamplingParams fields (the extras are SGLang's, sent via `extra_body`).
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
}
# Accepted and without effect on generation.
PASSIVE_FIELDS = {"model", "user", "stream", "stream_options", "n", "rid", "parallel_tool_calls", "metadata", "store"}
# Accepted only at their neutral value: {field: allowed values}.
NEUTRAL_FIELDS = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "echo": (False, None),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}
COMPLETION_FIELDS = {"prompt", "max_tokens", "logprobs", "best_of"}
CHAT_FIELDS = {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs"}


def register_openai_routes(app: FastAPI, state) -> None:

    @app.get("/v1/models")
    async def list_models():
        adapters = await state.engine_loop.call(state.engine.loaded_lora_adapters)
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "slime",
                    "root": state.model_path,
                    "max_model_len": state.max_model_len,
                },
                # loaded LoRA adapters: `model` = an adapter's name generates with it (SGLang's convention)
                *({"id": name, "object": "model", "created": int(time.time()), "owned_by": "slime",
                   "root": source, "parent": state.served_model_name}
                  for name, source in adapters.items()),
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
        # Tokenizing (up to the body limit, megabytes of text) runs off the event loop: /health keeps answering.
        prompts = await asyncio.to_thread(_completion_prompts, body.get("prompt"), state)
        if body.get("logprobs") not in (None, 0):
            raise RequestError("'logprobs' must be null or 0: the engine returns the sampled token's log-prob only")
        best_of = body.get("best_of")
        if best_of not in (None, body.get("n", 1)):
            raise RequestError("'best_of' must equal 'n' (no server-side ranking)")
        want_logprobs = body.get("logprobs") == 0
        max_tokens = body.get("max_tokens", 16)
        return await _respond(request, state, body, prompts, max_tokens, want_logprobs, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
        prompt = await asyncio.to_thread(_chat_prompt, body.get("messages"), body.get("chat_template_kwargs"), state)
        if body.get("top_logprobs") not in (None, 0):
            raise RequestError("'top_logprobs' must be null or 0: the engine returns the sampled token's log-prob only")
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool) and logprobs is not None:
            raise RequestError(f"'logprobs' must be a boolean, got {logprobs!r}")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        return await _respond(request, state, body, [prompt], max_tokens, bool(logprobs), "chat.completion")


# ---- request parsing -------------------------------------------------------------------------------------------
def _check_fields(body, endpoint_fields: set, endpoint: str) -> None:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    known = endpoint_fields | set(SAMPLING_FIELDS) | PASSIVE_FIELDS | set(NEUTRAL_FIELDS)
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown {endpoint} field(s) {unknown}; supported: {sorted(known)}")
    for name, allowed in NEUTRAL_FIELDS.items():
        if name in body and body[name] not in allowed:
            raise RequestError(f"'{name}' is not supported by the built-in engine (got {body[name]!r})")
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
        raise RequestError(f"'n' must be an int in [1, 64], got {n!r}")
    if not isinstance(body.get("stream", False), bool):
        raise RequestError(f"'stream' must be a boolean, got {body['stream']!r}")


def _completion_prompts(prompt, state) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [state.tokenize(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [state.tokenize(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise RequestError("'prompt' must be a string, a list of strings, a list of ints or a list of lists of ints")
    for prompt_ids in prompts:
        _check_prompt(prompt_ids, state, "prompt")
    return prompts


def _chat_prompt(messages, template_kwargs, state) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"'messages[{index}]' must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                raise RequestError(f"'messages[{index}].content' parts must all be of type 'text'")
            content = "".join(part.get("text", "") for part in content)
        if not isinstance(content, str):
            raise RequestError(f"'messages[{index}].content' must be a string or a list of text parts")
        normalized.append({**message, "content": content})
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object")
    try:
        text = state.tokenizer.apply_chat_template(
            normalized, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
    except Exception as error:  # template errors are caused by the messages
        raise RequestError(f"'messages' could not be rendered with the chat template: {error}") from error
    prompt_ids = state.tokenize(text)
    _check_prompt(prompt_ids, state, "messages")
    return prompt_ids


def _check_prompt(prompt_ids: list[int], state, field: str) -> None:
    if not prompt_ids:
        raise RequestError(f"'{field}' is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.vocab_size for t in prompt_ids):
        raise RequestError(f"'{field}' holds token ids outside the vocabulary [0, {state.vocab_size})")
    if len(prompt_ids) >= state.max_model_len:
        raise RequestError(
            f"'{field}' has {len(prompt_ids)} tokens, which does not fit max_model_len={state.max_model_len}"
        )


def _sampling_params(body: dict, max_tokens, index: int) -> SamplingParams:
    params = {target: body[source] for source, target in SAMPLING_FIELDS.items() if body.get(source) is not None}
    if "sampling_seed" in params and isinstance(params["sampling_seed"], int):
        params["sampling_seed"] += index  # n samples with one seed must still differ
    params["max_new_tokens"] = max_tokens
    try:
        return SamplingParams.from_dict(params)
    except (TypeError, ValueError) as error:
        # Name the OpenAI field, not the engine's.
        message = str(error).replace("max_new_tokens", "max_tokens").replace("min_new_tokens", "min_tokens")
        raise RequestError(message.replace("sampling_seed", "seed")) from error


# ---- responses -------------------------------------------------------------------------------------------------
async def _respond(request, state, body, prompts, max_tokens, want_logprobs, kind):
    n = body.get("n", 1)
    jobs = [(prompt, _sampling_params(body, max_tokens, i)) for prompt in prompts for i in range(n)]
    stop_strings = jobs[0][1].stop
    request_id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = body.get("model") or state.served_model_name
    lora_name = adapter_for_model(state, model)
    loop = state.engine_loop

    if not body.get("stream", False):
        async def run(prompt, params):
            final = None
            async for output in loop.generate(prompt, params, incremental=False, lora_name=lora_name):
                final = output
            return final

        outputs = await unless_disconnected(request, asyncio.gather(*(run(p, s) for p, s in jobs)))
        if outputs is None:
            return PlainTextResponse("client disconnected", status_code=499)
        choices = [
            _choice(kind, index, output.text, _logprobs(kind, state, output, 0) if want_logprobs else None, output)
            for index, output in enumerate(outputs)
        ]
        return json_response({
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(outputs),
        })

    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(choices, usage=None):
        payload = {"id": request_id, "object": chunk_kind, "created": created, "model": model, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return sse_line(payload)

    async def events():
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index, prompt, params):
            try:
                async for output in loop.generate(prompt, params, lora_name=lora_name):
                    await queue.put((index, output))
            except Exception as error:  # noqa: BLE001
                await queue.put((index, error))

        tasks = [asyncio.create_task(pump(i, p, s)) for i, (p, s) in enumerate(jobs)]
        deltas = [TextDelta(stop_strings) for _ in jobs]
        num_tokens_sent = [0] * len(jobs)
        finals = [None] * len(jobs)
        try:
            if kind == "chat.completion":
                role_delta = {"role": "assistant", "content": ""}
                yield chunk(
                    [
                        {"index": i, "delta": role_delta, "logprobs": None, "finish_reason": None}
                        for i in range(len(jobs))
                    ]
                )
            while any(final is None for final in finals):
                index, output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                text = deltas[index].next(output.text, output.finished)
                logprobs = None
                if want_logprobs:
                    logprobs = _logprobs(kind, state, output, num_tokens_sent[index])
                    num_tokens_sent[index] = len(output.output_token_ids)
                finish_reason = output.finish_reason["type"] if output.finished else None
                if output.finished:
                    finals[index] = output
                if text or finish_reason or (logprobs and _has_tokens(logprobs)):
                    if kind == "chat.completion":
                        choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
                    else:
                        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
                    yield chunk([choice])
            if include_usage:
                yield chunk([], _usage(finals))
            yield sse_line("[DONE]")
        finally:
            for task in tasks:
                task.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


def _choice(kind, index, text, logprobs, output) -> dict:
    finish_reason = output.finish_reason["type"]
    if kind == "chat.completion":
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _logprobs(kind, state, output, start: int):
    """Log-probs of output tokens [start:] in the endpoint's OpenAI shape."""
    token_ids = list(output.output_token_ids)[start:]
    log_probs = [float(lp) for lp in list(output.output_log_probs)[start:]]
    tokens = state.token_texts(token_ids)
    if kind == "chat.completion":
        return {
            "content": [
                {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
                for token, lp in zip(tokens, log_probs)
            ]
        }
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": log_probs, "top_logprobs": None, "text_offset": offsets}


def _has_tokens(logprobs: dict) -> bool:
    return bool(logprobs.get("content") or logprobs.get("tokens"))


def _usage(outputs) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(o.output_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class TextDelta:
    """Turns a request's cumulative text into the new piece to stream, holding back what may still change: a
    trailing incomplete UTF-8 character ("\\ufffd") and a suffix that could be the start of a stop string (the
    engine trims stop strings from the final text)."""

    def __init__(self, stop_strings: list[str]):
        self.stop_strings = list(stop_strings)
        self.sent = ""

    def next(self, text: str, finished: bool) -> str:
        candidate = text if finished else self._stable_prefix(text)
        if not candidate.startswith(self.sent):
            return ""  # an already streamed piece changed; nothing can be taken back
        delta = candidate[len(self.sent):]
        self.sent = candidate
        return delta

    def _stable_prefix(self, text: str) -> str:
        stable = text.rstrip("\ufffd")
        hold = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop), len(stable)), hold, -1):
                if stable.endswith(stop[:size]):
                    hold = size
                    break
        return stable[: len(stable) - hold]
