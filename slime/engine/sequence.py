"""One request's bookkeeping: its token ids, how many have KV in the cache, its block table, status and outputs.

Plain Python (no torch) so the scheduler and block manager test fast with a fake model runner. It does not
decide anything: the scheduler moves a Sequence between states and the engine checks stop conditions.
"""

from __future__ import annotations

from enum import Enum, auto

from slime.engine.sampling_params import SamplingParams

PLACEHOLDER = -1  # token id of a slot whose token is still on the device
PLACEHOLDER_LOG_PROB = float("nan")  # its log-prob until the token arrives


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


# SequenceStatus.FINISHED as a module global for the per-row loops of every step: an enum member's lookup through its
# class costs ~0.1 us, ~0.05 ms per 512-row step each time a loop spells it.
FINISHED = SequenceStatus.FINISHED


class Sequence:
    def __init__(self, rid: str, prompt_token_ids: list[int], sampling_params: SamplingParams, seed: int):
        self.rid = rid
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        # Seed of this request's sampling noise: its sampling_seed, or one drawn from the engine's RNG.
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Tokens whose KV is in the cache (prefix-cache hits included); the next forward computes from here.
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache at the latest admission (SGLang's cached_tokens).
        self.num_cached_tokens = 0
        self.output_log_probs: list[float] = []
        self.finish_reason: dict | None = None
        self.num_preemptions = 0
        # Overlapped scheduling: the last token is still being sampled on the device (its slot holds PLACEHOLDER and
        # a NaN log-prob). The scheduler reserves the slot (look_ahead) and fills it (postprocess).
        self.has_placeholder = False
        # MoE routing of every computed position, read from the cache slots when the sequence finishes
        # ([num_positions, num_hidden_layers, top_k] int32 array, SGLang layout; None unless return_routed_experts).
        self.return_routed_experts = False
        self.routed_experts = None
        # Set by Scheduler.add, so a step checks each token in O(1): the length at which max_new_tokens or
        # max_model_len ends the sequence, and the token ids that may stop it (stop_token_ids, EOS unless ignored).
        self.max_num_tokens = 0
        self.stop_token_ids: frozenset[int] = frozenset()
        # LoRA (engine/lora/): the slot of the request's adapter (-1: the base model) and the prefix cache's salt
        # (blocks are shared only between requests of the same adapter load; None: the base model's).
        self.lora_slot = -1
        self.cache_salt: str | None = None
        # Vision-language: the request's images and M-RoPE positions (image_prompt.py); None for a text request.
        self.image_prompt = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, log_prob: float) -> None:
        self.token_ids.append(token_id)
        self.output_log_probs.append(log_prob)
