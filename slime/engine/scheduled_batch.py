"""What one engine step computes: a list of `ScheduledSequence` (a sequence's tokens this step), or a `DecodeBatch`
(the steady decode step, one token per sequence, without per-row objects). Plain Python, no torch; read by the
scheduler, the overlap logic, the model runner and its input builders."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

from slime.engine.sequence import Sequence

_seq, _num_new_tokens, _needs_sample = attrgetter("seq"), attrgetter("num_new_tokens"), attrgetter("needs_sample")


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
