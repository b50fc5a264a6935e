"""SGLang's native HTTP payloads: parse and validate request bodies, shape responses.

Pure functions over dicts (no HTTP framework, no torch), so every rule is testable without a server. A bad request
raises `RequestError` (a ValueError) whose message names the offending field; the server turns it into HTTP 400
`{"error": {"message": ...}}`. Not the engine and not the OpenAI dialect (`openai_api.py`).
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable

from slime.engine.sampling_params import SamplingParams

# Top-level /generate fields the built-in engine understands; anything else is rejected rather than ignored.
GENERATE_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "stream",
        "return_text_in_logprobs",
        "logprob_start_len",
        "top_logprobs_num",
        "return_routed_experts",
        "routed_experts_start_len",
        "lora_path",
        "image_data",
        # Added by sglang-router when it re-serializes a request; no effect on generation.
        "model",
        "log_metrics",
        "no_logs",
    }
)
# SGLang features the built-in engine lacks: accepted only when off (sglang-router always sends them, as false).
FEATURES_OFF = ("return_hidden_states", "background", "return_bytes", "return_entropy")


class RequestError(ValueError):
    """A client mistake: answered with HTTP 400 and this message."""


@dataclass
class GenerateItem:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    rid: str | None
    lora_path: str | None = None  # SGLang's: the name of a loaded LoRA adapter (None: the base model)
    # SGLang's image_data: the prompt's images in order (paths, file URLs, base64 / data URIs); None: none
    images: list | None = None


@dataclass
class GenerateRequest:
    items: list[GenerateItem]
    is_batch: bool
    return_logprob: bool
    return_text_in_logprobs: bool
    stream: bool
    # SGLang's: the routing of positions [routed_experts_start_len, len(tokens) - 1) in meta_info["routed_experts"];
    # None = not given (the server decides, see app.py).
    return_routed_experts: bool | None = None
    routed_experts_start_len: int = 0


def parse_generate_request(
    body, tokenize: Callable[[str], list[int]], vocab_size: int, max_model_len: int
) -> GenerateRequest:
    """Validate a /generate body and turn it into one GenerateItem per prompt."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_FIELDS - set(FEATURES_OFF))
    if unknown:
        raise RequestError(f"unknown /generate field(s) {unknown}; supported: {sorted(GENERATE_FIELDS)}")
    for name in FEATURES_OFF:
        if body.get(name) not in (None, False):
            raise RequestError(f"'{name}' is not supported by the built-in engine; leave it false")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("exactly one of 'text' and 'input_ids' must be given")
    return_logprob = _bool_field(body, "return_logprob", False)
    return_text_in_logprobs = _bool_field(body, "return_text_in_logprobs", False)
    stream = _bool_field(body, "stream", False)
    return_routed_experts = _bool_field(body, "return_routed_experts", None)
    routed_experts_start_len = body.get("routed_experts_start_len") or 0
    if not isinstance(routed_experts_start_len, int) or isinstance(routed_experts_start_len, bool) or (
        routed_experts_start_len < 0
    ):
        raise RequestError(f"'routed_experts_start_len' must be an int >= 0, got {routed_experts_start_len!r}")
    if body.get("logprob_start_len", -1) != -1:
        raise RequestError("logprob_start_len must be -1: the built-in engine returns output-token log-probs only")
    if body.get("top_logprobs_num", 0) not in (0, None):
        raise RequestError("top_logprobs_num must be 0: the built-in engine returns the sampled token's log-prob only")

    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("'text' must be a string or a non-empty list of strings")
        prompts = [tokenize(t) for t in texts]
        field = "text"
    else:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        field = "input_ids"
        for prompt in prompts:
            _check_token_ids(prompt, vocab_size)
    for index, prompt in enumerate(prompts):
        where = f"{field}[{index}]" if is_batch else field
        if not prompt:
            raise RequestError(f"'{where}' is empty: a prompt needs at least one token")
        if len(prompt) >= max_model_len:
            raise RequestError(
                f"'{where}' has {len(prompt)} tokens, which does not fit max_model_len={max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
    num_prompts = len(prompts)
    too_long = [len(prompt) for prompt in prompts if len(prompt) < routed_experts_start_len]
    if too_long:
        raise RequestError(f"'routed_experts_start_len' ({routed_experts_start_len}) exceeds the prompt's "
                           f"{too_long[0]} tokens: it must be in [0, prompt length]")
    raw_params, num_samples = _pop_parallel_sample_num(body.get("sampling_params"))
    sampling_params = _parse_sampling_params(raw_params, num_prompts, is_batch)
    lora_paths = _parse_lora_paths(body.get("lora_path"), num_prompts, is_batch)
    images = _parse_image_data(body.get("image_data"), num_prompts, is_batch)
    if num_samples > 1:
        items = _parallel_samples(body, prompts, sampling_params, num_samples, stream, lora_paths)
        images = [prompt_images for prompt_images in images for _ in range(num_samples)]
        is_batch = True  # SGLang answers a list, even for one prompt
    else:
        rids = _parse_rids(body.get("rid"), num_prompts, is_batch)
        if stream and is_batch:
            raise RequestError("'stream' is supported for a single prompt only; send one request per prompt")
        items = [GenerateItem(list(p), s, r, lora) for p, s, r, lora in zip(prompts, sampling_params, rids, lora_paths)]
    for item, prompt_images in zip(items, images):
        item.images = prompt_images
    return GenerateRequest(items, is_batch, return_logprob, return_text_in_logprobs, stream, return_routed_experts,
                           routed_experts_start_len)


def _parse_image_data(raw, num_prompts: int, is_batch: bool) -> list[list | None]:
    """SGLang's image_data, one entry per prompt: a reference or a list of references (a batch: a list of those,
    one per prompt). Only the shape is checked here; the engine decodes the references."""
    if raw is None:
        return [None] * num_prompts
    entries = raw if is_batch else [raw]
    if is_batch and (not isinstance(raw, list) or len(raw) != num_prompts):
        raise RequestError(f"'image_data' of a batch must be a list with one entry per prompt ({num_prompts})")
    parsed = []
    for entry in entries:
        references = entry if isinstance(entry, list) else ([] if entry is None else [entry])
        if not all(isinstance(reference, str) for reference in references):
            raise RequestError("'image_data' entries must be strings (a path, a file:// URL or base64 / a data URI)")
        parsed.append(references or None)
    return parsed


def _pop_parallel_sample_num(raw):
    """SGLang's parallel sampling: `sampling_params.n` (the same in every entry of a list) is a request-level
    count, not a sampling parameter. Returns the sampling params without it, and n."""
    entries = raw if isinstance(raw, list) else [raw]
    counts = {entry.get("n", 1) if isinstance(entry, dict) else 1 for entry in entries}
    if len(counts) > 1:
        raise RequestError(f"'sampling_params.n' must be the same for every prompt, got {sorted(map(str, counts))}")
    (num_samples,) = counts
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise RequestError(f"'sampling_params.n' must be an integer >= 1, got {num_samples!r}")
    stripped = [{k: v for k, v in entry.items() if k != "n"} if isinstance(entry, dict) else entry
                for entry in entries]
    return (stripped if isinstance(raw, list) else stripped[0]), num_samples


def _parallel_samples(body, prompts, sampling_params, num_samples: int, stream: bool,
                      lora_paths: list[str | None]) -> list[GenerateItem]:
    """n samples of each prompt as n engine requests, prompt-major (SGLang's order). The copies share the prompt's
    KV blocks through the prefix cache. With a sampling_seed s, sample j draws with seed s + j, so the n samples
    differ but stay reproducible."""
    if stream:
        raise RequestError("'stream' is not supported with sampling_params.n > 1; send n streaming requests")
    if body.get("rid") is not None:
        raise RequestError("'rid' is not supported with sampling_params.n > 1: each sample gets its own id "
                           "(meta_info.id); leave rid unset")
    items = []
    for prompt, params, lora_path in zip(prompts, sampling_params, lora_paths):
        for j in range(num_samples):
            seed = None if params.sampling_seed is None else params.sampling_seed + j
            items.append(GenerateItem(list(prompt), dataclasses.replace(params, sampling_seed=seed), None, lora_path))
    return items


def _bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean, got {value!r}")
    return value


def _check_token_ids(prompt, vocab_size: int) -> None:
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("'input_ids' must be a list of ints or a list of lists of ints")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"'input_ids' holds token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")


