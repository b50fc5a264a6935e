"""One `/generate` request of the default rollout and what comes back: sampling params from the flags, the POST
(resent on a weight update's abort), the answer appended to the Sample (tokens, log-probs, routed experts, status),
and a group sharing its prompt sent as one request with n > 1. Plain functions of args and Samples; the rollout
loop, `generate` and `generate_and_rm` are sglang_rollout.py's (slime's plugins patch them there).
"""

from __future__ import annotations

import functools
import inspect
import operator

from slime.rollout.dataset import load_processor, prompt_token_ids, tokenizer_for
from slime.rollout.resend import post_generate
from slime.rollout.routed_experts import routed_experts_request, store_routed_experts
from slime.utils.engine_access import router_headers
from slime.utils.http_utils import router_url
from slime.utils.image_inputs import image_to_data_uri
from slime.utils.misc import load_function
from slime.utils.types import Sample

_LOG_PROB, _TOKEN_ID = operator.itemgetter(0), operator.itemgetter(1)  # of an output_token_logprobs entry


@functools.lru_cache(maxsize=32)
def load_hook(path: str, flag: str):
    return load_function(path, flag)


def takes_evaluation(generate_fn) -> bool:
    """slime passes `evaluation=` to a generate function whose signature has that parameter."""
    return "evaluation" in inspect.signature(generate_fn).parameters


def build_sampling_params(args, evaluation: bool = False) -> dict:
    """SGLang sampling params from the `--rollout-*` flags (`--eval-*` first when evaluating)."""

    def pick(name: str):
        value = getattr(args, f"eval_{name}", None) if evaluation else None
        return value if value is not None else getattr(args, f"rollout_{name}", None)

    params = {
        "temperature": pick("temperature"),
        "top_p": pick("top_p"),
        "top_k": pick("top_k"),
        "max_new_tokens": pick("max_response_len"),
        "stop": pick("stop"),
        "stop_token_ids": pick("stop_token_ids"),
        "min_new_tokens": pick("min_new_tokens"),
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
    }
    if params["max_new_tokens"] is None:
        raise ValueError("--rollout-max-response-len is required by the default rollout (max new tokens per sample)")
    return {key: value for key, value in params.items() if value is not None}


async def sample_continuation(args, sample: Sample, sampling_params: dict) -> str:
    """One POST /generate continuing `sample.tokens`: appends the sampled ids (loss mask 1, the engine's log-probs)
    and the text, sets the status from the finish reason, counts prefix-cache hits; returns the text sampled."""
    routing = routed_experts_request(args, sample)
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True, **routing,
               **image_data_request(sample)}
    output = await _post_generate(args, payload, sample)
    return _append_output(args, sample, output, routing.get("routed_experts_start_len", 0))


async def _post_generate(args, payload: dict, sample: Sample):
    """POST /generate through the router, routed by the sample's session; under fault tolerance re-sent (counted
    on `sample`) while its engine is recovered. LoRA: the request asks for the adapter version last pushed."""
    if args.lora_path and "lora_path" not in payload:
        payload = {**payload, "lora_path": args.lora_path}
    timeout = args.sglang_router_request_timeout_secs
    headers = {**router_headers(args), **({"X-SMG-Routing-Key": sample.session_id} if sample.session_id else {})}
    return await post_generate(args, f"{router_url(args)}/generate", payload, sample, timeout=timeout,
                               headers=headers)


def _append_output(args, sample: Sample, output: dict, routed_experts_start_len: int) -> str:
    """Apply one /generate result to `sample` (see sample_continuation); returns the text sampled."""
    meta = output.get("meta_info", {})
    logprob_items = meta.get("output_token_logprobs")
    if logprob_items is None:
        raise ValueError(f"{router_url(args)}/generate answered without meta_info.output_token_logprobs "
                         "(return_logprob was requested): not an SGLang-compatible engine?")
    text = output.get("text", "")
    # append_response_tokens makes them ints and floats
    sample.append_response_tokens(args, tokens=list(map(_TOKEN_ID, logprob_items)),
                                  log_probs=list(map(_LOG_PROB, logprob_items)), meta_info=meta, text=text)
    # The engine echoes the start it used (sglang-router 0.3.2 drops the field from the request).
    store_routed_experts(args, sample, meta, meta.get("routed_experts_start_len", routed_experts_start_len))
    return text


def encode_multimodal_prompt(args, sample: Sample) -> None:
    """A prompt with images: its ids with every image expanded to its image tokens, and the pixel values and grids
    the trainer needs (`multimodal_train_inputs`), from one call of the checkpoint's processor (the one image-size
    policy, so the engine and the trainer count the same image tokens)."""
    encode_multimodal_text(args, sample, sample.prompt)


