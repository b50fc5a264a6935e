"""What the engine reports about a request after a step: tokens and log-probs so far, text, finish reason.

A plain record built by the engine; `to_dict` gives the blocking `Engine.generate` result shape. Building one costs
O(1), whatever the request's length: it snapshots only the sequence's length, and the token and
log-prob lists are sliced out of the (append-only) sequence on first access, as is the text (detokenized). A
consumer that only looks at the final output never pays for the intermediate ones. It does not know how the HTTP
server renders it (SGLang's meta_info lives in the server).
"""

from __future__ import annotations

from collections.abc import Callable


class RequestOutput:
    """rid, prompt_token_ids, output_token_ids, output_log_probs (one per output token, under logits / T), text,
    finished, finish_reason ({"type": "stop"|"length"|"abort", plus "matched" | "length" | "message"} or None while
    running), num_cached_tokens (prompt tokens served by the prefix cache), weight_version, routed_experts (a finished
    request's MoE routing [len(tokens) - 1, num_hidden_layers, top_k] int32 numpy array, SGLang's layout with zeros
    in the dense layers' rows, when it asked for it, else None)."""

    __slots__ = (
        "rid", "finished", "finish_reason", "num_cached_tokens", "weight_version", "routed_experts", "_text",
        "_detokenize",
        "_prompt_token_ids", "_output_token_ids", "_output_log_probs", "_sequence_token_ids", "_sequence_log_probs",
        "_num_prompt_tokens", "_num_tokens",
    )  # fmt: skip

    def __init__(
        self,
        rid: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        log_probs: list[float],
        text: str | None = None,
        finished: bool = False,
        finish_reason: dict | None = None,
        num_cached_tokens: int = 0,
        weight_version: str = "0",
        detokenize: Callable[[list[int]], str] | None = None,
        routed_experts=None,
        prompt_token_ids: list[int] | None = None,
    ):
        """A snapshot of a sequence in O(1): `token_ids` (prompt + output) and `log_probs` (one per output token)
        must only ever be appended to afterwards; the lists are sliced at their current lengths when first read.
        `prompt_token_ids`: the prompt as the caller knows it, when the engine schedules other ids (a VL prompt's
        image tokens carry content ids in the engine, image_prompt.py)."""
        if text is None and detokenize is None:
            raise ValueError("RequestOutput needs text or a detokenize callable")
        self.rid = rid
        self._prompt_token_ids = self._output_token_ids = self._output_log_probs = None
        if prompt_token_ids is not None:
            self._prompt_token_ids = prompt_token_ids
        self._sequence_token_ids = token_ids
        self._sequence_log_probs = log_probs
        self._num_prompt_tokens = num_prompt_tokens
        self._num_tokens = len(token_ids)
        self._text = text
        self._detokenize = detokenize
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_cached_tokens = num_cached_tokens
        self.weight_version = weight_version
        self.routed_experts = routed_experts

    @property
    def prompt_token_ids(self) -> list[int]:
        if self._prompt_token_ids is None:
            self._prompt_token_ids = self._sequence_token_ids[: self._num_prompt_tokens]
        return self._prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        if self._output_token_ids is None:
            self._output_token_ids = self._sequence_token_ids[self._num_prompt_tokens : self._num_tokens]
        return self._output_token_ids

    @property
    def output_log_probs(self) -> list[float]:
        if self._output_log_probs is None:
            self._output_log_probs = self._sequence_log_probs[: self._num_tokens - self._num_prompt_tokens]
        return self._output_log_probs

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._detokenize(self.output_token_ids)
        return self._text

    @property
    def pending_detokenize(self) -> Callable[[list[int]], str] | None:
        """The detokenize callable while the text is not decoded yet, else None."""
        return self._detokenize if self._text is None else None

    def fill_text(self, text: str) -> None:
        """The text, decoded elsewhere (several outputs at once: stop_strings.decode_final_texts)."""
        self._text = text

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self._num_tokens - self._num_prompt_tokens

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
            **({"routed_experts": self.routed_experts} if self.routed_experts is not None else {}),
        }
