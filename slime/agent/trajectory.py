"""A session's turns -> trainable Samples, token in, token out (slime's `slime.agent.trajectory`).

An adapter records one `TurnRecord` per model call: the prompt ids it rendered and sent, and the ids, log-probs and
finish reason the engine sampled. `TrajectoryManager.get_trajectory` linearises a session into Samples:

- tokens = the first prompt, then per turn the new template / tool / user ids (loss mask 0) and the SAMPLED output
  ids (loss mask 1, `rollout_log_probs` = the engine's log-probs; 0.0 where the mask is 0). Sampled text is never
  re-tokenized: the ids trained are the ids the engine produced.
- A turn extends the branch ("leaf") whose tokens its prompt continues. A client re-renders its history, and the
  rendering can differ from what was sampled (re-tokenization of the sampled text, a rewritten message, a dropped
  thinking block). The turn's prompt is aligned against each leaf: every sampled span of the leaf must reappear
  intact, in order; the context between spans may differ.
  * no difference: the turn extends the leaf;
  * differences only in context (non-sampled) positions, fewer than `fork_threshold_tokens` in all: absorbed. The
    leaf's context becomes the new rendering (what the model saw at this turn), its sampled spans keep their ids,
    masks and log-probs; `metadata["num_absorbed_drift_tokens"]` counts what changed;
  * otherwise (a sampled id was re-rendered differently, or too much context changed): a new leaf forks. It is the
    turn's prompt as rendered (all loss mask 0) plus the turn's output; the old leaf keeps its sampled ids and is
    trained as it was.
- Each sampled id is trained exactly once: in the leaf its turn was recorded into. In every other leaf the same
  position is context (mask 0). Leaves without a sampled id yield no Sample.
- Several leaves become several Samples of one session: siblings with the session's `session_id`, and the base
  sample's `group_index`, `index`, `rollout_id`, `prompt`, `label`, `reward` and `metadata`, as a custom generate
  function returning `list[Sample]` does in slime.
- A Sample's prompt is everything before its first trained id; `response_length` counts the rest, `loss_mask` and
  `rollout_log_probs` cover the response. Status follows the leaf's last turn (stop -> COMPLETED,
  length -> TRUNCATED, abort -> ABORTED). `ill_formed` turns (a tool call the parser could not read) are trained like
  any other; `metadata["num_ill_formed_turns"]` lets a reward function penalise them.

Pure Python, no I/O, no torch. Not the HTTP adapters (`slime.agent.adapters`), not a reward function.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from slime.utils.types import FINISH_REASON_TO_STATUS, Sample, Status

DEFAULT_FORK_THRESHOLD_TOKENS = 64


@dataclass(frozen=True)
class TurnRecord:
    """One model call, the adapter -> manager contract: `prompt_ids` as sent to /generate, `output_ids` and
    `output_log_probs` as the engine sampled them, the engine's `finish_reason` type (stop | length | abort),
    `ill_formed` when the output held a tool call the parser could not read, the engine's `weight_version`; the
    rest is what the adapter answers the client with and the manager does not use."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    output_log_probs: list[float]
    ill_formed: bool = False
    weight_version: str | None = None
    text: str | None = None  # the engine's decoded text, when it sent one (else the adapter decodes output_ids)
    matched_stop: str | None = None  # the stop string that ended the turn, as the engine reported it
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served
    # one per output id when the turn spans weight pushes (adapters/paused_turns.py); None: all of weight_version
    output_weight_versions: list[str | None] | None = None


@dataclass
class _Leaf:
    """One branch of a session: a token sequence, its sampled spans and per-token training data."""

    tokens: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    versions: list[str | None] = field(default_factory=list)  # per token: the weight version that sampled it
    sampled_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of ids sampled in this leaf
    turn_indices: list[int] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    num_ill_formed_turns: int = 0
    num_absorbed_drift_tokens: int = 0
    forked_from_leaf: int | None = None

    def append_turn(self, turn: TurnRecord, turn_index: int) -> None:
        start = len(self.tokens)
        self.tokens += turn.output_ids
        self.loss_mask += [1] * len(turn.output_ids)
        self.log_probs += [float(x) for x in turn.output_log_probs]
        version = None if turn.weight_version is None else str(turn.weight_version)
        self.versions += (list(turn.output_weight_versions) if turn.output_weight_versions is not None
                          else [version] * len(turn.output_ids))
        if turn.output_ids:
            self.sampled_spans.append((start, len(self.tokens)))
        self.turn_indices.append(turn_index)
        if turn.weight_version is not None:
            self.weight_versions.append(str(turn.weight_version))
        self.finish_reason = turn.finish_reason
        self.num_ill_formed_turns += int(turn.ill_formed)


