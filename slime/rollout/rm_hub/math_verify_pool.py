"""math-verify equivalence checks in a pool of worker processes, each bounded by a timeout.

Why a process pool: math-verify's own timeouts use SIGALRM, which only works in a process's main thread (elsewhere
it raises unless both timeouts are None), and sympy can spin for a long time on adversarial answers. In a worker
process the grading runs in that worker's main thread, so math-verify keeps its internal timeouts, and the caller
adds its own wall-clock bound on top. The pool starts lazily with the "spawn" method (no fork of a process that
runs threads) and is rebuilt if a worker dies.
"""

from __future__ import annotations

import asyncio
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


def _discard_pool(broken: concurrent.futures.ProcessPoolExecutor) -> None:
    global _pool
    with _pool_lock:
        if _pool is broken:
            _pool = None
    broken.shutdown(wait=False, cancel_futures=True)


async def math_equal_in_pool(pred: str, gold: str, timeout: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """`math_verify_equal` in the worker pool; raises TimeoutError after `timeout` seconds."""
    pool = _get_pool()
    try:
        future = pool.submit(math_verify_equal, pred, gold)
    except concurrent.futures.process.BrokenProcessPool:
        _discard_pool(pool)
        future = _get_pool().submit(math_verify_equal, pred, gold)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"math-verify took longer than {timeout}s on {pred[:80]!r}") from None
    except concurrent.futures.process.BrokenProcessPool:
        _discard_pool(pool)
        raise
