"""The trainer-rank groups of a colocated tensor push: trainer rank r feeds engine r // N as its rank r % N.

With `--colocate` and engines of N devices, trainer rank r shares its device with rank r % N of engine r // N
(slime/ray/placement_group.py). When every trainer rank holds the full tensors of a bucket (FSDP), each packs them on
its own device and serializes one handle, and the N trainer ranks of an engine gather their handles (`gather_object`
over a gloo group of those N ranks) to the first of them, which POSTs the list: entry i is opened by the engine's
rank i on the device it sits on (slime's layout, SL `update_weight_from_tensor.py`). Engines past the trainer's
ranks (`--rollout-num-gpus` above the trainer's) are fed by rank 0 instead.

Not the HTTP or the bucketing (slime/backends/weight_sender.py) and not the rank arithmetic
(slime/backends/engine_ranks.py).
"""

from __future__ import annotations

import torch.distributed as dist

from slime.backends.engine_ranks import colocated_engine, group_ranks, num_colocated_engines


class ColocatedFeeders:
    """This trainer rank's part of the colocated push. Collective calls (`ensure_groups`, `gather`,
    `merge_to_rank0`) are made by every trainer rank in the same order."""

    def __init__(self, rank: int, world_size: int, per_engine: int):
        self.rank, self.world_size, self.per_engine = rank, world_size, per_engine
        self.engine = colocated_engine(rank, per_engine, world_size)  # the engine this rank feeds, or None
        self.groups: dict[int, object] | None = None
        self.world_group = None
        self.held = None  # this rank's packed bucket, alive while its group's first rank POSTs the handle to it

    @property
    def engines(self) -> set[int]:
        """The engines trainer rank groups feed (every other engine is rank 0's)."""
        return set(range(num_colocated_engines(self.world_size, self.per_engine)))

    @property
    def is_first(self) -> bool:
        """Whether this rank POSTs its engine's entries."""
        return self.engine is not None and self.rank == group_ranks(self.engine, self.per_engine)[0]

    def ensure_groups(self) -> None:
        """Create the gloo groups once (collective over every trainer rank): one per engine of N > 1 ranks, and one
        of every rank for the push's results."""
        if self.groups is not None or self.world_size == 1:
            return
        self.groups = {}
        for engine in sorted(self.engines):  # every rank creates every group, in one order
            group = dist.new_group(group_ranks(engine, self.per_engine), backend="gloo")
            self.groups[engine] = group if self.per_engine > 1 else None
        self.world_group = dist.new_group(backend="gloo")

    def gather(self, entry: str) -> list[str] | None:
        """Collective over this rank's engine group: the group's N entries in engine-rank order on its first rank,
        None on the others."""
        if self.per_engine == 1:
            return [entry]
        first = group_ranks(self.engine, self.per_engine)[0]
        entries = [None] * self.per_engine if self.rank == first else None
        dist.gather_object(entry, entries, dst=first, group=self.groups[self.engine])
        return entries

    def merge_to_rank0(self, items: list) -> list:
        """Collective over every trainer rank: rank 0 gets everyone's `items` concatenated (rank order), the
        others keep their own."""
        if self.world_group is None:
            return items
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(items, gathered, dst=0, group=self.world_group)
        return [item for part in gathered for item in part] if self.rank == 0 else items