def _context(prompt_ids: list[int]) -> _Leaf:
    return _Leaf(list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids), [None] * len(prompt_ids))


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # a[:low] == b[:low] and a[:high] != b[:high]: bisect with C-speed slice compares
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if a[low:mid] == b[low:mid] else (low, mid)
    return low


def _num_differing(old: list[int], new: list[int]) -> int:
    """Tokens changed between two renderings of one context: what is left after the common prefix and suffix."""
    prefix = _common_prefix_len(old, new)
    suffix = _common_prefix_len(old[prefix:][::-1], new[prefix:][::-1])
    return max(len(old), len(new)) - prefix - suffix


def _find_span(prompt_ids: list[int], span: list[int], low: int, expected: int, high: int) -> int | None:
    """Where `span` starts in prompt_ids[low:high + len(span)], trying `expected` first."""
    width = len(span)
    if prompt_ids[expected:expected + width] == span:
        return expected
    position = low
    while True:
        try:
            position = prompt_ids.index(span[0], position, min(high, len(prompt_ids)) + 1)
        except ValueError:
            return None
        if prompt_ids[position:position + width] == span:
            return position
        position += 1


def align(leaf: _Leaf, prompt_ids: list[int], max_drift: int) -> tuple[list[tuple[int, int]], int] | None:
    """The sampled spans of `leaf` located in `prompt_ids`, and the number of context tokens that differ, or None
    when a sampled span is missing or `max_drift` or more context tokens differ (so max_drift 0 accepts only a prompt
    that extends the leaf exactly)."""
    if prompt_ids[:len(leaf.tokens)] == leaf.tokens:
        return [*leaf.sampled_spans], 0
    spans, drift, leaf_position, prompt_position = [], 0, 0, 0
    for start, end in leaf.sampled_spans:
        context = leaf.tokens[leaf_position:start]
        expected = prompt_position + len(context)
        found = _find_span(prompt_ids, leaf.tokens[start:end], prompt_position, expected, expected + max_drift)
        if found is None:
            return None
        drift += _num_differing(context, prompt_ids[prompt_position:found])
        if drift >= max_drift:
            return None
        spans.append((found, found + end - start))
        leaf_position, prompt_position = end, found + end - start
    trailing = leaf.tokens[leaf_position:]
    drift += len(trailing) - _common_prefix_len(trailing, prompt_ids[prompt_position:])
    return (spans, drift) if drift < max_drift else None


def _absorb(leaf: _Leaf, prompt_ids: list[int], spans: list[tuple[int, int]], drift: int) -> None:
    """Rebuild `leaf` on the new rendering: context from `prompt_ids`, sampled spans with their masks and log-probs."""
    loss_mask, log_probs, versions = [0] * len(prompt_ids), [0.0] * len(prompt_ids), [None] * len(prompt_ids)
    for (old_start, old_end), (new_start, new_end) in zip(leaf.sampled_spans, spans):
        loss_mask[new_start:new_end] = leaf.loss_mask[old_start:old_end]
        log_probs[new_start:new_end] = leaf.log_probs[old_start:old_end]
        versions[new_start:new_end] = leaf.versions[old_start:old_end]
    leaf.tokens, leaf.loss_mask, leaf.log_probs, leaf.versions = list(prompt_ids), loss_mask, log_probs, versions
    leaf.sampled_spans = spans
    leaf.num_absorbed_drift_tokens += drift


