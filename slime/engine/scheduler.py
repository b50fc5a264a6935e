"""Continuous-batching scheduler: decides which sequences run in the next forward pass and how many tokens each.

Every step, running sequences go first (one token for a decode, the rest of a chunked prefill), then waiting
sequences are admitted in arrival order while the token budget (max_num_batched_tokens) and max_num_seqs allow;
a prompt longer than the remaining budget is prefilled in chunks over several steps. When the KV cache has no
free block, the most recently admitted running sequence is preempted by recompute: its blocks are freed and it
goes back to the front of the waiting queue, keeping the tokens it generated. Plain Python, no torch; it does not
sample or check stop strings (the engine does), it only applies token-level stop rules in `postprocess`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

from slime.engine.block_manager import BlockManager
from slime.engine.sequence import FINISHED, PLACEHOLDER, PLACEHOLDER_LOG_PROB, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: `num_new_tokens` tokens from `start` (its num_computed_tokens when
    scheduled). needs_sample: the chunk reaches the end of the sequence, so its last logits give the next token."""

    seq: Sequence
    start: int
    num_new_tokens: int
    needs_sample: bool

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        return cls(seq, start, num_new_tokens, start + num_new_tokens == len(seq))


class DecodeBatch:
    """A decode step scheduled by `look_ahead`: row i computes the token of `seqs[i]` at position `starts[i]` and
    samples the next one. It reads as a list of ScheduledSequence (built on access), but the steady decode step's
    consumers (the model runner, `postprocess`, the engine) use `seqs` and `starts` and build none: 512 such
    objects per step cost ~0.2-0.4 ms of host time."""

    __slots__ = ("seqs", "starts")

    def __init__(self, seqs: list[Sequence], starts: list[int]):
        self.seqs = seqs
        self.starts = starts

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[ScheduledSequence]:
        return map(ScheduledSequence, self.seqs, self.starts, repeat(1), repeat(True))

    def __getitem__(self, row: int) -> ScheduledSequence:
        return ScheduledSequence(self.seqs[row], self.starts[row], 1, True)


_seq, _num_new_tokens, _needs_sample = attrgetter("seq"), attrgetter("num_new_tokens"), attrgetter("needs_sample")


def _reserve_placeholder(seq: Sequence) -> None:
    """The slot of a token still being sampled on the device (postprocess fills it): the next step can be scheduled
    before the token reaches the host."""
    assert not seq.has_placeholder, "at most one step may run ahead of the host"
    seq.token_ids.append(PLACEHOLDER)
    seq.output_log_probs.append(PLACEHOLDER_LOG_PROB)
    seq.has_placeholder = True


def placeholder_sources(batch: list[ScheduledSequence] | DecodeBatch,
                        ahead: list[ScheduledSequence]) -> tuple[list[int], list[int]]:
    """For a step scheduled ahead of `batch`: the rows of `ahead` whose input is a placeholder, and for each the
    index of its token among `batch`'s sampled tokens (the order of `batch`'s rows that sample)."""
    sample_index = {id(item.seq): index for index, item in enumerate(filter(_needs_sample, batch))}
    rows = [row for row, item in enumerate(ahead) if item.seq.has_placeholder]
    return rows, [sample_index[id(ahead[row].seq)] for row in rows]


def is_decode_batch(batch: list[ScheduledSequence] | DecodeBatch) -> bool:
    """Every row computes one token and samples the next (C-level passes: this runs on every step's 512 rows)."""
    if isinstance(batch, DecodeBatch):
        return bool(batch.seqs)
    return set(map(_num_new_tokens, batch)) == {1} and all(map(_needs_sample, batch))


