"""Where a busy period of the engine's driver thread goes: from the step that found work after an idle wait to the
next idle wait, the time inside `engine.step()`, inside queued commands, and in lazy CUDA-graph captures, with the
steps, finished requests and output tokens. Logged once per period (a colocated rollout is one period), so the
loop's rollout phase can be set beside the engine's own time without a profiler.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class BusyPeriod:
    def __init__(self, capture_stats: dict | None = None):
        self.capture_stats = capture_stats if capture_stats is not None else {"graphs": 0, "seconds": 0.0}
        self.last: dict | None = None  # the last finished period's numbers
        self._start: float | None = None

    @property
    def active(self) -> bool:
        return self._start is not None

    def begin(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()
            self._steps = self._requests = self._tokens = 0
            self._step_s = self._command_s = 0.0
            self._captures_before = dict(self.capture_stats)

    def add_step(self, seconds: float) -> None:
        self._steps += 1
        self._step_s += seconds

    def add_commands(self, seconds: float) -> None:
        if self._start is not None:
            self._command_s += seconds

    def add_finished(self, num_output_tokens: int) -> None:
        self._requests += 1
        self._tokens += num_output_tokens

    def end(self) -> None:
        if self._start is None:
            return
        wall = time.perf_counter() - self._start
        self.last = {"seconds": wall, "steps": self._steps, "step_seconds": self._step_s,
                     "command_seconds": self._command_s, "finished_requests": self._requests,
                     "output_tokens": self._tokens,
                     "graph_captures": self.capture_stats["graphs"] - self._captures_before["graphs"],
                     "graph_capture_seconds": self.capture_stats["seconds"] - self._captures_before["seconds"]}
        self._start = None
        if self._steps:
            last = self.last
            logger.info("engine busy %.3f s: %d steps in %.3f s (%.2f ms each), commands %.3f s, other %.3f s; "
                        "%d lazy graph captures %.3f s; %d requests finished, %d output tokens (%.0f tok/s)",
                        wall, last["steps"], last["step_seconds"], 1e3 * last["step_seconds"] / last["steps"],
                        last["command_seconds"], wall - last["step_seconds"] - last["command_seconds"],
                        last["graph_captures"], last["graph_capture_seconds"], last["finished_requests"],
                        last["output_tokens"], last["output_tokens"] / max(wall, 1e-9))
