"""Child processes that die with the process that started them (Linux `PR_SET_PDEATHSIG`).

The sglang-router and the engine servers are children of Ray actors, which live in process groups of their own:
when a run is killed (SIGKILL of the driver's group, a crashed raylet) nothing else stops them, and they would go
on listening. The kernel sends the signal when the *thread* that started the child exits, so start long-lived
children from a thread that lives as long as their owner (a Ray actor's methods run on its main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A `subprocess.Popen(preexec_fn=...)` that has the child SIGKILLed when this process goes; None (nothing to
    run) elsewhere than Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child must not load libraries
    parent_pid = os.getpid()

    def arm() -> None:
        # Also exit if the parent died before the signal was armed: nobody would send it any more.
        if prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)) != 0 or os.getppid() != parent_pid:
            os._exit(1)

    return arm
