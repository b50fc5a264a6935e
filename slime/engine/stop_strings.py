"""Stop-string detection on detokenized output, and the final text of a request (trimmed at its stop unless
no_stop_trim). Detection decodes only a tail window of tokens each step, so it costs O(window) per token.

Token-level stops (EOS, stop_token_ids, lengths) are the scheduler's; this module only deals with text.
"""

from __future__ import annotations

from slime.engine.sampling_params import SamplingParams


def find_new_stop(tokenizer, output_token_ids: list[int], params: SamplingParams) -> str | None:
    """The stop string completed by the last token, if any."""
    if not params.stop or len(output_token_ids) <= params.min_new_tokens:
        return None
    # A stop string of n characters spans at most 4n + 1 byte-level tokens.
    window = 4 * max(len(s) for s in params.stop) + 2
    tail = output_token_ids[-window:]
    text = tokenizer.decode(tail, skip_special_tokens=params.skip_special_tokens)
    previous = tokenizer.decode(tail[:-1], skip_special_tokens=params.skip_special_tokens)
    for stop in params.stop:
        if text.count(stop) > previous.count(stop):
            return stop
    return None


def final_text(tokenizer, output_token_ids: list[int], params: SamplingParams, finish_reason: dict | None) -> str:
    matched = (finish_reason or {}).get("matched") if (finish_reason or {}).get("type") == "stop" else None
    token_ids = output_token_ids
    if isinstance(matched, int) and not params.no_stop_trim:
        token_ids = output_token_ids[:-1]
    text = tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and not params.no_stop_trim:
        cut = text.rfind(matched)
        if cut >= 0:
            text = text[:cut]
    return text
