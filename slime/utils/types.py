"""The Sample record: the whole contract between rollout and trainer.

A rollout function turns prompts into Samples; the RolloutManager turns Samples into train data. Nothing else
crosses that boundary. `to_dict` / `from_dict` round-trip (debug dumps, partial-rollout buffers, Ray transport).
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field, fields
from typing import Any


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


FINISH_REASON_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    teacher_log_probs: list[float] | None = None
    remove_sample: bool = False
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    session_id: str | None = None
    prefix_cache_info: dict = field(default_factory=dict)
    # --use-rollout-routing-replay: the engine's MoE routing, int32 numpy [len(tokens) - 1, num_moe_layers, top_k]
    rollout_routed_experts: Any = None

    Status = Status

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def get_reward_value(self, args) -> float:
        """The scalar reward: `reward[args.reward_key]` for dict rewards, else the reward itself."""
        reward = self.reward
        if isinstance(reward, dict):
            key = getattr(args, "reward_key", None)
            if key is None:
                raise ValueError(
                    f"sample {self.index} has a dict reward {sorted(reward)}; pass --reward-key to pick the scalar"
                )
            if key not in reward:
                raise ValueError(f"--reward-key {key!r} is not in the reward dict keys {sorted(reward)}")
            reward = reward[key]
        return float(reward) if reward is not None else 0.0

    def append_response_tokens(
        self,
        token_ids: list[int],
        log_probs: list[float] | None = None,
        trainable: bool = True,
        text: str = "",
        finish_reason: str | None = None,
        weight_version: str | None = None,
    ) -> None:
        """Extend the response, keeping tokens, loss_mask and rollout_log_probs aligned.

        Tokens the policy did not produce (tool output, environment text) pass `trainable=False`: they get loss
        mask 0 and log-prob 0.
        """
        num_new = len(token_ids)
        if log_probs is not None and len(log_probs) != num_new:
            raise ValueError(f"got {num_new} tokens but {len(log_probs)} log-probs")
        if self.loss_mask is None:
            self.loss_mask = [1] * self.response_length
        if self.rollout_log_probs is None:
            self.rollout_log_probs = [0.0] * self.response_length
        self.tokens = list(self.tokens) + list(token_ids)
        self.response_length += num_new
        self.response += text
        self.loss_mask += [1 if trainable else 0] * num_new
        if trainable and log_probs is not None:
            self.rollout_log_probs += [float(x) for x in log_probs]
        else:
            self.rollout_log_probs += [0.0] * num_new
        if weight_version is not None:
            self.weight_versions.append(str(weight_version))
        if finish_reason is not None:
            self.status = FINISH_REASON_TO_STATUS.get(finish_reason, Status.FAILED)

    def to_dict(self) -> dict:
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        out["status"] = self.status.value
        extra = {k: v for k, v in self.__dict__.items() if k not in out}
        out.update(copy.deepcopy(extra))
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Sample":
        data = dict(data)
        known = {f.name for f in fields(cls)}
        kwargs = {k: data.pop(k) for k in list(data) if k in known}
        if "status" in kwargs:
            kwargs["status"] = Status(kwargs["status"])
        sample = cls(**kwargs)
        for key, value in data.items():  # unknown keys survive the round-trip as attributes
            setattr(sample, key, value)
        return sample
