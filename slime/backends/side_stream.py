"""SideStream: host <-> device copies queued on a CUDA side stream, so neither the CPU nor the compute stream waits
for them, and the stream-side wait that orders a reader of their data after them.

The rules that keep the caching allocator safe: a copy starts after the work already queued on the current stream
(a block it reads or writes may have just been freed there); its device tensors are allocated on the current stream,
outside `copying` (or, allocated inside, are marked with `record_stream` for the streams that use them); and whoever
frees them, or reads or writes what they copy, first calls `wait` for their key (or
synchronizes the device). The copies are tracked per key, so unrelated data never waits.

Not here: what is copied (fsdp_utils/offload.py, weight_snapshot.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class SideStream:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._ready: dict[str, torch.cuda.Event] = {}

    @contextmanager
    def copying(self, key: str):
        """Queue the body's copies on the side stream, after the work queued so far on the current stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        event = torch.cuda.Event()
        event.record(self.stream)
        self._ready[key] = event

    def pending(self, key: str) -> bool:
        return key in self._ready

    def wait(self, key: str) -> None:
        """Order the current stream after the copies under `key` (a stream wait, not a CPU one); none: nothing."""
        event = self._ready.pop(key, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
