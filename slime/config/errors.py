"""The error a bad flag raises, and the two helpers every validation rule uses to raise it."""

from __future__ import annotations


class ArgumentError(ValueError):
    """A bad flag or flag combination; the message names the flag and says how to fix it."""


def require(condition: bool, message: str) -> None:
    """Raise `ArgumentError(message)` unless `condition` holds."""
    if not condition:
        raise ArgumentError(message)


def cli_flag(dest: str) -> str:
    """The command-line spelling of an argparse destination: `rollout_batch_size` -> `--rollout-batch-size`."""
    return "--" + dest.replace("_", "-")
