"""Reading prompt data files (slime's `slime.utils.data`): `.jsonl` / `.parquet` rows, and the `path@[start:end]`
row-slicing syntax (Python slice semantics, negative bounds counted from the end).

`read_rows` yields (location, row) with "file:line" locations for error messages; slime's `read_file` yields the
rows of a sliced path. Turning rows into Samples is `slime.rollout.dataset`'s job.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Iterator

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


def parse_path_spec(spec: str) -> tuple[str, int | None, int | None]:
    """`data.jsonl@[10:20]` -> ("data.jsonl", 10, 20); a plain path -> (path, None, None). Python slice semantics."""
    match = _SLICE_RE.match(spec)
    if not match:
        return spec, None, None
    start, end = match["start"], match["end"]
    return match["path"], int(start) if start else None, int(end) if end else None


def read_rows(path: str) -> Iterator[tuple[str, dict]]:
    """Yield (location, row) for every row of a .jsonl or .parquet file; location is "file:line" for error messages."""
    file = Path(path)
    if not file.exists():
        raise ValueError(f"prompt data file {path!r} does not exist")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        for row_number, row in enumerate(pq.read_table(file).to_pylist()):
            yield f"{path}:row {row_number}", row
        return
    if file.suffix not in (".jsonl", ".json"):
        raise ValueError(f"prompt data file {path!r}: unsupported format; use .jsonl or .parquet")
    with file.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            location = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{location}: malformed JSON row ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{location}: each row must be a JSON object, got {type(row).__name__}")
            yield location, row


def _parse_generalized_path(spec: str) -> tuple[str, slice | None]:
    """slime's form of `parse_path_spec`: (path, slice or None)."""
    path, start, end = parse_path_spec(spec)
    return path, (None if start is None and end is None else slice(start, end))


def read_file(spec: str) -> Iterator[dict]:
    """The rows of `path[@[start:end]]`; a slice without negative bounds streams, one with them counts the rows."""
    path, row_slice = _parse_generalized_path(spec)
    rows = (row for _, row in read_rows(path))
    if row_slice is None:
        yield from rows
    elif (row_slice.start or 0) >= 0 and (row_slice.stop is None or row_slice.stop >= 0):
        yield from itertools.islice(rows, row_slice.start, row_slice.stop)
    else:
        yield from list(rows)[row_slice]