def _parse_sampling_params(raw, num_prompts: int, is_batch: bool) -> list[SamplingParams]:
    if is_batch and isinstance(raw, list):
        if len(raw) != num_prompts:
            raise RequestError(f"'sampling_params' is a list of {len(raw)} but there are {num_prompts} prompts")
        raws = raw
    else:
        raws = [raw] * num_prompts
    params = []
    for item in raws:
        if item is not None and not isinstance(item, dict):
            raise RequestError(f"'sampling_params' must be an object, got {item!r}")
        try:
            params.append(SamplingParams.from_dict(item))
        except (TypeError, ValueError) as error:
            raise RequestError(str(error)) from error
    return params


def _parse_lora_paths(raw, num_prompts: int, is_batch: bool) -> list[str | None]:
    """SGLang's `lora_path`: one adapter name for every prompt, or a list with one name (or null) per prompt."""
    if raw is None or isinstance(raw, str):
        if raw == "":
            raise RequestError("'lora_path' must be a loaded adapter's name or null, got ''")
        return [raw] * num_prompts
    if not is_batch or not isinstance(raw, list) or len(raw) != num_prompts or not all(
            item is None or (isinstance(item, str) and item) for item in raw):
        expected = f"a string or a list of {num_prompts} strings / nulls" if is_batch else "a string"
        raise RequestError(f"'lora_path' must be {expected} (adapter names), got {raw!r}")
    return list(raw)


