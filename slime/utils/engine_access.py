"""The credentials a run uses with its engines and its router, in one place.

- `--sglang-api-key` (SGLang's `--api-key`): when given, every engine route but /health and the router itself need
  it; the router is started with it (sglang-router then also authenticates to the engines with it).
- `--sglang-admin-api-key` (SGLang's `--admin-api-key`): the key of the engines' state-changing routes (weights,
  memory, abort). With the built-in engine a run that names none gets a random one, so no other process on the host
  can push weights or release an engine's memory; only this run's actors (which receive `args`) know it.
Keys travel to engine servers in an owner-only config file, never on a command line, and `args.json` redacts them.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlparse

SECRET_ARGS = ("sglang_api_key", "sglang_admin_api_key", "wandb_key")
REDACTED = "<redacted>"


def ensure_admin_key(args) -> None:
    """Give a built-in-engine run its own admin key when the user named none."""
    if args.sglang_admin_api_key is None and args.rollout_backend == "slime":
        args.sglang_admin_api_key = secrets.token_urlsafe(32)


def _bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def router_headers(args) -> dict:
    """Headers for requests to the router (generation, /workers)."""
    return _bearer(args.sglang_api_key)


def engine_admin_headers(args) -> dict:
    """Headers for direct requests to an engine: the admin key (accepted on every route), else the API key."""
    return _bearer(args.sglang_admin_api_key or args.sglang_api_key)


def redacted(values: dict) -> dict:
    """`values` (e.g. vars(args)) with every key secret replaced."""
    return {k: (REDACTED if k in SECRET_ARGS and v is not None else v) for k, v in values.items()}


def external_engine_url(addr: str) -> str:
    """`host:port` or `http://host:port` (--rollout-external-engine-addrs) -> the engine's base URL."""
    url = (addr if "://" in addr else f"http://{addr}").rstrip("/")
    try:
        parsed = urlparse(url)
        valid = parsed.scheme == "http" and parsed.hostname is not None and parsed.port is not None
    except ValueError:
        valid = False
    if not valid or parsed.path:
        raise ValueError(f"--rollout-external-engine-addrs {addr!r}: use host:port or http://host:port "
                         "(an IPv6 host in brackets)")
    return url
