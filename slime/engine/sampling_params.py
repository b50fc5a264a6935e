"""Per-request sampling parameters with SGLang's field names and defaults.

`SamplingParams.from_dict` is the single entry point for user-supplied dicts (HTTP payloads, rollout code): it
rejects unknown fields and invalid values with a ValueError naming the field. Not the sampler itself
(`sampler.py`) and not stop-condition checking (`engine.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class SamplingParams:
    """temperature: 0 = greedy. top_k: -1 = off. top_p: 1.0 = off. min_p: 0.0 = off.
    max_new_tokens: cap on generated tokens (finish reason "length"); None = up to max_model_len.
    min_new_tokens: EOS and stop_token_ids are masked out of sampling until this many tokens exist,
        and stop strings are not matched before it.
    stop: stop strings; the text is cut before the match unless no_stop_trim.
    stop_token_ids: extra token ids that end generation (like EOS).
    ignore_eos: do not stop at the tokenizer's EOS.
    skip_special_tokens: drop special tokens from the detokenized text.
    no_stop_trim: keep the matched stop string / stop token in the text.
    sampling_seed: makes this request's samples reproducible regardless of batch composition.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"sampling_params.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @classmethod
    def from_dict(cls, params: dict | None) -> SamplingParams:
        """Build from a user dict; unknown fields raise ValueError naming them."""
        params = dict(params or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s) {unknown}; supported: {sorted(known)}")
        return cls(**params)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def validate(self) -> None:
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, low_open=True, high=1.0)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_int("top_k", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens is not None:
            _check_int("max_new_tokens", self.max_new_tokens)
            if self.max_new_tokens < 0:
                raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        _check_int("min_new_tokens", self.min_new_tokens)
        if self.min_new_tokens < 0:
            raise ValueError(f"sampling_params.min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling_params.min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"sampling_params.stop must be a string or a list of non-empty strings, got {self.stop!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
            if token_id < 0:
                raise ValueError(f"sampling_params.stop_token_ids must be non-negative ids, got {token_id}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling_params.{name} must be a bool, got {getattr(self, name)!r}")
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed)


def _check_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"sampling_params.{name} must be an int, got {value!r}")


def _check_number(name: str, value, low: float, high: float | None = None, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"sampling_params.{name} must be a number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
        raise ValueError(f"sampling_params.{name} must be in {bounds}, got {value}")


def as_sampling_params(params) -> SamplingParams:
    """A request's sampling parameters: None (the defaults), a SamplingParams, or slime's / SGLang's dict."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(params).__name__}")
