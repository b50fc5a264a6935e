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


def final_texts(tokenizer, seqs) -> list[str]:
    """The final text of each finished sequence: its output decoded, trimmed at its stop (a stop token is dropped, a
    stop string cut) unless no_stop_trim. Decoded in one call per skip_special_tokens setting (see decode_many)."""
    token_lists, matches = [], []
    for seq in seqs:
        finish_reason = seq.finish_reason or {}
        matched = finish_reason.get("matched") if finish_reason.get("type") == "stop" else None
        trim = not seq.sampling_params.no_stop_trim
        token_lists.append(seq.output_token_ids[:-1] if isinstance(matched, int) and trim else seq.output_token_ids)
        matches.append(matched if isinstance(matched, str) and trim else None)
    texts = [""] * len(seqs)
    for skip in {seq.sampling_params.skip_special_tokens for seq in seqs}:
        rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.skip_special_tokens == skip]
        for row, text in zip(rows, decode_many(tokenizer, [token_lists[i] for i in rows], skip)):
            cut = text.rfind(matches[row]) if matches[row] is not None else -1
            texts[row] = text[:cut] if cut >= 0 else text
    return texts


def decode_many(tokenizer, token_lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """`tokenizer.decode` of each list. A fast (Rust) tokenizer decodes them all in one call that runs in parallel:
    when a batch of requests finishes in the same step (common in RL rollouts: same max length), decoding them one
    by one held the engine for ~28 ms per 256 sequences of 256 tokens on an H200 host. Tokenizers that clean up
    spaces after decoding, and slow ones, go one by one."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (len(token_lists) < 2 or not hasattr(backend, "decode_batch")
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return [tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens) for tokens in token_lists]
    return backend.decode_batch(token_lists, skip_special_tokens=skip_special_tokens)
