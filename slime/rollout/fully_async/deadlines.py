"""Bounded staleness by admission: which prompt group may start generating, and which finished groups the trainer
may take, so that no trained token is more than N policy versions older than the weights trained on it.

Versions count trainer steps: the trainer's step t trains the weights of version t and publishes version t + 1
(engines hold the last version pushed). A group admitted while the engines hold version v generates only tokens of
versions >= v, so it must be trained at a step <= v + N: its *deadline*. AReaL's capacity rule (admitted groups <=
(N + v + 1) x batch) bounds how many groups share a deadline, but alone it does not keep the bound when groups finish
out of order (a long-tailed group bypassed by faster ones can meet more than a batch of others at its deadline).
The ledger keeps the exact feasibility condition instead: for every deadline d, the untrained groups due by d fit in
the steps left before it,

    #{untrained groups with deadline <= d}  <=  (d - next_step + 1) x batch_size,

checked when a group is admitted and when the trainer takes a batch (earliest deadline first; it waits for a running
group rather than take a batch that breaks the condition). Taking the B earliest deadlines preserves the condition,
so the trainer never waits forever: the groups it waits for are running. Without N every deadline is infinite and the
trainer takes the oldest finished groups. Groups a filter rejects leave the ledger (their slot is refilled).

Pure bookkeeping: no I/O, no asyncio, no torch (slime/rollout/fully_async/stream.py drives it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class DeadlineLedger:
    batch_size: int  # groups per trainer step
    max_staleness: int | None
    next_step: int = 0  # the step the trainer trains next (= the version of its weights)
    deadlines: dict[int, float] = field(default_factory=dict)  # untrained group id -> deadline step

    def deadline(self, engine_version: int) -> float:
        return math.inf if self.max_staleness is None else engine_version + self.max_staleness

    def is_feasible(self) -> bool:
        """Whether every untrained group can still be trained by its deadline (always, unless restored under a
        smaller bound than it was admitted with)."""
        return self._feasible(self.deadlines.values(), self.next_step)

    def _feasible(self, deadlines, next_step: int) -> bool:
        for position, deadline in enumerate(sorted(deadlines), start=1):
            if deadline == math.inf:
                return True
            if position > (deadline - next_step + 1) * self.batch_size:
                return False
        return True

    def can_admit(self, engine_version: int) -> bool:
        return self._feasible([*self.deadlines.values(), self.deadline(engine_version)], self.next_step)

    def admit(self, group_id: int, engine_version: int) -> None:
        assert group_id not in self.deadlines
        self.deadlines[group_id] = self.deadline(engine_version)

    def forget(self, group_id: int) -> None:
        """A group that will never be trained (rejected by a filter, or dropped at shutdown)."""
        self.deadlines.pop(group_id)

    def choose_batch(self, finished: list[int]) -> list[int] | None:
        """The `batch_size` finished groups to train at `next_step` (earliest deadline, then admission order = id),
        or None when the trainer must wait (too few finished, or a running group is due before the ones left)."""
        if len(finished) < self.batch_size:
            return None
        chosen = sorted(finished, key=lambda g: (self.deadlines[g], g))[: self.batch_size]
        chosen_set = set(chosen)
        rest = [d for g, d in self.deadlines.items() if g not in chosen_set]
        if not self._feasible(rest, self.next_step + 1):
            return None
        return chosen

    def consume(self, group_ids: list[int]) -> None:
        """The trainer took `group_ids` for `next_step`; the next step follows."""
        for group_id in group_ids:
            deadline = self.deadlines.pop(group_id)
            assert deadline >= self.next_step, f"group {group_id} is trained after its deadline {deadline}"
        self.next_step += 1

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}
