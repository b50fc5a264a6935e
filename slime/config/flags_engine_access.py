"""The flags of the credentials a run uses with its engines and its router (`slime.utils.engine_access` uses them)."""

from __future__ import annotations


def add_engine_access_arguments(parser) -> None:
    g = parser.add_argument_group("engine access")
    g.add_argument("--sglang-api-key", default=None,
                   help="bearer token the engines (every route but /health) and the router require")
    g.add_argument("--sglang-admin-api-key", default=None,
                   help="bearer token of the engines' weight / memory / abort routes (built-in engine: a random "
                        "per-run key when not given)")
