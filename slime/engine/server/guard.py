"""Who may call the engine server, and how much they may send: API keys, admin routes, request-size limits.

An ASGI middleware in front of every route, so a refused request is answered before its body is read or parsed:
- `api_key` (SGLang's `--api-key`): every route but `GET /health` needs `Authorization: Bearer <key>`; 401 otherwise.
- `admin_api_key` (SGLang's `--admin-api-key`): the routes that change the model or the server's state
  (`ADMIN_ROUTES`: weights, memory, abort, pause, flush) need this key; with only `api_key` set, that key serves.
- Admin routes are refused (403) to peers that are not on loopback unless `allow_remote_admin`, whatever the key.
- Bodies over `max_request_bytes` get 413 from their Content-Length, or as soon as a chunked body passes the limit.

Not TLS and not rate limiting: put the server behind a proxy for those.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
ADMIN_ROUTES = frozenset(
    {
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/pull_weights",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/load_lora_adapter_from_distributed",
    }
)
OPEN_ROUTES = frozenset({"/health"})  # load balancers and sglang-router probe it without credentials


@dataclass(frozen=True)
class AccessPolicy:
    api_key: str | None = None
    admin_api_key: str | None = None
    allow_remote_admin: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self):
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be an int >= 1024, got {self.max_request_bytes!r}")
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must be a non-empty string or unset")

    def refusal(self, path: str, authorization: str | None, peer_host: str | None) -> tuple[int, str] | None:
        """(status, message) when the request must be refused, else None."""
        if path in OPEN_ROUTES:
            return None
        token = _bearer_token(authorization)
        if path in ADMIN_ROUTES:
            if not self.allow_remote_admin and not _is_loopback(peer_host):
                return 403, (f"{path} changes the engine and is only served to loopback peers; start the server "
                             "with --allow-remote-admin (and --admin-api-key) to allow remote peers")
            required = self.admin_api_key or self.api_key
            if required is not None and not _matches(token, required):
                flag = "--admin-api-key" if self.admin_api_key else "--api-key"
                return 401, f"{path} needs 'Authorization: Bearer <key>' with the server's {flag}"
            return None
        if self.api_key is not None and not (_matches(token, self.api_key) or _matches(token, self.admin_api_key)):
            return 401, f"{path} needs 'Authorization: Bearer <key>' with the server's --api-key"
        return None


class RequestTooLarge(Exception):
    pass


class GuardMiddleware:
    """ASGI middleware applying an AccessPolicy to every HTTP request."""

    def __init__(self, app, policy: AccessPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        peer_host = scope["client"][0] if scope.get("client") else None
        refused = self.policy.refusal(scope["path"], headers.get("authorization"), peer_host)
        if refused is not None:
            return await _reply(send, *refused)
        limit = self.policy.max_request_bytes
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _reply(send, 413, _too_large(declared, limit))
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except RequestTooLarge:
            if not started:
                await _reply(send, 413, _too_large(f"more than {received}", limit))


def _too_large(size: str, limit: int) -> str:
    return (f"request body of {size} bytes is over the server's limit of {limit} bytes (--max-request-bytes); "
            "send less per request")


async def _reply(send, status: int, message: str) -> None:
    kind = {401: "AuthenticationError", 403: "PermissionDeniedError", 413: "RequestTooLargeError"}.get(status, "Error")
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}, "object": "error",
                       "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _matches(token: str | None, key: str | None) -> bool:
    return token is not None and key is not None and hmac.compare_digest(token.encode(), key.encode())


def _is_loopback(host: str | None) -> bool:
    if host is None:  # a unix socket: only local processes reach it
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
