"""The ReTool example's tool: `python(code)` runs the code in the sandbox (`sandbox.py`) and returns what it
printed, or the error that stopped it.

    --tool-functions-path examples.retool.python_tool.python --tool-call-parser qwen

At most `MAX_CONCURRENT_RUNS` sandboxes run at once (a rollout may call the tool for every sample together); the
wait counts against --tool-timeout, which should stay above the sandbox's own wall-clock limit.
"""

from __future__ import annotations

import os
import threading

from examples.retool.sandbox import SandboxLimits, run_code

LIMITS = SandboxLimits(wall_seconds=5.0, cpu_seconds=5, memory_mb=1024, file_size_mb=16, max_output_chars=2000)
MAX_CONCURRENT_RUNS = max(2, os.cpu_count() or 1)
_slots = threading.BoundedSemaphore(MAX_CONCURRENT_RUNS)


def python(code: str) -> str:
    """Run Python 3 code in a sandbox and return what it prints (stdout and stderr); print() the result you need."""
    with _slots:
        result = run_code(code, LIMITS)
    if result.ok and not result.output.strip():
        return "(no output: print() the values you want to see)"
    return result.output
