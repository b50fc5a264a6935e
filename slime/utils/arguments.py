"""slime's public path of the flag parser, kept for slime's scripts and plugins (`from slime.utils.arguments import
parse_args`). The flags, their validation and status tables live in `slime.config`."""

from slime.config.arguments import ARGUMENT_GROUPS, build_parser, parse_args

__all__ = ["ARGUMENT_GROUPS", "build_parser", "parse_args"]
