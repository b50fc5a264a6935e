"""A session's turns -> trainable Samples, token in, token out (slime's `slime.agent.trajectory`).

An adapter records one `TurnRecord` per model call with the chat messages it was prompted with and the assistant
message it answered: `record_turn(sid, turn=..., prompt_messages=..., response_message=...)`. Two layers:

- Routing (`slime.agent.message_tree`): the messages build a per-session tree, merged on role and message equality,
  so message identity decides the tree's shape; each generated reply is a leaf. Token ids play no part here.
- Linearisation (`get_trajectory`): each leaf's chain of generated turns becomes Samples by token-id prefix. A turn
  whose prompt extends the tokens held exactly appends its new prompt ids (loss mask 0) and its sampled output
  (loss mask 1, the engine's log-probs; 0.0 when it sent none). When the prompt differs from the held tokens:
  * the difference starts inside the latest response and the new output is shorter than `fork_threshold_tokens`:
    realign. That response is replaced by the prompt's rendering of it, as context (loss mask 0), and the turn goes
    on in the same Sample (`metadata["num_absorbed_drift_tokens"]` counts the replaced ids);
  * otherwise: fork. The Sample so far is closed and a new one starts from the turn's prompt (context) and output.
  A turn shared by several leaves is trained in the first leaf that reaches it and is context in the others. A
  Sample with no trained id is not emitted. Sampled ids are never re-tokenized.
- Every Sample of a session carries `reward` in full, the base sample's index / group_index / rollout_id / prompt /
  label / metadata, the session's `session_id`, and `metadata` `truncated` (the chain's last turn stopped at its
  length), `use_tool`, `ill_formed` / `num_ill_formed_turns` (a tool call the parser could not read), `turn_indices`
  (the 0-based recording order of the turns it trains), `num_turns`, `leaf_index`, `num_leaves`. A Sample's prompt
  is its first turn's prompt; `loss_mask`, `rollout_log_probs` and `token_weight_versions` (the weight version of
  each trained id, None for context; None when no turn reported one) cover the rest. Status follows its last turn.
  `get_trajectory` consumes the session.

Pure Python, no I/O, no torch. Not the HTTP adapters (`slime.agent.adapters`), not a reward function.
"""

from __future__ import annotations

import copy
import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from slime.agent.message_tree import MessageNode, mount_prompt
from slime.utils.types import FINISH_REASON_TO_STATUS, Sample, Status

logger = logging.getLogger(__name__)

DEFAULT_FORK_THRESHOLD_TOKENS = 1024


