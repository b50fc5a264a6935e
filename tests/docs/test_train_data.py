"""docs/contracts/train-data.md's key table lists exactly the keys of `TrainData` (both directions), each once."""

import re
from pathlib import Path

from slime.utils.train_data_types import TrainData

PAGE = Path(__file__).resolve().parents[2] / "docs" / "contracts" / "train-data.md"
HEADER = "| key | type | meaning |"


def table_keys(markdown: str) -> list[str]:
    lines = markdown.splitlines()
    start = lines.index(HEADER) + 2  # past the header and the |---| line
    keys = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        match = re.match(r"\|\s*`([a-z_]+)`\s*\|", line)
        assert match, f"a row of the train-data table does not start with a `key`: {line!r}"
        keys.append(match.group(1))
    return keys


def test_train_data_table_matches_typed_dict():
    keys = table_keys(PAGE.read_text())
    assert len(keys) == len(set(keys)), "a key is listed twice"
    documented, declared = set(keys), set(TrainData.__annotations__)
    assert documented - declared == set(), "in the docs table but not in TrainData"
    assert declared - documented == set(), "in TrainData but not in the docs table"


def test_table_parser_reads_rows_until_the_table_ends():
    page = f"intro\n\n{HEADER}\n|---|---|---|\n| `a` | `int` | x |\n| `b_c` | `str` | y |\n\nafter | `z` |\n"
    assert table_keys(page) == ["a", "b_c"]