def _parse_rids(raw, num_prompts: int, is_batch: bool) -> list[str | None]:
    if raw is None:
        return [None] * num_prompts
    rids = raw if is_batch else [raw]
    if not isinstance(rids, list) or len(rids) != num_prompts or not all(isinstance(r, str) and r for r in rids):
        expected = f"a list of {num_prompts} strings" if is_batch else "a non-empty string"
        raise RequestError(f"'rid' must be {expected}, got {raw!r}")
    if len(set(rids)) != len(rids):
        raise RequestError(f"'rid' values must be unique, got {rids!r}")
    return rids


def generate_response(output, return_logprob: bool, token_texts: list[str] | None = None,
                      routed_experts_start_len: int = 0) -> dict:
    """SGLang's /generate response for one request from an engine RequestOutput (cumulative so far).

    `token_texts` (one string per output token) fills the third slot of each log-prob entry when the client asked
    for return_text_in_logprobs; SGLang puts null there otherwise. A finished output with routed experts gets
    meta_info["routed_experts"]: its rows from `routed_experts_start_len` on, int32 bytes in base64 (SGLang's
    wire form), and meta_info["routed_experts_start_len"].
    """
    output_ids = list(output.output_token_ids)
    meta_info = {
        "id": output.rid,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": output.num_cached_tokens,
        "finish_reason": output.finish_reason if output.finished else None,
        "weight_version": output.weight_version,
    }
    if return_logprob:
        texts = token_texts if token_texts is not None else itertools.repeat(None, len(output_ids))
        # map / zip loop in C: a 256-token output renders ~3x faster than through a per-token comprehension
        meta_info["output_token_logprobs"] = list(map(list, zip(map(float, output.output_log_probs),
                                                                map(int, output_ids), texts)))
    if output.finished and output.routed_experts is not None:
        rows = output.routed_experts[routed_experts_start_len:]
        meta_info["routed_experts"] = base64.b64encode(rows.astype("<i4", copy=False).tobytes()).decode("ascii")
        meta_info["routed_experts_start_len"] = routed_experts_start_len
    return {"text": output.text, "output_ids": output_ids, "meta_info": meta_info}


def error_body(message: str, status_code: int = 400) -> dict:
    """The error JSON of every endpoint (OpenAI's shape, which SGLang also uses)."""
    kind = "BadRequestError" if status_code == 400 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "code": status_code}, "object": "error", "message": message}


def require_fields(body, endpoint: str, required: dict, optional: dict | None = None) -> dict:
    """Check a JSON body against {field: allowed type(s)}; return it with optional defaults filled in.

    Unknown fields, missing required ones and wrong types raise RequestError naming the field.
    """
    optional = optional or {}
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise RequestError(f"{endpoint} body must be a JSON object")
    unknown = sorted(set(body) - set(required) - set(optional))
    if unknown:
        raise RequestError(f"unknown {endpoint} field(s) {unknown}; supported: {sorted({**required, **optional})}")
    result = {}
    for name, types in required.items():
        if name not in body:
            raise RequestError(f"{endpoint} requires field '{name}'")
        result[name] = _typed(endpoint, name, body[name], types)
    for name, (types, default) in optional.items():
        value = body.get(name)
        result[name] = default if value is None else _typed(endpoint, name, value, types)
    return result


def _typed(endpoint: str, name: str, value, types):
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        raise RequestError(f"{endpoint} field '{name}' must be {_type_names(types)}, got {value!r}")
    if not isinstance(value, types):
        raise RequestError(f"{endpoint} field '{name}' must be {_type_names(types)}, got {value!r}")
    return value


def _type_names(types: tuple) -> str:
    return " or ".join(t.__name__ for t in types)
