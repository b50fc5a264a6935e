"""Diagnostics for benchmark runs: how long the GPU was busy in a torch profiler trace (the union of its kernels'
and copies' intervals, to set against the wall time of the traced region; the difference is time the GPU waited for
the host), which Triton kernels compiled, and how long Python's garbage collections paused the run."""

from __future__ import annotations

import gc
import time

import torch


def busy_microseconds(prof) -> tuple[float, int]:
    """(GPU busy time in us, number of device events) of a finished `torch.profiler.profile`."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, current_start, current_end = 0.0, None, None
    for start, end in intervals:
        if current_end is None or start > current_end:
            busy += 0 if current_end is None else current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    busy += 0 if current_end is None else current_end - current_start
    return busy, len(intervals)


def log_triton_compiles(label: str = "triton") -> list[str]:
    """From now on, print each Triton kernel compiled in this process (a compile mid-run shows up as a slow step);
    returns the list the names are appended to. A no-op where Triton or its compile hook is missing."""
    compiled: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        return compiled

    def hook(**kwargs):
        name = str(kwargs.get("repr", "?"))
        compiled.append(name)
        kernel, _, arguments = name.partition("[")
        print(f"[{label}] compiled {kernel}: {arguments.partition('](')[2][:400]}", flush=True)

    knobs.runtime.jit_post_compile_hook = hook
    return compiled


class GcPauses(list):
    """Durations (s) of the garbage collections that run while `callback` is in `gc.callbacks`."""

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        elif hasattr(self, "started"):
            self.append(time.perf_counter() - self.started)


def gc_pauses() -> GcPauses:
    pauses = GcPauses()
    gc.callbacks.append(pauses.callback)
    return pauses
