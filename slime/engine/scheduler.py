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
from collections.abc import Callable

from slime.engine.block_manager import BlockManager
from slime.engine.overlap import SchedulerLookAhead
from slime.engine.scheduled_batch import DecodeBatch, ScheduledSequence
from slime.engine.sequence import FINISHED, Sequence, SequenceStatus


class Scheduler(SchedulerLookAhead):
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
            self.admit(scheduled, budget)
        return scheduled

    def admit(self, scheduled: list[ScheduledSequence], budget: int) -> None:
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
