"""Diagnostics for benchmark runs: how long the GPU was busy in a torch profiler trace (the union of its kernels'
and copies' intervals, to set against the wall time of the traced region; the difference is time the GPU waited for
the host), which Triton kernels compiled, how long Python's garbage collections paused the run, and a profile of the
first steps of a run (host calls, GPU kernels, Python functions)."""

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


def idle_gaps(prof, num_gaps: int = 8) -> list[tuple[float, str, str]]:
    """The longest stretches in which the GPU ran nothing, as (microseconds, device event before, device event
    after), longest first: where in a step the GPU waited for the host."""
    events = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA))
    gaps, busy_until, last_name = [], None, ""
    for start, end, name in events:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, last_name[:60], name[:60]))
        if busy_until is None or end >= busy_until:
            busy_until, last_name = end, name
    return sorted(gaps, reverse=True)[:num_gaps]


def log_triton_compiles(label: str = "triton") -> list[tuple[float, str]]:
    """From now on, print each Triton kernel compiled in this process with what it was specialised on (a compile
    mid-run shows up as a slow step); returns the list of (time.perf_counter() when done, description) it appends
    to. A no-op where Triton or its compile hook is missing."""
    compiled: list[tuple[float, str]] = []
    try:
        from triton import knobs
    except ImportError:
        return compiled

    def hook(**kwargs):
        name = str(kwargs.get("repr", "?")).partition("[")[0]
        details = kwargs.get("compile") or {}
        constants = {k: v for k, v in (details.get("constants") or {}).items() if not isinstance(v, type(None))}
        text = f"{name} constants {constants} specialisation {details.get('configs')}"[:600]
        compiled.append((time.perf_counter(), text))
        print(f"[{label}] compiled {text}", flush=True)

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


class StepTracer:
    """--trace-steps: the torch profiler (host calls, GPU kernels) and cProfile (Python functions) over the first
    steps of a timed run."""

    def __init__(self, device: str):
        import cProfile

        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.torch_profile = torch.profiler.profile(activities=activities)
        self.python_profile = cProfile.Profile()
        self.torch_profile.__enter__()
        self.python_profile.enable()

    def stop_and_print(self) -> None:
        import pstats

        self.python_profile.disable()
        self.torch_profile.__exit__(None, None, None)
        averages = self.torch_profile.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=12))
        if any(event.device_time_total for event in averages):
            print(averages.table(sort_by="device_time_total", row_limit=8))
        pstats.Stats(self.python_profile).sort_stats("cumulative").print_stats(25)
