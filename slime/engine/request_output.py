"""What the engine reports about a request after a step: tokens and log-probs so far, text, finish reason.

A plain record built by the engine; `to_dict` gives the blocking `Engine.generate` result shape. It does not
know how the HTTP server renders it (SGLang's meta_info lives in the server).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    rid: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_log_probs: list[float]
    text: str
    finished: bool
    finish_reason: dict | None  # {"type": "stop"|"length"|"abort", "matched"|"length"|"message": ...}
    num_cached_tokens: int
    weight_version: str

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.output_token_ids)

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
