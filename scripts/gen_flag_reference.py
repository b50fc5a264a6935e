"""Write docs/reference/flags.md: every flag of `train.py` / `train_async.py`, generated from the parser itself.

    python scripts/gen_flag_reference.py            # rewrite the page
    python scripts/gen_flag_reference.py --check    # exit 1 if the committed page is out of date

One table per argument group, in the parser's order: the flag (with its aliases), its default, where it comes from
and what this project does with it, and its help text. The status comes from the tables the parser itself uses:
`slime.config.flag_status` (slime's inert and refused flags), the Megatron flags' `inert_because` (their help says
"no effect here: ..."), the `--sglang-*` -> built-in engine mapping of `slime.config.flags_sglang`, and the two
committed snapshots of the upstream parsers (THUDM/slime's flags, megatron-core 0.16.1's flags) for the origin.
tests/docs/test_flag_reference.py regenerates the page in memory and fails when the committed one differs.
The parser is imported only through `slime.config.arguments`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slime.config import arguments  # noqa: E402

PAGE = REPO / "docs" / "reference" / "flags.md"
SLIME_SNAPSHOT = REPO / "tests" / "slime_upstream" / "slime_flags.json"
MEGATRON_SNAPSHOT = REPO / "tests" / "data" / "megatron_core_0.16.1_flags.json"
MEGATRON_INERT_PREFIX = "no effect here: "
# Megatron's MoE flags live in slime/config/flags_moe.py (not in the Megatron snapshot, which covers
# megatron_utils/arguments.py): every --moe-* flag there and --num-experts are Megatron's names.
MEGATRON_MOE_OPTIONS = ("--moe-", "--num-experts")

HEADER = """# Flag reference

Every flag `train.py` and `train_async.py` accept, generated from the parser (`slime.config.arguments.build_parser`)
by `python scripts/gen_flag_reference.py`; `tests/docs/test_flag_reference.py` fails when a flag is added or
changed without regenerating this page. One table per argument group, in the parser's order.

The **status** column says where the flag comes from and what this project does with it:

- **slime**: one of THUDM/slime's own flags, same name and default, does what slime's does.
- **slime, default changed**: slime's flag with another default here, for the reason given.
- **slime, inert** / **Megatron, inert**: accepted so that recipes run unchanged, no effect here (why is given); a run
  that sets one is told so once at start-up.
- **slime, refused**: accepted by the parser so the message is clear; setting it is an error that says why.
- **Megatron**: Megatron-LM's flag with Megatron's name and default (megatron-core 0.16.1); the
  [Megatron parallelism guide](../guides/megatron-parallelism.md) says what each one does here.
- **SGLang**: SGLang's server flag (sglang 0.5.15) under the `--sglang-` prefix. Passed to SGLang with
  `--rollout-backend sglang`; with the built-in engine, the ones that name an engine setting map onto it and the
  others are reported once as unused.
- **sglang-router**: sglang-router's own flag under the `--router-` prefix, passed to the router process.
- **this project**: a flag slime does not have.

[slime's flag table](slime-flags.md) lists slime's flags alone, with slime's defaults.
"""


def _load_snapshots() -> tuple[set[str], set[str]]:
    """(slime's flags: option strings and dests, Megatron's option strings)."""
    slime_flags = {key for row in json.loads(SLIME_SNAPSHOT.read_text())["flags"] for key in (row["flag"], row["dest"])}
    megatron_options = set(json.loads(MEGATRON_SNAPSHOT.read_text())["flags"])
    return slime_flags, megatron_options


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped, and outside `code spans` no HTML."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    default = action.default
    if default is None or default is argparse.SUPPRESS:
        return ""
    try:
        shown = json.dumps(default)
    except TypeError:
        shown = repr(default)
    return "`" + " ".join(shown.split()).replace("|", "\\|") + "`"


def _status(action: argparse.Action, group_title: str, slime_flags: set[str], megatron_options: set[str]) -> str:
    from slime.config import engine_layout, flag_status, flags_sglang

    dest = action.dest
    if dest in flag_status.REFUSED:
        return "slime, refused: " + flag_status.REFUSED[dest]
    if dest in flag_status.INERT:
        return "slime, inert: " + flag_status.INERT[dest]
    if action.help and action.help.startswith(MEGATRON_INERT_PREFIX):
        return "Megatron, inert: " + action.help[len(MEGATRON_INERT_PREFIX):]
    if group_title.startswith("sglang") and dest.startswith("sglang_") and dest not in slime_flags:
        if dest in flags_sglang.SGLANG_FLAG_TO_ENGINE_CONFIG:
            field, _ = flags_sglang.SGLANG_FLAG_TO_ENGINE_CONFIG[dest]
            refused = [f"`{value}` needs `--rollout-backend sglang`"
                       for (refused_dest, value) in flags_sglang.UNSUPPORTED_BY_ENGINE if refused_dest == dest]
            return f"SGLang; built-in engine: `{field}`" + "".join("; " + r for r in refused)
        if dest in engine_layout.RESHAPING_SGLANG_FLAGS:
            return "SGLang; above 1 needs `--rollout-backend sglang` (the built-in engine shards by TP / EP only)"
        return "SGLang; unused by the built-in engine"
    if group_title.startswith("router") and dest.startswith("router_"):
        if dest in flags_sglang.ROUTER_OWNED:
            return "sglang-router; set by slime's router launcher (`slime.ray.router`)"
        return "sglang-router"
    if dest in slime_flags or any(option in slime_flags for option in action.option_strings):
        if dest in flag_status.DEFAULTS_CHANGED:
            return "slime, default changed: " + flag_status.DEFAULTS_CHANGED[dest]
        return "slime"
    if any(option in megatron_options or option.startswith(MEGATRON_MOE_OPTIONS) for option in action.option_strings):
        return "Megatron"
    return "this project"


def _flags(action: argparse.Action) -> str:
    return " ".join(f"`{option}`" for option in action.option_strings)


def _help(action: argparse.Action) -> str:
    if not action.help or action.help is argparse.SUPPRESS or action.help.startswith(MEGATRON_INERT_PREFIX):
        return ""
    return _cell(action.help % {"default": action.default} if "%(default)" in action.help else action.help)


def render() -> str:
    parser = arguments.build_parser()
    slime_flags, megatron_options = _load_snapshots()
    sections = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        rows = [f"| {_flags(a)} | {_default(a)} | {_cell(_status(a, group.title, slime_flags, megatron_options))} "
                f"| {_help(a)} |" for a in actions]
        sections.append(f"## {group.title}\n\n{len(actions)} flags.\n\n| flag | default | status | description |\n"
                        "|---|---|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference/flags.md is out of date")
    if parser.parse_args().check:
        if PAGE.read_text() != render():
            sys.exit(f"{PAGE} is out of date: run python scripts/gen_flag_reference.py")
        return
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
