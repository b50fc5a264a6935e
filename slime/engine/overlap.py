"""Overlapped scheduling, in one place: the next step is scheduled and launched while the current one still runs
on the device, so the GPU never waits for the host between two steps.

A step scheduled ahead does not know the tokens the step in flight is sampling: each sequence that continues gets
a placeholder token (`reserve_placeholder`) and one more KV slot; its input is read on the device from the step in
flight's samples (`placeholder_sources`), and `Scheduler.postprocess` fills the placeholder when the real token
reaches the host. Two halves, each a mixin of the class it runs in:
- `SchedulerLookAhead` (the scheduler's): `look_ahead` for a steady decode step, `schedule_ahead` for steps with
  prefill chunks or waiting requests; both decline (None) where only the real tokens can decide (preemption, a
  sequence the pending token may end by length).
- `OverlappedStepping` (the engine's): the step in flight, launching ahead, draining it before the engine's state
  changes (weights, memory, aborts), and recovering from a failed launch.
Plain Python apart from the device-side index of the placeholder rows. Not the scheduling policy itself
(scheduler.py) and not the model's forward (model_runner.py).
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from slime.engine.request_output import RequestOutput
from slime.engine.scheduled_batch import DecodeBatch, ScheduledSequence, is_decode_batch, sampled_seqs
from slime.engine.sequence import PLACEHOLDER, PLACEHOLDER_LOG_PROB, Sequence, SequenceStatus


def reserve_placeholder(seq: Sequence) -> None:
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
    sample_index = {id(item.seq): index for index, item in enumerate(filter(attrgetter("needs_sample"), batch))}
    rows = [row for row, item in enumerate(ahead) if item.seq.has_placeholder]
    return rows, [sample_index[id(ahead[row].seq)] for row in rows]


class SchedulerLookAhead:
    """The scheduler's half of overlapped scheduling. The host class (`Scheduler`) provides `running`, `waiting`,
    `block_manager`, `max_num_batched_tokens` and `admit(scheduled, budget)`."""

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
        seqs = batch.seqs if isinstance(batch, DecodeBatch) else [item.seq for item in batch]
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
                reserve_placeholder(seq)
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
        self.admit(scheduled, budget)
        return scheduled


class OverlappedStepping:
    """The engine's half of overlapped scheduling: `in_flight` holds (scheduled batch, its LaunchedStep) of the step
    launched and not yet completed. The host class (`Engine`) provides `scheduler`, `model_runner`, `config`,
    `pending_outputs`, `num_launched_steps`, `in_flight` (None until a step is launched) and
    `_complete(scheduled, launched)`."""

    def _overlapped_step(self) -> list[RequestOutput]:
        """Launch the step after the one in flight (scheduled ahead on placeholders, its input tokens gathered on
        the device), then wait for the one in flight; without a step in flight, launch one normally."""
        in_flight, self.in_flight = self.in_flight, None
        outputs = []
        if in_flight is not None:
            scheduled, launched = in_flight
            ahead = self.scheduler.look_ahead(scheduled) if launched is not None else None
            if ahead:
                if len(ahead) == len(scheduled):  # every sequence continues: the tokens are the inputs as they are
                    input_tokens = launched.tokens
                else:
                    source_rows = [row for row, seq in enumerate(sampled_seqs(scheduled)) if seq.has_placeholder]
                    input_tokens = launched.tokens[self.model_runner.staging.to_device(np.array(source_rows))]
                self.in_flight = (ahead, self._launch(ahead, input_tokens, in_flight=in_flight))
                self.num_launched_steps += 1
            elif self.config.overlap_prefill:
                self._launch_scheduled_ahead(scheduled, launched)
            outputs = self._complete(scheduled, launched)
        if self.in_flight is None and self.scheduler.has_unfinished():
            scheduled = self.scheduler.schedule()
            assert scheduled, "scheduler made no progress with unfinished requests"
            self.in_flight = (scheduled, self._launch(scheduled))
            self.num_launched_steps += 1
        return outputs

    def _launch_scheduled_ahead(self, scheduled, launched) -> None:
        """Overlapped prefill: launch the step after `scheduled` before its tokens reach the host; rows fed by a
        placeholder read their token on the device from the in-flight step's samples."""
        ahead = self.scheduler.schedule_ahead(scheduled)
        if ahead:
            rows, sources = placeholder_sources(scheduled, ahead)
            input_tokens = launched.tokens[self.model_runner.staging.to_device(np.array(sources))] if rows else None
            self.in_flight = (ahead, self._launch(ahead, input_tokens, np.array(rows) if rows else None,
                                                  in_flight=(scheduled, launched)))
            self.num_launched_steps += 1

    def _launch(self, scheduled, input_tokens=None, input_rows=None, in_flight=None):
        """model_runner.launch; if it raises (e.g. out of memory), first the step in flight is completed (it fills
        the placeholders a step scheduled ahead reserved) and the prefix cache flushed (it registered blocks the
        failed step never wrote)."""
        try:
            return self.model_runner.launch(scheduled, input_tokens, input_rows)
        except BaseException:
            if in_flight is not None:
                self.pending_outputs.extend(self._complete(*in_flight))
            self.block_manager.flush()
            raise

    def _drain(self) -> None:
        """Finish the step in flight (overlapped scheduling) before the engine's state changes under it."""
        if self.in_flight is not None:
            (scheduled, launched), self.in_flight = self.in_flight, None
            self.pending_outputs.extend(self._complete(scheduled, launched))
