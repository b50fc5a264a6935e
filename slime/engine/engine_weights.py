"""The engine's weights across its ranks: loading pushes (tensors, a checkpoint folder, a received broadcast) on
every rank of a sharded engine at the same point between two steps, the weight version, and the per-rank report
(version + checksum) that proves no rank missed a push. A mixin of `Engine` (engine.py), which owns the scheduler
and the model runner; at one rank the same code runs with no other ranks.

A push is two-phase where it can be: every other rank first takes its copy of the tensors and checks their names and
shapes (`weights.prepare_entry`, or `weights.receive` for a broadcast), and only when all did does every rank load
(`weights.apply_stash`), so a bad entry for one rank changes no rank. A rank that fails after that, or reports a
version other than the pushed one, is an error naming it, and the engine refuses to generate until a later push
reaches every rank.
"""

from __future__ import annotations

import torch

from slime.engine.models import load_model_config
from slime.engine.models.weight_loader import check_named_tensors, named_weight_shapes
from slime.engine.parallel.rank_weights import RankError


class EngineWeights:
    def named_weight_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return named_weight_shapes(self.model_runner.model)

    def load_weights(self, named_tensors) -> None:
        """Copy HF-named tensors into the model (any subset), after checking every name and shape; flushes the
        prefix cache. Does not change weight_version (see `update_weights_from_tensors`)."""
        self._load_on_every_rank(list(named_tensors), None, self.weight_version)

    def update_weights_from_tensors(self, named_tensors, weight_version: str | None = None,
                                    rank_entries: list[str] | None = None) -> None:
        """Load full HF-named tensors and move to `weight_version`. A sharded engine's other ranks read their own
        item of `rank_entries` (the serialized tensors of /update_weights_from_tensor, one per rank); without it,
        they get `named_tensors` serialized."""
        version = self._next_version(weight_version)
        self._load_on_every_rank(list(named_tensors), rank_entries, version)
        self._bump_weight_version(version)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        self._check_resident("load weights", tags=("weights",), needs_valid_weights=False)
        if not load_model_config(model_path).same_architecture(self.model_config):
            raise ValueError(f"model_path {str(model_path)!r} has a different architecture than the engine's model")
        self._drain()
        version = self._next_version(weight_version)
        self._on_every_rank(lambda: self.model_runner.load_checkpoint_dir(model_path), version,
                            "weights.load_dir", model_path, version)  # every weight, or a ValueError
        self.flush_cache()
        self._bump_weight_version(version)

    def apply_received_weights(self, named_tensors, weight_version: str | None = None) -> None:
        """/update_weights_from_distributed: rank 0's received tensors, and the other ranks' (received into their
        stash by `weights.receive`), loaded at this same point between two steps."""
        version = self._next_version(weight_version)
        named_tensors = list(named_tensors)
        self._check_resident("load weights", tags=("weights",), needs_valid_weights=False)
        self._drain()
        self._check_names(named_tensors)
        self._on_every_rank(lambda: self.model_runner.load_named_tensors(named_tensors), version,
                            "weights.apply_stash", version)
        self.flush_cache()
        self._bump_weight_version(version)

    def _check_names(self, named_tensors) -> None:
        check_named_tensors(self.named_weight_shapes(), named_tensors, self.model_config.model_type)

    def _load_on_every_rank(self, named_tensors, rank_entries: list[str] | None, version: str) -> None:
        self._check_resident("load weights", tags=("weights",), needs_valid_weights=False)
        self._drain()  # the step in flight finishes on the weights it started with
        self._check_names(named_tensors)
        if self.ranks is not None:
            if rank_entries is None:
                from slime.utils.weight_transport import serialize_named_tensors

                rank_entries = [serialize_named_tensors(named_tensors)] * self.config.tp_size
            self.ranks.call("weights.prepare_entry", rank_entries)  # RankError naming a bad entry: nothing loaded
        self._on_every_rank(lambda: self.model_runner.load_named_tensors(named_tensors), version,
                            "weights.apply_stash", version)
        self.flush_cache()

    def _on_every_rank(self, load_here, version: str, target: str, *args) -> None:
        """Run rank 0's load with the other ranks' `target` call, then check that every rank holds `version`: a
        rank that missed a push is an error naming it, never a silently stale shard."""
        if self.ranks is None:
            load_here()
            others = []
        else:
            try:
                with self.ranks.calling(target, *args):
                    load_here()
            except RankError as error:
                self.rank_mismatch = str(error)
                raise
            others = self.ranks.last_results
        self.rank_weights.weight_version = version
        self.rank_reports = [self.rank_weights.report(), *others]
        stale = [r for r in self.rank_reports if r["weight_version"] != version]
        if stale:
            self.rank_mismatch = "; ".join(f"engine rank {r['rank']} holds weight version {r['weight_version']!r}, "
                                           f"not {version!r}: it missed this push" for r in stale)
            raise RankError(self.rank_mismatch)
        self.rank_mismatch = None

    def _next_version(self, weight_version: str | None) -> str:
        return str(weight_version) if weight_version is not None else str(self.num_weight_updates + 1)

    def _bump_weight_version(self, weight_version: str) -> None:
        self.num_weight_updates += 1
        self.weight_version = weight_version