def sampled_seqs(batch: list[ScheduledSequence] | DecodeBatch) -> list[Sequence]:
    """The sequences of the rows that sample, in row order (the rows of the step's sampled tokens)."""
    if isinstance(batch, DecodeBatch):
        return batch.seqs
    return [item.seq for item in batch if item.needs_sample]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
        on_finish: Callable[[Sequence], None] | None = None,
    ):
        """`on_finish(seq)` runs when a sequence finishes, while it still holds its blocks (the engine reads
        per-slot state such as routed experts there)."""
        self.on_finish = on_finish
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        params = seq.sampling_params
        limit = self.max_model_len
        if params.max_new_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + params.max_new_tokens)
        seq.max_num_tokens = limit
        seq.stop_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                                  else frozenset(self.eos_token_ids))
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        block_manager = self.block_manager
        block_size = block_manager.block_size
        index = 0
        num_preempted = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            start = seq.num_computed_tokens
            num_new_tokens = min(len(seq.token_ids) - start, budget)
            end = start + num_new_tokens
            # Most decode steps need no new block and fill none: skip the block manager then (O(1) per sequence).
            if end > len(seq.block_table) * block_size:
                while not block_manager.can_grow(seq, end):
                    victim = self.running[-1]
                    self.preempt(victim)
                    num_preempted += 1
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break
                block_manager.grow(seq, end)
            if end // block_size > start // block_size:  # earlier steps registered the blocks full before `start`
                block_manager.register_full_blocks(seq, end)
            scheduled.append(ScheduledSequence(seq, start, num_new_tokens, end == len(seq.token_ids)))
            budget -= num_new_tokens
            index += 1
        if not num_preempted:  # after a preemption the cache is full: admitting more would only evict again
            self._admit(scheduled, budget)
        return scheduled

    def _admit(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        """Admit waiting sequences in arrival order into `scheduled` while `budget` tokens and max_num_seqs allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_uncached = len(seq) - len(self.block_manager.match_prefix(seq)) * self.block_manager.block_size
            num_new_tokens = min(num_uncached, budget)
            if not self.block_manager.can_admit(seq, len(seq) - num_uncached + num_new_tokens):
                break
            self.waiting.popleft()
            self.block_manager.admit(seq)
            end = seq.num_computed_tokens + num_new_tokens
            self.block_manager.grow(seq, end)
            self.block_manager.register_full_blocks(seq, end)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence.of(seq, num_new_tokens))
            budget -= num_new_tokens

    def look_ahead(self, batch: list[ScheduledSequence] | DecodeBatch) -> DecodeBatch | None:
        """The next decode step of `batch` (a decode step whose tokens are still on the device), scheduled now:
        each sequence that can continue gets a placeholder token and one more KV slot. Sequences that the pending
        token must finish by length are left out. None when the step cannot be scheduled ahead (new requests are
        waiting, a running sequence sat out, or the cache lacks blocks: preemption needs the real tokens).

        One pass over the batch of plain attribute work per sequence: this runs every decode step, while the GPU
        computes the step in flight, and has to stay well under that step's time at 512 sequences."""
        if self.waiting or len(batch) != len(self.running):
            return None
        if not is_decode_batch(batch):
            return None
        block_manager = self.block_manager
        block_size = block_manager.block_size
        seqs = batch.seqs if isinstance(batch, DecodeBatch) else list(map(_seq, batch))
        # A sequence needs at most one more block (the placeholder's slot): count them only when the free blocks
        # might not cover every sequence, so that the common step is a single pass.
        if block_manager.num_free_blocks < len(seqs):
            num_new_blocks = sum(1 for seq in seqs if len(seq.token_ids) + 1 < seq.max_num_tokens
                                 and len(seq.token_ids) + 1 > len(seq.block_table) * block_size)
            if num_new_blocks > block_manager.num_free_blocks:
                return None
        ahead_seqs, starts = [], []
        # Plain statements, no calls per sequence: a call per row costs ~0.05 ms per 512-row step.
        for seq in seqs:
            token_ids = seq.token_ids
            num_tokens = len(token_ids)
            if num_tokens + 1 >= seq.max_num_tokens:  # the pending token ends it by length: it does not continue
                continue
            seq.num_computed_tokens = num_tokens
            assert not seq.has_placeholder, "at most one step may run ahead of the host"
            token_ids.append(PLACEHOLDER)  # _reserve_placeholder, inline
            seq.output_log_probs.append(PLACEHOLDER_LOG_PROB)
            seq.has_placeholder = True
            if num_tokens % block_size == 0:  # the real tokens fill one more block; the placeholder needs a new one
                block_manager.register_full_blocks(seq, num_tokens)
                if num_tokens + 1 > len(seq.block_table) * block_size:
                    block_manager.grow(seq, num_tokens + 1)
            ahead_seqs.append(seq)
            starts.append(num_tokens)
        return DecodeBatch(ahead_seqs, starts)

    def schedule_ahead(self, batch: list[ScheduledSequence] | DecodeBatch) -> list[ScheduledSequence] | None:
        """The step after `batch` (launched, its sampled tokens still on the device) scheduled now, for a batch with
        prefill chunks or while requests wait, where `look_ahead` declines: what `schedule` would give once the
        step's tokens are in, without them. Each sequence of `batch`, in order and within the token budget,
        continues as the step leaves it (a placeholder token and one KV slot for the token it samples, or the rest
        of its prompt after its chunk); then waiting requests are admitted as `schedule` admits them. None when
        the real outcome is needed: `batch` is not exactly the running set (a sequence the previous step finished
        is in it, or a running one sat out), a sequence the budget would leave out, one the pending token may end
        by length (`schedule` would leave it out), or fewer free blocks than the continuing sequences may take (a
        preemption needs the real tokens). So the step returned holds every running sequence. A sequence the
        pending token ends by a stop token runs one row for nothing; its token is dropped (as in `look_ahead`)."""
        if len(batch) != len(self.running):
            return None
        block_manager = self.block_manager
        block_size = block_manager.block_size
        budget = self.max_num_batched_tokens
        plan = []  # (item, tokens this step), checked in full before any state changes
        num_new_blocks = 0
        for item in batch:
            seq = item.seq
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                return None
            if item.needs_sample:
                if len(seq.token_ids) + 1 >= seq.max_num_tokens:
                    return None
                num_new_tokens, end = 1, len(seq.token_ids) + 1
            else:
                start = item.start + item.num_new_tokens
                num_new_tokens = min(len(seq.token_ids) - start, budget)
                end = start + num_new_tokens
            num_new_blocks += max(0, block_manager.num_blocks_for(end) - len(seq.block_table))
            plan.append((item, num_new_tokens))
            budget -= num_new_tokens
        if num_new_blocks > block_manager.num_free_blocks:
            return None
        scheduled = []
        for item, num_new_tokens in plan:
            seq = item.seq
            if item.needs_sample:
                num_tokens = len(seq.token_ids)
                seq.num_computed_tokens = num_tokens
                _reserve_placeholder(seq)
                if num_tokens % block_size == 0:  # as in look_ahead: only real tokens fill a registered block
                    block_manager.register_full_blocks(seq, num_tokens)
                block_manager.grow(seq, num_tokens + 1)
                scheduled.append(ScheduledSequence(seq, num_tokens, 1, True))
            else:
                start = item.start + item.num_new_tokens
                end = start + num_new_tokens
                seq.num_computed_tokens = start
                block_manager.grow(seq, end)
                if end // block_size > start // block_size:
                    block_manager.register_full_blocks(seq, end)
                scheduled.append(ScheduledSequence(seq, start, num_new_tokens, end == len(seq.token_ids)))
        self._admit(scheduled, budget)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and requeue it first; its KV is recomputed (prefix hits permitting) on readmission."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(
        self, scheduled: list[ScheduledSequence] | DecodeBatch, token_ids: list[int], log_probs: list[float]
    ) -> list[Sequence]:
        """Advance computed counts; append one sampled token (and log-prob) per sequence that needed a sample, in
        order; finish sequences on EOS / stop_token_ids / max_new_tokens / max_model_len. Returns the sequences
        this step finished."""
        if isinstance(scheduled, DecodeBatch):
            return self._append_sampled(scheduled.seqs, scheduled.starts, token_ids, log_probs)
        seqs, last_positions = [], []
        for item in scheduled:
            end = item.start + item.num_new_tokens
            if item.needs_sample:
                seqs.append(item.seq)
                last_positions.append(end - 1)
            else:
                item.seq.num_computed_tokens = end
        return self._append_sampled(seqs, last_positions, token_ids, log_probs)

    def _append_sampled(self, seqs: list[Sequence], last_positions: list[int], token_ids: list[int],
                        log_probs: list[float]) -> list[Sequence]:
        """postprocess for the rows that sampled: token_ids[i] is the next token of seqs[i], sampled from the logits
        at last_positions[i] (the last position the step computed)."""
        finished = []
        for seq, last_position, token_id, log_prob in zip(seqs, last_positions, token_ids, log_probs):
            if seq.status is FINISHED:  # overlapped: it stopped at the step before; drop the token
                continue
            if last_position >= seq.num_computed_tokens:
                seq.num_computed_tokens = last_position + 1
            if seq.has_placeholder:  # the slot look_ahead reserved (inline: a call per row costs ~0.1 ms a step)
                seq.token_ids[-1] = token_id
                seq.output_log_probs[-1] = log_prob
                seq.has_placeholder = False
            else:
                seq.append_token(token_id, log_prob)
            # The full finish rules only for the few tokens that can end the sequence.
            if token_id in seq.stop_token_ids or len(seq.token_ids) >= seq.max_num_tokens:
                reason = self.token_finish_reason(seq, token_id)
                if reason is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
        return finished

    def token_finish_reason(self, seq: Sequence, token_id: int) -> dict | None:
        params = seq.sampling_params
        num_tokens = len(seq.token_ids)
        num_completion_tokens = num_tokens - seq.num_prompt_tokens
        is_stop_token = token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)
        # The sampler masks stop tokens while fewer than min_new_tokens tokens exist; this guards other samplers.
        if is_stop_token and num_completion_tokens > params.min_new_tokens:
            return {"type": "stop", "matched": token_id}
        return self._length_finish_reason(seq, num_tokens)

    def _length_finish_reason(self, seq: Sequence, num_tokens: int) -> dict | None:
        """The length limit (max_new_tokens, then max_model_len) that `num_tokens` tokens of `seq` reach, if any."""
        max_new_tokens = seq.sampling_params.max_new_tokens
        num_completion_tokens = num_tokens - seq.num_prompt_tokens
        if max_new_tokens is not None and num_completion_tokens >= max_new_tokens:
            return {"type": "length", "length": max_new_tokens}
        if num_tokens >= self.max_model_len:
            return {"type": "length", "length": num_completion_tokens}
        return None

    def finish(self, seq: Sequence, finish_reason: dict) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if self.on_finish is not None:
            self.on_finish(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, {"type": "abort", "message": "aborted by request"})