@dataclass(frozen=True)
class TurnRecord:
    """One model call, the adapter -> manager contract: `prompt_ids` as sent to /generate, `output_ids` and
    `output_log_probs` as the engine sampled them (empty log-probs: trained with 0.0), the engine's `finish_reason`
    type (stop | length | abort), `ill_formed` when the output held a tool call the parser could not read, the
    engine's `weight_version`; the rest is what the adapter answers the client with and the manager does not use."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    output_log_probs: list[float] = field(default_factory=list)
    ill_formed: bool = False
    weight_version: str | None = None
    text: str | None = None  # the engine's decoded text, when it sent one (else the adapter decodes output_ids)
    matched_stop: str | None = None  # the stop string that ended the turn, as the engine reported it
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served
    # one per output id when the turn spans weight pushes (adapters/paused_turns.py); None: all of weight_version
    output_weight_versions: list[str | None] | None = None


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # a[:low] == b[:low] and a[:high] != b[:high]: bisect with C-speed slice compares
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if a[low:mid] == b[low:mid] else (low, mid)
    return low


class DriftKind(enum.Enum):
    CLEAN = "clean"  # the prompt extends the held tokens exactly
    REALIGN = "realign"  # it differs inside the latest response and the new output is short: replace that response
    FORK = "fork"  # anything else: a new Sample starts at this turn


class _SampleBuilder:
    """The token sequence of one Sample, built turn by turn."""

    def __init__(self, fork_threshold: int) -> None:
        self.fork_threshold = fork_threshold
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[str | None] = []  # per token: the weight version that sampled it (None: context)
        self.latest_response_start: int | None = None
        self.latest_response_trained = False
        self.prompt_length = 0
        self.turn_indices: list[int] = []  # 0-based recording order of the turns trained here
        self.weight_versions: list[str] = []
        self.finish_reason = "stop"
        self.num_realigned_tokens = 0

    def classify(self, turn: TurnRecord) -> DriftKind:
        matched = _common_prefix_len(self.tokens, turn.prompt_ids)
        if matched == len(self.tokens):
            return DriftKind.CLEAN
        start = self.latest_response_start
        if start is not None and matched >= start and len(turn.output_ids) < self.fork_threshold:
            return DriftKind.REALIGN
        return DriftKind.FORK

    def append_turn(self, turn: TurnRecord, kind: DriftKind, turn_index: int, trained: bool) -> None:
        if kind is DriftKind.FORK:
            raise AssertionError("a turn that forks starts a new builder")
        first_turn = self.latest_response_start is None
        if kind is DriftKind.REALIGN:
            start = self.latest_response_start
            self.num_realigned_tokens += len(self.tokens) - start
            del self.tokens[start:], self.loss_mask[start:], self.log_probs[start:], self.versions[start:]
            if self.latest_response_trained:  # its ids are context now
                self.turn_indices.pop()
        self._extend(turn.prompt_ids[len(self.tokens):], 0, None)
        self.latest_response_start = len(self.tokens)
        self._extend(turn.output_ids, int(trained), turn.output_log_probs if trained else None)
        if trained:
            version = None if turn.weight_version is None else str(turn.weight_version)
            self.versions[self.latest_response_start:] = (
                list(turn.output_weight_versions) if turn.output_weight_versions is not None
                else [version] * len(turn.output_ids))
        if first_turn:
            self.prompt_length = len(turn.prompt_ids)
        self.latest_response_trained = trained and bool(turn.output_ids)
        if self.latest_response_trained:
            self.turn_indices.append(turn_index)
        if turn.weight_version is not None:
            self.weight_versions.append(str(turn.weight_version))
        self.finish_reason = turn.finish_reason

    def _extend(self, ids: list[int], mask: int, log_probs: list[float] | None) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.log_probs += [float(x) for x in log_probs] if log_probs else [0.0] * len(ids)
        self.versions += [None] * len(ids)

    def has_trained_id(self) -> bool:
        return any(self.loss_mask[self.prompt_length:])


class TrajectoryManager:
    """Per-session routing trees; see the module docstring for what is trained and when a Sample forks.

    `fork_threshold_tokens` (default 1024; None: the default): a turn whose output has fewer ids may realign a
    drifted latest response or merge a rewritten assistant message; one at least this long forks. 0 never merges.
    `tokenizer` (optional) fills `Sample.response` with the decoded response ids.
    """

    def __init__(self, *, fork_threshold_tokens: int | None = None, tokenizer=None) -> None:
        if fork_threshold_tokens is None:
            fork_threshold_tokens = DEFAULT_FORK_THRESHOLD_TOKENS
        if fork_threshold_tokens < 0:
            raise ValueError(f"fork_threshold_tokens must be >= 0, got {fork_threshold_tokens}")
        self.fork_threshold_tokens = fork_threshold_tokens
        self.tokenizer = tokenizer
        self._trees: dict[str, MessageNode] = {}
        self._turn_count: dict[str, int] = {}

    def has_session(self, sid: str) -> bool:
        return sid in self._trees

    def turn_count(self, sid: str) -> int:
        return self._turn_count.get(sid, 0)

    def record_turn(self, sid: str, *, turn: TurnRecord, prompt_messages: list[dict[str, Any]],
                    response_message: dict[str, Any] | None, metadata: dict[str, Any] | None = None) -> None:
        """Route one turn into the session's tree: `prompt_messages` as the engine was prompted with them (empty:
        the turn is skipped with a warning), `response_message` the reply the client was given (None if empty)."""
        if not prompt_messages:
            logger.warning("record_turn(sid=%s): no prompt_messages, the turn is not recorded", sid)
            return
        if turn.output_log_probs and len(turn.output_log_probs) != len(turn.output_ids):
            raise AssertionError(f"turn.output_log_probs has {len(turn.output_log_probs)} entries for "
                                 f"{len(turn.output_ids)} output_ids; ask the engine for return_logprob")
        if not turn.prompt_ids:
            raise ValueError("TurnRecord.prompt_ids is empty: record the ids the engine was prompted with")
        root = self._trees.setdefault(sid, MessageNode())
        parent = mount_prompt(root, prompt_messages, self.fork_threshold_tokens, sid)
        reply = parent.add_child(MessageNode(role="assistant", message=response_message, metadata=metadata))
        reply.turn = turn
        reply.turn_index = self._turn_count.get(sid, 0) + 1
        self._turn_count[sid] = reply.turn_index

    def get_trajectory(self, sid: str, *, base_sample: Sample, reward: Any = 0.0,
                       extra_metadata: dict[str, Any] | None = None, max_sample_tokens: int = 0) -> list[Sample]:
        """The session's Samples (module docstring), each with `reward`; [] for an unknown session. The session is
        consumed: a second call returns []. `max_sample_tokens` > 0 cuts each Sample's tokens to that many."""
        root = self._trees.pop(sid, None)
        self._turn_count.pop(sid, None)
        if root is None:
            return []
        chains = [leaf.path_from_root() for leaf in root.leaves() if not leaf.is_root]
        built = [(builder, self._chain_metadata(chain)) for chain in chains for builder in self._builders(chain)]
        built = [(builder, md) for builder, md in built if builder.has_trained_id()]
        return [self._to_sample(sid, builder, {**(extra_metadata or {}), **md}, i, len(built), base_sample, reward,
                                max_sample_tokens) for i, (builder, md) in enumerate(built)]

    def drop_session(self, sid: str) -> None:
        self._trees.pop(sid, None)
        self._turn_count.pop(sid, None)

    def _builders(self, chain: list[MessageNode]) -> list[_SampleBuilder]:
        builders: list[_SampleBuilder] = []
        for node in chain:
            if node.role != "assistant" or node.turn is None:
                continue
            trained, node.response_trained = not node.response_trained, True
            kind = builders[-1].classify(node.turn) if builders else DriftKind.FORK
            if kind is DriftKind.FORK:
                builders.append(_SampleBuilder(self.fork_threshold_tokens))
                kind = DriftKind.CLEAN
            builders[-1].append_turn(node.turn, kind, node.turn_index - 1, trained)
        return builders

    @staticmethod
    def _chain_metadata(chain: list[MessageNode]) -> dict[str, Any]:
        generated = [node for node in chain if node.role == "assistant" and node.turn is not None]
        num_ill_formed = sum(int(node.turn.ill_formed) for node in generated)
        return {"truncated": bool(generated) and generated[-1].turn.finish_reason == "length",
                "use_tool": any(bool((node.message or {}).get("tool_calls")) for node in generated),
                "ill_formed": num_ill_formed > 0, "num_ill_formed_turns": num_ill_formed}

    def _to_sample(self, sid: str, builder: _SampleBuilder, metadata: dict[str, Any], index: int, num: int,
                   base: Sample, reward: Any, max_sample_tokens: int) -> Sample:
        tokens, loss_mask, log_probs, versions = builder.tokens, builder.loss_mask, builder.log_probs, builder.versions
        if max_sample_tokens and len(tokens) > max_sample_tokens:
            tokens, loss_mask, log_probs, versions = (x[:max_sample_tokens] for x in (tokens, loss_mask, log_probs,
                                                                                     versions))
        start = builder.prompt_length
        sample_metadata = copy.deepcopy(base.metadata)
        sample_metadata.update(metadata, turn_indices=list(builder.turn_indices), num_turns=len(builder.turn_indices),
                               leaf_index=index, num_leaves=num,
                               num_absorbed_drift_tokens=builder.num_realigned_tokens)
        response_ids = tokens[start:]
        return Sample(
            group_index=base.group_index, index=base.index,
            rollout_id=base.rollout_id if base.rollout_id is not None else base.index,
            prompt=copy.deepcopy(base.prompt), label=copy.deepcopy(base.label), reward=copy.deepcopy(reward),
            tokens=list(tokens), response_length=len(response_ids),
            response=self.tokenizer.decode(response_ids) if self.tokenizer is not None else "",
            loss_mask=list(loss_mask[start:]), rollout_log_probs=list(log_probs[start:]),
            weight_versions=list(builder.weight_versions),
            token_weight_versions=versions[start:] if any(v is not None for v in versions[start:]) else None,
            status=FINISH_REASON_TO_STATUS.get(builder.finish_reason, Status.COMPLETED),
            metadata=sample_metadata, session_id=sid,
        )


__all__ = ["DEFAULT_FORK_THRESHOLD_TOKENS", "TrajectoryManager", "TurnRecord"]
