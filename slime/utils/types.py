"""The Sample record: the whole contract between rollout and trainer (slime's `slime.utils.types.Sample`).

A rollout function turns prompts into Samples; the RolloutManager turns Samples into train data. Nothing else
crosses that boundary. Every field of slime's Sample is here with slime's name and default, `Sample.Status`,
the nested `Sample.SpecInfo` / `Sample.PrefixCacheInfo`, `to_dict` / `from_dict` (status as its string value,
unknown keys kept as attributes) and `append_response_tokens(args, *, tokens, log_probs, trainable, meta_info,
text)`, which keeps tokens, loss_mask and rollout_log_probs aligned and maps SGLang's finish_reason onto the status.
Not here: decoding SGLang's packed top-p / routed-expert arrays (the built-in engine returns neither in meta_info).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


def _to_int_list(tokens) -> list[int]:
    if tokens is None:
        return []
    if hasattr(tokens, "tolist"):  # a tensor or an array
        tokens = tokens.reshape(-1).tolist()
    return list(map(int, tokens))


def _to_float_list(values) -> list[float] | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.reshape(-1).tolist()
    return list(map(float, values))


# Per-token lists of ints, floats or strings: a list copy is their deep copy, without deepcopy's per-element
# Python call (a 768-token sample: ~2 us against ~0.5 ms).
_SCALAR_LIST_FIELDS = frozenset(("tokens", "loss_mask", "weight_versions", "token_weight_versions", "rollout_log_probs",
                                 "rollout_top_p_token_ids", "rollout_top_p_token_offsets", "teacher_log_probs"))


@dataclass
class Sample:
    """One prompt's response (or one trainable segment of it) with everything training needs."""

    group_index: int | None = None
    index: int | None = None
    # Siblings a generate function returns for one rollout share it (None: the index stands in).
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    # One per response token: the weight version that sampled it (None for tokens the policy did not sample); kept
    # once any appended response reports a version (meta_info.weight_version).
    token_weight_versions: list[str | None] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        # A recoverable failure (a tool or API error): the sample may hold partial valid output.
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self) -> dict:
            return dict(self.__dict__)

        @staticmethod
        def from_dict(data: dict) -> "Sample.SpecInfo":
            return Sample.SpecInfo(**{k: data.get(k, 0) for k in Sample.SpecInfo.__dataclass_fields__})

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0) or 0
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0) or 0

        def to_dict(self) -> dict:
            return dict(self.__dict__)

        @staticmethod
        def from_dict(data: dict) -> "Sample.PrefixCacheInfo":
            return Sample.PrefixCacheInfo(**{k: data.get(k, 0) for k in Sample.PrefixCacheInfo.__dataclass_fields__})

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def __post_init__(self):
        if isinstance(self.status, str):  # slime's examples build Samples with the status's string value
            try:
                self.status = Sample.Status(self.status)
            except ValueError:
                raise ValueError(f"Sample status {self.status!r}: use one of "
                                 f"{[status.value for status in Sample.Status]}") from None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def to_dict(self) -> dict:
        """Every attribute (status as its string value); a deep copy, so two Samples made from one dict share no
        list that append_response_tokens extends in place."""
        memo: dict = {}
        value = {key: item.copy() if key in _SCALAR_LIST_FIELDS and type(item) is list else copy.deepcopy(item, memo)
                 for key, item in self.__dict__.items()}
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict) -> "Sample":
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", Sample.Status.PENDING.value))
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info") or {})
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info") or {})
        known = Sample.__dataclass_fields__
        sample = Sample(**{k: v for k, v in data.items() if k in known})
        for key, value in data.items():  # keys of newer rollout code survive as attributes
            if key not in known:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args) -> float:
        """The scalar reward: `reward[args.reward_key]` with --reward-key, else the reward itself."""
        if self.reward is None:
            raise ValueError(f"sample {self.index} has no reward: the reward function (--rm-type / --custom-rm-path) "
                             "did not run on it or returned None")
        if not args.reward_key:
            if isinstance(self.reward, dict):
                raise ValueError(f"sample {self.index} has a dict reward {sorted(self.reward)}; pass --reward-key "
                                 "to pick the scalar")
            return self.reward
        if not isinstance(self.reward, dict) or args.reward_key not in self.reward:
            raise ValueError(f"--reward-key {args.reward_key!r}: sample {self.index} has reward {self.reward!r}, "
                             "not a dict with that key")
        return self.reward[args.reward_key]

    def append_response_tokens(self, args=None, *, tokens=None, log_probs=None, trainable: bool = True,
                               meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Extend the response keeping tokens, loss_mask and rollout_log_probs aligned.

        Sampled tokens pass `trainable=True` with the engine's log-probs (and its `meta_info`); tokens the policy
        did not produce (tool output, environment text) pass `trainable=False`: loss mask 0, log-prob 0. A
        `meta_info` with a `finish_reason` also sets the status (stop -> COMPLETED, length -> TRUNCATED, abort ->
        ABORTED; anything else leaves it), appends its `weight_version` and adds its prefix-cache counts. The
        sampled tokens record that `weight_version` in `token_weight_versions`.
        """
        tokens = _to_int_list(tokens)
        log_probs = _to_float_list(log_probs)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        previous_length = self.response_length
        # In place, as slime does: generate functions keep references to these lists (retool's `loss_masks`).
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * previous_length
            self.loss_mask += [1 if trainable else 0] * len(tokens)
            version = meta_info.get("weight_version") if meta_info is not None and trainable else None
            if version is not None or self.token_weight_versions is not None:
                if self.token_weight_versions is None:
                    self.token_weight_versions = [None] * previous_length
                self.token_weight_versions += [None if version is None else str(version)] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and previous_length:
                    raise ValueError("Cannot append trainable rollout log probabilities to a sample with existing "
                                     "response tokens but no existing rollout_log_probs.")
                self.rollout_log_probs = [0.0] * previous_length
            self.rollout_log_probs += log_probs
        if tokens and not trainable and self.rollout_top_p_token_offsets is not None:
            # tokens nobody sampled keep no top-p set: empty spans keep offsets aligned with the response
            self.rollout_top_p_token_offsets = list(self.rollout_top_p_token_offsets) + \
                [self.rollout_top_p_token_offsets[-1]] * len(tokens)
        if meta_info is not None and update_terminal_info and "finish_reason" in meta_info:
            self._apply_terminal_info(args, meta_info)
        self._validate_lengths()

    def _apply_terminal_info(self, args, meta_info: dict) -> None:
        if args is not None and args.sglang_speculative_algorithm:
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finish_reason = meta_info["finish_reason"]
        kind = finish_reason.get("type") if isinstance(finish_reason, dict) else finish_reason
        status = FINISH_REASON_TO_STATUS.get(kind)
        if status is not None:
            self.status = status

    def _validate_lengths(self) -> None:
        if self.token_weight_versions is not None and len(self.token_weight_versions) != self.response_length:
            raise ValueError(f"token_weight_versions length {len(self.token_weight_versions)} != response_length "
                             f"{self.response_length}")
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length "
                             f"{self.response_length}")


Status = Sample.Status
FINISH_REASON_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
