"""math-verify equivalence checks in a pool of worker processes, each bounded by a timeout.

Why a process pool: math-verify's own timeouts use SIGALRM, which only works in a process's main thread (elsewhere
it raises unless both timeouts are None), and sympy can spin for a long time on adversarial answers. In a worker
process the grading runs in that worker's main thread, so math-verify keeps its internal timeouts, and the caller
adds its own wall-clock bound on top. The pool starts lazily with the "spawn" method (no fork of a process that
runs threads) and is rebuilt if a worker dies. As with any spawned worker, a launcher script that grades in its own
process must keep its top-level code under `if __name__ == "__main__":` (Ray actors need nothing).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import multiprocessing
import os
import threading

MATH_VERIFY_TIMEOUT_S = 10.0
NUM_WORKERS = max(1, min(4, os.cpu_count() or 1))

_pool: concurrent.futures.ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def math_verify_equal(pred: str, gold: str) -> bool:
    """True if math-verify finds `pred` and `gold` (both answer strings, no `$`) equivalent. Runs in a worker."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$")  # math-verify 0.9 needs the gold wrapped in $...$ to read it as LaTeX
    pred_parsed = parse(f"${pred}$")
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed))


def _get_pool() -> concurrent.futures.ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=NUM_WORKERS, mp_context=multiprocessing.get_context("spawn")
            )
        return _pool


@atexit.register
def shutdown_pool() -> None:
    """Stop the workers (registered at exit, so interpreter teardown does not find a live pool)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _discard_pool(broken: concurrent.futures.ProcessPoolExecutor) -> None:
    global _pool
    with _pool_lock:
        if _pool is broken:
            _pool = None
    broken.shutdown(wait=False, cancel_futures=True)


async def run_in_pool(fn, *args, timeout: float, description: str):
    """`fn(*args)` in the worker pool (fn must be picklable); raises TimeoutError after `timeout` seconds."""
    pool = _get_pool()
    try:
        future = pool.submit(fn, *args)
    except concurrent.futures.process.BrokenProcessPool:
        _discard_pool(pool)
        pool = _get_pool()
        future = pool.submit(fn, *args)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{description} took longer than {timeout}s") from None
    except concurrent.futures.process.BrokenProcessPool:
        _discard_pool(pool)
        raise


async def math_equal_in_pool(pred: str, gold: str, timeout: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """`math_verify_equal` in the worker pool; raises TimeoutError after `timeout` seconds."""
    description = f"math-verify on {pred[:80]!r}"
    return await run_in_pool(math_verify_equal, pred, gold, timeout=timeout, description=description)
