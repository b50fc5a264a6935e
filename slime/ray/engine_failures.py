"""What went wrong with an engine or the router, in words a user can act on, and the errors that end a run.

An engine's exit code becomes "killed by signal 9 (SIGKILL)" or "exited with code 1"; a hang becomes "no answer to
GET /health_generate within N s". The errors name the engine, its URL and its log file, and the flag that decides
what happens next, so that a failure is never reported as a connection problem with the router.
"""

from __future__ import annotations

import signal


class EngineFailureError(RuntimeError):
    """A rollout engine (or the router slime started) failed and the run cannot go on."""


def describe_exit(exit_code: int | None) -> str:
    """'killed by signal 9 (SIGKILL)' for a negative Popen return code, 'exited with code N' otherwise."""
    if exit_code is None:
        return "still running"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-exit_code} ({name})"
    return f"exited with code {exit_code}"


def describe_hang(timeout_s: float) -> str:
    return f"hung: no answer to GET /health_generate within {timeout_s:g} s (--rollout-health-check-timeout)"


def engine_died_error(rank: int, url: str, reason: str, log_path: str) -> EngineFailureError:
    """The error of a run without --use-fault-tolerance whose engine failed."""
    return EngineFailureError(
        f"rollout engine {rank} ({url}) failed: {reason}; its log: {log_path}. Without --use-fault-tolerance an "
        "engine failure ends the run; add --use-fault-tolerance to take it out of the router, re-send its requests "
        "to the other engines and restart it with the current weights")


def restart_budget_error(rank: int, url: str, reason: str, log_path: str, max_restarts: int) -> EngineFailureError:
    return EngineFailureError(
        f"rollout engine {rank} ({url}) failed: {reason}; its log: {log_path}. The run has used all "
        f"{max_restarts} engine restarts of --max-engine-restarts; raise it, or find in the engines' logs why "
        "they fail")


def router_died_error(exit_code: int | None, log_path: str) -> EngineFailureError:
    return EngineFailureError(
        f"the sglang-router slime started {describe_exit(exit_code)}; its log: {log_path}. Without "
        "--use-fault-tolerance this ends the run; add --use-fault-tolerance to restart it on the same port")


def external_engine_error(rank: int, url: str, reason: str) -> EngineFailureError:
    """An engine of --rollout-external-engine-addrs failed: the run neither started it nor may restart it."""
    return EngineFailureError(
        f"external rollout engine {rank} ({url}, --rollout-external-engine-addrs) failed: {reason}. This run did "
        "not start it and does not restart it: bring it back and resume the run (--load)")
