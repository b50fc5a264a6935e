"""docs/reference/flags.md is generated from the parser: regenerate it in memory and compare, so that a flag added or
changed without `python scripts/gen_flag_reference.py` fails here. Also checks that the page lists every flag."""

import importlib.util
from pathlib import Path

from slime.config.arguments import build_parser

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference" / "flags.md"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_flag_reference", REPO / "scripts" / "gen_flag_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_flag_reference_is_up_to_date():
    assert PAGE.read_text() == _generator().render(), (
        "docs/reference/flags.md is out of date: run python scripts/gen_flag_reference.py and commit the page")


def test_flag_reference_lists_every_flag_once():
    page = PAGE.read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    first_options = [row.split("`")[1] for row in rows]
    parser_options = [action.option_strings[0] for action in build_parser()._actions
                      if action.option_strings and action.option_strings[0].startswith("--")
                      and action.dest != "help"]
    assert sorted(first_options) == sorted(parser_options)
    assert len(set(first_options)) == len(first_options)
