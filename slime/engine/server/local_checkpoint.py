"""The engine's host-local checkpoint for disk weight sync (POST /pull_weights, slime's SGLang patch's contract):
bring `local_checkpoint_dir` up to a published version, then the engine reloads it through the ordinary
/update_weights_from_disk.

Pulling version N walks back from N over delta versions to the version the local copy holds, or else to a full
version (a published `weight_v000000`, or else the engine's own checkpoint, is version 0) which it copies, then
applies the deltas after that in order, each checked against the checksums the trainer wrote; a mismatch raises
`ChecksumMismatchError` and leaves the applied-version marker where it was, so the local copy is never reported as
a version it does not hold (the trainer then publishes a full version, which replaces it). A per-folder file lock
makes several engines of one host share one local copy: the first pull does the work, the others find the version
applied.

Not the format (slime.utils.weight_delta) and not the model's loader.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from slime.utils import weight_delta

SYNC_DIR = ".weight_sync"  # the applied-version marker and the lock, inside the local checkpoint


class ChecksumMismatchError(RuntimeError):
    pass


def pull(local_checkpoint_dir: str | Path, base_dir: str | Path, source_dir: str | Path, target_version: int) -> None:
    local = Path(local_checkpoint_dir)
    with _lock(local):
        applied = applied_version(local)
        # Back from the target over delta versions, to the local copy's version or a full version.
        start = target_version
        while start != applied and start > 0 and weight_delta.is_delta(weight_delta.version_dir(source_dir, start)):
            start -= 1
        if start != applied:
            seed = weight_delta.version_dir(source_dir, start)
            _reset(seed if start > 0 or seed.is_dir() else Path(base_dir), local, start)
        for version in range(start + 1, target_version + 1):
            _apply_delta(local, weight_delta.version_dir(source_dir, version))


def applied_version(local: Path) -> int | None:
    marker = local / SYNC_DIR / "state.json"
    return int(json.loads(marker.read_text())["version"]) if marker.is_file() else None


def _write_applied_version(local: Path, version: int) -> None:
    marker = local / SYNC_DIR / "state.json"
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": f"{version:06d}"}))
    os.replace(tmp, marker)


@contextmanager
def _lock(local: Path):
    (local / SYNC_DIR).mkdir(parents=True, exist_ok=True)
    with open(local / SYNC_DIR / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _reset(source: Path, local: Path, version: int) -> None:
    """Make `local` a copy of the full checkpoint `source` (weight files it lacks are removed)."""
    files = [entry for entry in source.iterdir() if entry.is_file()]
    for entry in files:
        tmp = local / (entry.name + ".tmp")
        shutil.copyfile(entry, tmp)
        os.replace(tmp, local / entry.name)
    names = {entry.name for entry in files}
    for entry in local.glob("*.safetensors"):  # weights of an earlier layout (other file names)
        if entry.name not in names:
            entry.unlink()
    if weight_delta.INDEX_FILE not in names:
        (local / weight_delta.INDEX_FILE).unlink(missing_ok=True)
    _write_applied_version(local, version)


def _apply_delta(local: Path, version_folder: Path) -> None:
    metadata = weight_delta.read_index(version_folder)["metadata"]
    version, base = int(metadata["version"]), int(metadata["base_version"])
    applied = applied_version(local)
    if applied == version:
        return
    if applied != base:
        raise ValueError(f"delta {version_folder} builds on version {base}, the local checkpoint holds {applied}")
    if metadata["compression_format"] != weight_delta.COMPRESSION:
        raise ValueError(f"delta {version_folder}: compression {metadata['compression_format']!r} is not supported")
    encoding, algorithm = metadata["delta_encoding"], metadata["checksum_format"]
    locations = weight_delta.tensor_locations(local)
    mismatches = []
    for delta_file in sorted(version_folder.glob("*.safetensors")):
        header, data_start = weight_delta.safetensors_header(delta_file)
        expected = header.get("__metadata__", {})
        blob = delta_file.read_bytes()
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name not in locations:
                raise ValueError(f"delta {delta_file} changes {name!r}, which the local checkpoint lacks")
            path, offset, num_bytes = locations[name]
            begin, end = info["data_offsets"]
            with open(path, "r+b") as handle:
                handle.seek(offset)
                region = np.frombuffer(bytearray(handle.read(num_bytes)), dtype=np.uint8)
                weight_delta.apply(encoding, region, blob[data_start + begin:data_start + end])
                handle.seek(offset)
                handle.write(region.tobytes())
            if weight_delta.checksum(algorithm, region) != expected.get(name):
                mismatches.append(name)
    if mismatches:
        raise ChecksumMismatchError(f"checksum mismatch for {len(mismatches)} tensor(s) after applying "
                                    f"{version_folder}: {sorted(mismatches)[:8]}")
    _write_applied_version(local, version)
