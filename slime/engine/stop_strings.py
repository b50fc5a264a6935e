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


class FinalText:
    """A finished request's final text, decoded when first read (RequestOutput's detokenize callable): the engine's
    step leaves the decoding to the output's consumer, the server's event-loop thread (`decode_final_texts`)."""

    __slots__ = ("tokenizer", "seq")

    def __init__(self, tokenizer, seq):
        self.tokenizer, self.seq = tokenizer, seq  # a finished sequence no longer changes

    def __call__(self, output_token_ids: list[int]) -> str:
        return final_texts(self.tokenizer, [self.seq])[0]


def decode_final_texts(outputs) -> None:
    """Decode the final texts of the finished outputs not read yet, in one batched call (decode_many: a fast
    tokenizer's decode_batch runs in parallel and releases the GIL). The server's event loop calls it as a step's
    outputs arrive, so a cohort finishing together costs the engine's thread nothing (it held the step ~10 ms for
    32 requests of 256 tokens when the step decoded them)."""
    pending = [(output, getattr(output, "pending_detokenize", None)) for output in outputs if output.finished]
    pending = [(output, final) for output, final in pending if isinstance(final, FinalText)]
    if pending:
        texts = final_texts(pending[0][1].tokenizer, [final.seq for _, final in pending])
        for (output, _), text in zip(pending, texts):
            output.fill_text(text)


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