class TrajectoryManager:
    """Per-session leaves of token ids; see the module docstring for what is trained and when a leaf forks.

    `fork_threshold_tokens`: context tokens (never sampled ones) that may differ between a leaf and a later
    rendering of it before the turn forks a new leaf instead of being absorbed; 0 forks on any difference.
    """

    def __init__(self, fork_threshold_tokens: int = DEFAULT_FORK_THRESHOLD_TOKENS, tokenizer=None):
        if fork_threshold_tokens < 0:
            raise ValueError(f"fork_threshold_tokens must be >= 0, got {fork_threshold_tokens}")
        self.fork_threshold_tokens = fork_threshold_tokens
        self.tokenizer = tokenizer  # optional: fills Sample.response with the decoded response ids
        self._leaves: dict[str, list[_Leaf]] = {}
        self._num_turns: dict[str, int] = {}

    def has_session(self, session_id: str) -> bool:
        return session_id in self._leaves

    def num_turns(self, session_id: str) -> int:
        return self._num_turns.get(session_id, 0)

    def record_turn(self, session_id: str, turn: TurnRecord) -> None:
        if len(turn.output_log_probs) != len(turn.output_ids):
            raise ValueError(f"TurnRecord has {len(turn.output_ids)} output ids but {len(turn.output_log_probs)} "
                             "output_log_probs; ask the engine for return_logprob")
        if not turn.prompt_ids:
            raise ValueError("TurnRecord.prompt_ids is empty: record the ids the engine was prompted with")
        leaves = self._leaves.setdefault(session_id, [])
        turn_index = self._num_turns.get(session_id, 0)
        self._num_turns[session_id] = turn_index + 1
        leaf = self._extendable_leaf(leaves, turn.prompt_ids)
        if leaf is None:
            leaf = _context(turn.prompt_ids)
            leaf.forked_from_leaf = self._closest_leaf(leaves, turn.prompt_ids)
            leaves.append(leaf)
        leaf.append_turn(turn, turn_index)

    def _extendable_leaf(self, leaves: list[_Leaf], prompt_ids: list[int]) -> _Leaf | None:
        """The leaf this prompt continues (absorbing the least drift), extended to the prompt; None to fork."""
        best = None
        for leaf in reversed(leaves):  # the newest leaf first: a clean extension of it ends the search
            alignment = align(leaf, prompt_ids, self.fork_threshold_tokens)
            if alignment is not None and (best is None or alignment[1] < best[1][1]):
                best = (leaf, alignment)
                if alignment[1] == 0:
                    break
        if best is None:
            return None
        leaf, (spans, drift) = best
        if drift:
            _absorb(leaf, prompt_ids, spans, drift)
        else:
            new_context = prompt_ids[len(leaf.tokens):]
            leaf.tokens += new_context
            leaf.loss_mask += [0] * len(new_context)
            leaf.log_probs += [0.0] * len(new_context)
            leaf.versions += [None] * len(new_context)
        return leaf

    @staticmethod
    def _closest_leaf(leaves: list[_Leaf], prompt_ids: list[int]) -> int | None:
        if not leaves:
            return None
        return max(range(len(leaves)), key=lambda i: _common_prefix_len(leaves[i].tokens, prompt_ids))

    def get_trajectory(self, session_id: str, base_sample: Sample | None = None) -> list[Sample]:
        """The session's Samples, one per leaf with a sampled id (siblings); [] for a session with no turns.
        Does not consume the session (see `drop_session`)."""
        leaves = [leaf for leaf in self._leaves.get(session_id, []) if leaf.sampled_spans]
        return [self._to_sample(session_id, leaf, i, len(leaves), base_sample) for i, leaf in enumerate(leaves)]

    def drop_session(self, session_id: str) -> None:
        self._leaves.pop(session_id, None)
        self._num_turns.pop(session_id, None)

    def _to_sample(self, session_id: str, leaf: _Leaf, leaf_index: int, num_leaves: int,
                   base_sample: Sample | None) -> Sample:
        base = base_sample or Sample()
        response_start = leaf.sampled_spans[0][0]
        response_ids = leaf.tokens[response_start:]
        metadata = copy.deepcopy(base.metadata)
        metadata.update(
            num_turns=len(leaf.turn_indices), turn_indices=list(leaf.turn_indices), leaf_index=leaf_index,
            num_leaves=num_leaves, forked_from_leaf=leaf.forked_from_leaf,
            num_absorbed_drift_tokens=leaf.num_absorbed_drift_tokens,
            num_ill_formed_turns=leaf.num_ill_formed_turns, ill_formed=leaf.num_ill_formed_turns > 0,
            truncated=leaf.finish_reason == "length",
        )
        return Sample(
            group_index=base.group_index, index=base.index, rollout_id=base.rollout_id,
            prompt=copy.deepcopy(base.prompt), label=copy.deepcopy(base.label), reward=copy.deepcopy(base.reward),
            tokens=list(leaf.tokens), response_length=len(response_ids),
            response=self.tokenizer.decode(response_ids) if self.tokenizer is not None else "",
            loss_mask=leaf.loss_mask[response_start:], rollout_log_probs=leaf.log_probs[response_start:],
            weight_versions=list(leaf.weight_versions),
            token_weight_versions=(leaf.versions[response_start:]
                                   if any(v is not None for v in leaf.versions[response_start:]) else None),
            status=FINISH_REASON_TO_STATUS.get(leaf.finish_reason, Status.FAILED),
            metadata=metadata, session_id=session_id,
        )
