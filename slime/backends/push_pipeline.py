"""The shape of a weight push over time: parameters grouped into buckets, and one bucket's request in flight while
the next is gathered and packed.

Not what a bucket is sent with (slime/backends/weight_sender.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

# SGLang's DeepSeek loader fuses q_a_proj and kv_a_proj_with_mqa into one matrix only when both arrive in one
# load_weights call (one bucket): the first opens a bucket boundary that only the second closes.
PAIRED_IN_ONE_BUCKET = (("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),)


def _bucket_partner(name: str) -> str | None:
    """The name that must travel in the same bucket as `name`, when `name` opens such a pair."""
    for first, second in PAIRED_IN_ONE_BUCKET:
        if name.endswith("." + first):
            return name[: -len(first)] + second
    return None


def iter_buckets(named_tensors, bucket_bytes: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor goes alone; a pair of
    PAIRED_IN_ONE_BUCKET and what lies between them share one bucket); yields (bucket, is_last)."""
    bucket, size, pending, waiting_for = [], 0, None, None
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes and waiting_for is None:
            if pending is not None:
                yield pending, False
            pending, bucket, size = bucket, [], 0
        bucket.append((name, tensor))
        size += nbytes
        waiting_for = None if name == waiting_for else (waiting_for or _bucket_partner(name))
    if pending is not None:
        yield pending, not bucket
    if bucket:
        yield bucket, True


class OneInFlight:
    """Runs calls one at a time in a background thread, in the order submitted: `submit` first waits for the call in
    flight (raising its error), so the caller prepares the next call while the last one runs."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self.pending = None

    def submit(self, call, *args) -> None:
        self.wait()
        self.pending = self.pool.submit(call, *args)

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()
