"""The trainer's side of the hand-over to the rollout engines: saving a checkpoint, pushing the weights (or a LoRA
adapter alone) to the engines, and offloading / onloading around the engines' turn. A mixin of `TrainFlow`
(train_flow.py), which owns the training step; it reads `self.backend`, `self.weight_updater`, `self.snapshot`,
`self.device_room` and `self.lora` set up there.
"""

from __future__ import annotations

from slime.backends.engine_ranks import as_engine_map
from slime.backends.weight_push_result import WeightPushResult


class TrainFlowHandover:
    def save_model(self, rollout_id: int, run_state: dict | None = None) -> str:
        if not self.args.save:
            raise ValueError("save_model needs --save (the checkpoint root folder)")
        with self.backend.resident():
            return self.backend.save_checkpoint(rollout_id, run_state)

    def update_weights(self, engine_urls: dict[int, str] | list[str] | None = None, weight_version=None,
                       mode: str | None = None) -> WeightPushResult:
        """Push the current weights to the engines ({engine index: URL}, or a list of engines 0, 1, ...), connecting
        first when they or `mode` changed; LoRA: the adapter alone, or nothing with --lora-train-only (the engines
        stay on the base, as Miles)."""
        if self.lora and self.args.lora_train_only:
            return WeightPushResult(seconds=0.0, bytes=0, num_buckets=0)
        if engine_urls is not None and (as_engine_map(engine_urls) != self.weight_updater.engines
                                        or (mode and mode != self.weight_updater.mode)):
            self.weight_updater.connect(engine_urls, mode or self.weight_updater.mode)
        result = self.weight_updater.update(weight_version)
        if self.args.keep_old_actor:  # host copies of the last two pushed weight sets, by version
            self.snapshot.save(f"pushed:{weight_version}")
            self.pushed_versions = [v for v in self.pushed_versions if v != str(weight_version)] + [str(weight_version)]
            for stale in self.pushed_versions[:-2]:
                self.snapshot.drop(f"pushed:{stale}")
            self.pushed_versions = self.pushed_versions[-2:]
        return result

    def update_weights_resident(self, *args) -> WeightPushResult:
        """`update_weights` from either state: an offloaded trainer is onloaded around the push."""
        with self.backend.resident():
            return self.update_weights(*args)

    def offload(self) -> None:
        """GPU: free the weight sets' device copies, move parameters and optimizer state to host memory and release
        the cache. CPU: nothing to do."""
        with self.device_room.measuring_offload(self.snapshot.unbacked_device_bytes()):
            self.snapshot.offload()
            self.backend.offload()

    def onload(self) -> None:
        """The weight sets' uploads first (the ref pass reads them first), on a side stream beside the parameters."""
        self.snapshot.onload()
        self.backend.onload()
