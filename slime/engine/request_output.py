"""What the engine reports about a request after a step: tokens and log-probs so far, text, finish reason.

A plain record built by the engine; `to_dict` gives the blocking `Engine.generate` result shape. The text is
detokenized lazily on first access (a streaming consumer that never reads it pays nothing). It does not know how
the HTTP server renders it (SGLang's meta_info lives in the server).
"""

from __future__ import annotations

from collections.abc import Callable


class RequestOutput:
    """rid, prompt_token_ids, output_token_ids, output_log_probs (one per output token, under logits / T), text,
    finished, finish_reason ({"type": "stop"|"length"|"abort", plus "matched" | "length" | "message"} or None while
    running), num_cached_tokens (prompt tokens served by the prefix cache), weight_version."""

    def __init__(
        self,
        rid: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        output_log_probs: list[float],
        text: str | None = None,
        finished: bool = False,
        finish_reason: dict | None = None,
        num_cached_tokens: int = 0,
        weight_version: str = "0",
        detokenize: Callable[[], str] | None = None,
    ):
        if text is None and detokenize is None:
            raise ValueError("RequestOutput needs text or a detokenize callable")
        self.rid = rid
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids
        self.output_log_probs = output_log_probs
        self._text = text
        self._detokenize = detokenize
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_cached_tokens = num_cached_tokens
        self.weight_version = weight_version

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._detokenize()
        return self._text

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.output_token_ids)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(rid={self.rid!r}, num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_completion_tokens={self.num_completion_tokens}, finished={self.finished}, "
            f"finish_reason={self.finish_reason!r}, weight_version={self.weight_version!r})"
        )

    def to_dict(self) -> dict:
        return {
            "rid": self.rid,
            "text": self.text,
            "output_ids": list(self.output_token_ids),
            "token_ids": list(self.output_token_ids),
            "output_log_probs": list(self.output_log_probs),
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "cached_tokens": self.num_cached_tokens,
            "weight_version": self.weight_version,
        }
