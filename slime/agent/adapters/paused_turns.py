"""One agent turn through weight pushes (`train_async.py --fully-async`): a push pauses the engines in `abort` mode,
so a turn in flight comes back with finish reason `abort` and the tokens sampled so far. With
`resume_aborted_turns` the adapter sends the turn again from those tokens (prompt + output so far, the remaining
`max_new_tokens`) until it finishes for another reason, and hands back one answer: the ids, log-probs and text of
every segment joined, and the weight version of each output token. The agent client never sees the pause.

What it is not: a retry of failed requests (an HTTP error ends the turn as before) or of a client's own abort.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable


async def generate_through_pushes(post: Callable[[dict], Awaitable[dict]], payload: dict, resume: bool,
                                  tokenizer) -> tuple[dict, list[str | None]]:
    """(the /generate result of the whole turn, one weight version per output id). `post(payload)` sends one
    request; `resume` False sends exactly one."""
    prompt_ids, params = list(payload["input_ids"]), dict(payload["sampling_params"])
    output_ids: list[int] = []
    log_prob_items: list = []
    versions: list[str | None] = []
    texts: list[str] = []
    while True:
        result = await post({**payload, "input_ids": prompt_ids + output_ids, "sampling_params": params})
        meta = result.get("meta_info", {})
        ids = list(result.get("output_ids", []))
        output_ids += ids
        log_prob_items += list(meta.get("output_token_logprobs", []))
        version = meta.get("weight_version")
        versions += [None if version is None else str(version)] * len(ids)
        texts.append(result.get("text", ""))
        finish = meta.get("finish_reason") or {}
        remaining = params.get("max_new_tokens")
        if remaining is not None:
            remaining -= len(ids)
        if not (resume and finish.get("type") == "abort") or remaining == 0:
            break
        if remaining is not None:
            params = {**params, "max_new_tokens": remaining}
    if len(texts) == 1:
        return result, versions
    # one decode of the joined ids: a character split across two segments decodes whole
    text = tokenizer.decode(output_ids, skip_special_tokens=bool(params.get("skip_special_tokens", False)))
    joined = {**result, "text": text, "output_ids": output_ids,
              "meta_info": {**meta, "output_token_logprobs": log_prob_items, "completion_tokens": len(output_ids)}}
    return joined, versions
