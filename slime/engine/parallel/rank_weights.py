"""One rank's side of a weight update in a sharded engine: it reads its own entry of a tensor push, re-reads a
checkpoint folder, joins a trainer's weight-update group at `rank_offset + rank` and receives its broadcast, and
reports the weight version it holds with a checksum of what it loaded.

Every route hands a rank FULL Hugging Face tensors; `ModelRunner.load_named_tensors` narrows each to the rank's
shard. Rank 0's engine and the other ranks' loops (`worker.py`) use this same class, so the ranks cannot drift
apart in how they load. A received broadcast is stashed and loaded only by `apply_stash`, which rank 0 sends from
its engine thread, so every rank switches weights at the same point between two steps.
"""

from __future__ import annotations

import torch

from slime.engine.models.weight_loader import check_named_tensors, named_weight_shapes
from slime.utils import weight_transport


class RankError(RuntimeError):
    """A rank of a sharded engine failed a call or missed a weight push (the message names the rank)."""


class RankWeights:
    def __init__(self, runner, rank: int):
        self.runner, self.rank = runner, rank
        self.weight_version = "0"
        self.groups: dict = {}
        self.stash: list[tuple[str, torch.Tensor]] | None = None
        self.shapes = named_weight_shapes(runner.model)

    def report(self) -> dict:
        return {"rank": self.rank, "weight_version": self.weight_version, "checksum": rank_checksum(self.runner.model)}

    def _loaded(self, named_tensors, weight_version: str) -> dict:
        self.runner.load_named_tensors(named_tensors)
        self.weight_version = weight_version
        return self.report()

    def prepare_entry(self, entries: list[str]) -> None:
        """A tensor push, first phase: this rank's item of `serialized_named_tensors`, opened and checked, kept
        until `apply_stash`."""
        self.stash = None
        named_tensors = weight_transport.deserialize_named_tensors(entries[self.rank])
        check_named_tensors(self.shapes, named_tensors, self.runner.model_config.model_type)
        self.stash = named_tensors

    def load_dir(self, model_path: str, weight_version: str) -> dict:
        self.runner.load_checkpoint_dir(model_path)
        self.weight_version = weight_version
        return self.report()

    def init_group(self, backend: str, init_method: str, world_size: int, rank_offset: int, group_name: str,
                   timeout) -> None:
        self.groups[group_name] = weight_transport.init_custom_process_group(
            backend, init_method, world_size, rank_offset + self.rank, group_name, timeout)

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is not None:
            weight_transport.destroy_custom_process_group(group)

    def receive(self, group_name: str, names: list[str], dtypes: list, shapes: list, keep: bool = True) -> None:
        """The trainer's broadcast of full tensors, kept until `apply_stash` (`keep` False: dropped, as for a LoRA
        adapter, which rank 0 writes into every rank's slot itself; this rank only takes its part in the
        collective). Every tensor is received even when a name is wrong (the trainer's broadcast must complete);
        rank 0 refuses such a push before anyone loads."""
        self.stash = None
        received = weight_transport.receive_named_tensors(self.groups[group_name], names, dtypes, shapes,
                                                          self.runner.device)
        self.stash = received if keep else None

    def apply_stash(self, weight_version: str) -> dict:
        if self.stash is None:
            raise RuntimeError(f"rank {self.rank} has no received weights to load (its receive failed)")
        named_tensors, self.stash = self.stash, None
        try:
            return self._loaded(named_tensors, weight_version)
        finally:
            del named_tensors  # drop the mapping of the sender's memory


def rank_checksum(model: torch.nn.Module) -> float:
    """A float64 sum of every value this rank holds (its shards and replicated tensors): two ranks that loaded the
    same push agree with a fresh engine's ranks on the same weights; a missed or partial load shows."""
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for param in model.parameters():
        if param.numel():
            total += param.detach().sum(dtype=torch.float64)
    return float(total)
