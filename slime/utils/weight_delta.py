"""The on-disk format of disk weight sync (`--update-weight-transport disk`), shared by the trainer that writes it
and the engine that reads it; slime's format, so a slime-patched SGLang engine reads what this trainer writes.

Each sync is a version folder `weight_v{N:06d}/` under `--update-weight-disk-dir`, an HF checkpoint of one of two
kinds, told apart by its `model.safetensors.index.json` metadata:
- full: ordinary safetensors files (plus config.json and the tokenizer files): every weight's value;
- delta (`--update-weight-mode delta`; the metadata has `delta_encoding`): for each weight that changed since version
  `base_version`, one uint8 tensor holding the zstd-compressed difference of its raw bytes ("xor": new ^ old;
  "overwrite": the changed byte positions and their new values), and in the file's safetensors metadata the
  checksum of the weight's new bytes (`checksum_format`: xxh3-128, blake3 or adler32).
Byte-level and dtype-blind: a delta applies to the bytes of the tensor the previous version holds.

Not the writer (slime.backends.weight_disk) and not the reader (slime.engine.server.local_checkpoint); numpy only.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import zlib
from pathlib import Path

import numpy as np

INDEX_FILE = "model.safetensors.index.json"
DELTA_ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
CHECKSUM_PACKAGES = {"xxh3-128": "xxhash", "blake3": "blake3"}
COMPRESSION = "zstd"
ZSTD_LEVEL = 1  # slime's choice: level 1 gives most of the size reduction at a fraction of the time


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"weight_v{version:06d}"


def parse_version(weight_version) -> int:
    """Disk sync names its folders by number: the weight version must be a non-negative integer."""
    try:
        version = int(str(weight_version))
    except ValueError:
        raise ValueError(f"disk weight sync needs an integer weight version, got {weight_version!r}") from None
    if version < 0:
        raise ValueError(f"disk weight sync needs a non-negative weight version, got {version}")
    return version


def missing_packages(algorithm: str) -> list[str]:
    """The pip packages a delta sync with checksum `algorithm` needs that are not installed."""
    needed = ["zstandard"] + ([CHECKSUM_PACKAGES[algorithm]] if algorithm in CHECKSUM_PACKAGES else [])
    return [package for package in needed if importlib.util.find_spec(package) is None]


class _Adler32:
    def __init__(self):
        self.value = 1

    def update(self, data) -> None:
        self.value = zlib.adler32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def checksum(algorithm: str, data) -> str:
    """Hex digest of `data` (bytes or a uint8 array) by one of CHECKSUMS."""
    if algorithm == "xxh3-128":
        import xxhash

        hasher = xxhash.xxh3_128()
    elif algorithm == "blake3":
        import blake3

        hasher = blake3.blake3()
    elif algorithm == "adler32":
        hasher = _Adler32()
    else:
        raise ValueError(f"unknown checksum {algorithm!r}; choose one of {', '.join(CHECKSUMS)}")
    hasher.update(memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else data)
    return hasher.hexdigest()


def encode(encoding: str, old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray | None, int]:
    """(zstd-compressed delta turning the uint8 bytes `old` into `new`, or None when equal; changed byte count)."""
    import zstandard

    if old.shape != new.shape:
        raise ValueError(f"a delta needs equal sizes, got {old.size} and {new.size} bytes")
    if encoding == "xor":  # one pass over both: the changed bytes are the nonzero ones of the xor
        raw = np.bitwise_xor(old, new)
        num_changed = int(np.count_nonzero(raw))
    elif encoding == "overwrite":
        changed_mask = old != new
        positions = np.flatnonzero(changed_mask).astype("<u4")
        num_changed = int(positions.size)
        raw = np.concatenate([np.array([positions.size], "<u4").view(np.uint8), positions.view(np.uint8),
                              new[changed_mask]])
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}; choose one of {', '.join(DELTA_ENCODINGS)}")
    if not num_changed:
        return None, 0
    compressed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    return np.frombuffer(bytearray(compressed), dtype=np.uint8), num_changed


def apply(encoding: str, region: np.ndarray, compressed: bytes) -> None:
    """Apply one tensor's delta to its uint8 bytes `region` in place (xor applies exactly once; overwrite is
    idempotent)."""
    import zstandard

    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(compressed), dtype=np.uint8)
    if encoding == "xor":
        if raw.size != region.size:
            raise ValueError(f"xor delta of {raw.size} bytes for a tensor of {region.size}")
        np.bitwise_xor(region, raw, out=region)
    elif encoding == "overwrite":
        count = int(raw[:4].view("<u4")[0])
        positions = raw[4:4 + 4 * count].view("<u4")
        if positions.size and int(positions.max()) >= region.size:
            raise ValueError(f"overwrite delta names byte {int(positions.max())} of a {region.size}-byte tensor")
        region[positions] = raw[4 + 4 * count:]
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}")


def read_index(folder: str | Path) -> dict:
    """The folder's index ({"metadata": ..., "weight_map": ...}), or {} when it has none."""
    path = Path(folder) / INDEX_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def is_delta(folder: str | Path) -> bool:
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"published weight version missing: {folder}")
    return "delta_encoding" in read_index(folder).get("metadata", {})


def safetensors_header(path: str | Path) -> tuple[dict, int]:
    """(header dict, byte offset where the tensor data starts) of a safetensors file."""
    with open(path, "rb") as file:
        (header_length,) = struct.unpack("<Q", file.read(8))
        return json.loads(file.read(header_length)), 8 + header_length


def tensor_locations(folder: str | Path) -> dict[str, tuple[Path, int, int]]:
    """Each tensor of the folder's safetensors files -> (file, byte offset, byte count)."""
    locations = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        header, data_start = safetensors_header(path)
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                locations[name] = (path, data_start + begin, end - begin)
    return locations