def encode_multimodal_text(args, sample: Sample, text: str) -> None:
    """encode_multimodal_prompt with the prompt rendered as `text` (multi-turn renders it with its tools)."""
    encoded = encode_with_images(args, text, sample.multimodal_inputs["images"])
    if not sample.tokens:
        sample.tokens = encoded.input_ids
    elif sample.tokens[:len(encoded.input_ids)] != encoded.input_ids:  # a partial sample restored from a saved buffer
        raise ValueError(f"sample {sample.index}: its tokens do not start with its prompt encoded with its images; "
                         "a custom rollout must keep the processor's prompt ids (encode_multimodal_prompt)")
    sample.multimodal_train_inputs = {"pixel_values": encoded.pixel_values, "image_grid_thw": encoded.image_grid_thw}


def encode_with_images(args, text: str, images: list):
    """`text` with one image placeholder per image, encoded by the checkpoint's processor (images expanded)."""
    return load_processor(str(args.hf_checkpoint)).encode(text, images)


def add_turn_images(sample: Sample, images: list, encoded) -> None:
    """Multi-turn: the images of a between-turn text (an environment's observation) join the sample's, after its
    earlier ones (`multimodal_inputs`, `multimodal_train_inputs`), so the next request's `image_data` and the
    trainer's pixel values cover every image of the conversation in order."""
    import torch

    if not images:
        return
    inputs = sample.multimodal_inputs or {}
    sample.multimodal_inputs = {**inputs, "images": list(inputs.get("images") or []) + list(images)}
    previous = sample.multimodal_train_inputs
    new = {"pixel_values": encoded.pixel_values, "image_grid_thw": encoded.image_grid_thw}
    sample.multimodal_train_inputs = new if not previous else {key: torch.cat([previous[key], new[key]]) for key in new}


def image_data_request(sample: Sample) -> dict:
    """SGLang's `image_data` of a sample's images (lossless PNG data URIs, in prompt order), {} without images. The
    ids already hold each image's tokens, expanded by the same processor the engine uses."""
    images = (sample.multimodal_inputs or {}).get("images")
    return {"image_data": [image_to_data_uri(image) for image in images]} if images else {}


def group_prompt_ids(args, group: list[Sample]) -> list[int] | None:
    """The prompt ids of a group that one /generate with sampling_params.n can sample: fresh samples of one prompt
    that the default generate function would sample one by one (no generate hook, one turn, nothing generated yet,
    no per-sample hooks after generation). None when the group must go sample by sample."""
    if len(group) < 2 or args.custom_generate_function_path or args.max_turns > 1:
        return None
    if args.rollout_sample_hook_path:
        return None
    if any(s.generate_function_path or s.tokens or s.response_length or s.status != Sample.Status.PENDING
           for s in group):
        return None
    if any(_prompt_key(s) != _prompt_key(group[0]) for s in group[1:]):
        return None
    if group[0].multimodal_inputs:  # once for the group: the ids with the images expanded, and their pixels
        encode_multimodal_prompt(args, group[0])
        prompt_ids, group[0].tokens = group[0].tokens, []
        return prompt_ids
    tokenizer = tokenizer_for(args)
    if tokenizer is None:
        raise ValueError("the default rollout needs --hf-checkpoint: its tokenizer turns prompts into token ids")
    # Once per group, not per sample: a prompt through the chat template and the tokenizer costs milliseconds.
    return prompt_token_ids(tokenizer, group[0])


def _prompt_key(sample: Sample):
    """What a sample's prompt ids are made from (prompt_token_ids): the prompt, for chat messages the tools, and the
    images (by size and pixels: a group's copies hold equal images, not the same objects)."""
    tools = sample.metadata.get("tools") if isinstance(sample.metadata, dict) else None
    images = (sample.multimodal_inputs or {}).get("images") or []
    return sample.prompt, tools, [(image.size, image.tobytes()) for image in images]


async def generate_group_in_one_request(args, group: list[Sample], prompt_ids: list[int], sampling_params: dict,
                                        state) -> None:
    """`state`: the rollout's GenerateState (sglang_rollout.py). The group's n samples from one /generate with SGLang's sampling_params.n (one HTTP round trip and one
    response instead of n; the engine admits the copies together, so they share the prompt's KV blocks)."""
    async with state.semaphore:
        if state.aborted:
            for sample in group:
                sample.status = Sample.Status.ABORTED
            return
        for sample in group:
            sample.tokens = list(prompt_ids)
            sample.multimodal_train_inputs = group[0].multimodal_train_inputs  # (group_prompt_ids encoded them)
        payload = {"input_ids": prompt_ids, "sampling_params": {**sampling_params, "n": len(group)},
                   "return_logprob": True, **routed_experts_request(args, group[0]),  # R3: each sample's routing
                   **image_data_request(group[0])}
        outputs = await _post_generate(args, payload, group[0])
    if not isinstance(outputs, list) or len(outputs) != len(group):
        raise RuntimeError(f"/generate with sampling_params.n={len(group)} answered {type(outputs).__name__} "
                           f"of {len(outputs) if isinstance(outputs, list) else 1} result(s); the engine must "
                           "support SGLang's parallel sampling")
    num_resends = group[0].metadata.get("num_resends")  # a re-sent request re-sends every sample of the group
    for sample, output in zip(group, outputs):
        if num_resends:
            sample.metadata["num_resends"] = num_resends
        _append_output(args, sample, output, routed_experts_start_len=0)
