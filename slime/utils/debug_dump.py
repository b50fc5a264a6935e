"""slime's rollout dumps on disk: --save-debug-rollout-data / --load-debug-rollout-data (with
--load-debug-rollout-data-subsample), --dump-details' rollout half, and the files slime.rollout.forge_load replays.

A dump is `{"rollout_id": id, "samples": [Sample.to_dict(), ...]}`. The file name picks the encoding: `.json`
files are JSON (readable with any tool), every other name is slime's `torch.save` file (`.pt`), so a dump written by
slime loads here and the other way round. torch files are read with `weights_only=True`: plain containers and
tensors, never arbitrary pickled objects. A sample's numpy arrays (R3's `rollout_routed_experts`) are written as
tensors (`.pt`) or nested lists (`.json`); R3's routing is read back as the int32 array routing replay reads.

Not the train-side dump (slime/backends/debug_train_data.py).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from slime.utils.daemon_threads import DaemonThreadPool
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


def dump_path(template: str, rollout_id: int | str) -> Path:
    return Path(template.format(rollout_id=rollout_id))


def save_samples(path: Path, rollout_id: int, samples: list[Sample]) -> None:
    _write_payload(path, {"rollout_id": rollout_id, "samples": [sample.to_dict() for sample in samples]})


def _encodable(row: dict, as_json: bool) -> dict:
    """A sample's dict with its numpy arrays as the file format holds them: nested lists in JSON, tensors in a torch
    file (which `weights_only` loading accepts, unlike numpy arrays)."""
    def encode(value):
        if not isinstance(value, np.ndarray):
            return value
        return value.tolist() if as_json else torch.from_numpy(np.ascontiguousarray(value))

    return {key: encode(value) for key, value in row.items()}


def _decoded(row: dict) -> dict:
    """A dumped sample's dict with R3's routing (a tensor in a torch file, nested lists in JSON) as the int32 numpy
    array the rollout made ([len(tokens) - 1, num_hidden_layers, top_k])."""
    routing = row.get("rollout_routed_experts")
    if routing is None or isinstance(routing, np.ndarray):
        return row
    return {**row, "rollout_routed_experts": np.asarray(routing, dtype=np.int32)}


def _write_payload(path: Path, payload: dict) -> None:
    """Write through a temporary file renamed into place: a reader (or a crash) never sees half a dump."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    as_json = path.suffix == ".json"
    payload = {**payload, "samples": [_encodable(row, as_json) for row in payload["samples"]]}
    if as_json:
        partial.write_text(json.dumps(payload))
    else:
        torch.save(payload, partial)
    os.replace(partial, path)


class BackgroundDumpWriter:
    """--save-debug-rollout-data off the rollout's critical path: `save` copies the samples (`Sample.to_dict`, the
    only part that must see them before the caller changes them) and one daemon thread encodes and writes the file.
    `flush` waits for the write in flight and raises its error; `save` flushes first, so one dump is written at a
    time and a failed write surfaces by the next rollout at the latest. Flushed at interpreter exit as well."""

    def __init__(self):
        self._thread = DaemonThreadPool(max_workers=1, thread_name_prefix="slime-debug-dump")
        self._pending: tuple[Path, concurrent.futures.Future] | None = None
        atexit.register(self.flush)

    def save(self, path: Path, rollout_id: int, samples: list[Sample]) -> None:
        self.flush()
        payload = {"rollout_id": rollout_id, "samples": [sample.to_dict() for sample in samples]}
        self._pending = path, self._thread.submit(_write_payload, path, payload)

    def flush(self) -> None:
        if self._pending is None:
            return
        (path, future), self._pending = self._pending, None
        try:
            future.result()
        except Exception as exc:
            raise RuntimeError(f"--save-debug-rollout-data: writing {path} failed ({type(exc).__name__}: {exc})") \
                from exc


def load_samples(path: Path, flag: str, subsample_ratio: float | None = None) -> list[Sample]:
    """The samples of a dump; with `subsample_ratio` slime's subsample (the first and last halves of
    int(len * ratio) samples)."""
    try:
        payload = json.loads(path.read_text()) if path.suffix == ".json" else torch.load(path, weights_only=True)
        rows = payload["samples"]
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{flag}: {path} is not a rollout dump ({type(exc).__name__}: {exc}); write one with "
                         "--save-debug-rollout-data") from None
    samples = [Sample.from_dict(_decoded(row)) for row in rows]
    if subsample_ratio is not None:
        keep = int(len(samples) * subsample_ratio)
        if keep == 0:
            raise ValueError(f"--load-debug-rollout-data-subsample {subsample_ratio}: keeps none of the "
                             f"{len(samples)} samples of {path}; raise it")
        first, last = keep // 2, keep - keep // 2  # slime's data[:n // 2] + data[-n // 2:]
        logger.info("%s: subsampled %s from %d to %d samples (ratio %s)", flag, path, len(samples), keep,
                    subsample_ratio)
        samples = samples[:first] + samples[len(samples) - last:]
    return samples
