"""What one weight push reports back to the driver (no torch: the driver reads it without the training backend)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WeightPushResult:
    """One push of the trainer's weights to the engines, as rank 0 saw it."""

    seconds: float
    """Wall time of the push, gathering the parameters included."""
    bytes: int
    """Bytes of the parameters sent (in the dtype they travelled in)."""
    num_buckets: int
    """Buckets the parameters were sent in (one request / file per bucket)."""
    unreachable_engines: list[str] = field(default_factory=list)
    """Engines that did not answer; the others got the whole push (the engine watch restarts the lost ones)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Transport-specific metrics (disk: perf/update_weights_density and perf/update_weights_wire_bytes)."""

    def log_metrics(self) -> dict[str, float]:
        """The perf/weight_push_* metrics of the run's log."""
        return {"perf/weight_push_time": self.seconds, "perf/weight_push_gb": self.bytes / 1e9,
                "perf/weight_push_buckets": self.num_buckets,
                "perf/weight_push_gb_per_s": self.bytes / 1e9 / max(self.seconds, 1e-9), **self.metrics}
