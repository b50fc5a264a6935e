"""slime/utils/daemon_threads.run_in_daemon_thread: a call still running when its caller's event loop closes (a
timeout gave up on it, the process is ending) finishes without an error on its thread; a call that returns in time
resolves its caller's await with the result or the exception. (That such threads do not hold the process at exit is
tests/e2e/test_process_lifetime.py's.)"""

from __future__ import annotations

import asyncio
import threading

import pytest

from slime.utils.daemon_threads import run_in_daemon_thread


def test_results_and_errors_reach_the_caller():
    async def main():
        assert await run_in_daemon_thread(sum, [1, 2, 3]) == 6
        with pytest.raises(ZeroDivisionError):
            await run_in_daemon_thread(divmod, 1, 0)

    asyncio.run(main())


def test_a_call_returning_after_its_loop_closed_leaves_no_error_on_its_thread():
    release, errors = threading.Event(), []
    previous_hook = threading.excepthook
    threading.excepthook = lambda hook_args: errors.append(hook_args.exc_value)
    try:
        async def give_up():
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(run_in_daemon_thread(release.wait), timeout=0.05)

        asyncio.run(give_up())  # closes its loop with the call still blocked
        (thread,) = [t for t in threading.enumerate() if t.name == "slime-wait"]
        release.set()
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        threading.excepthook = previous_hook
    assert errors == []
