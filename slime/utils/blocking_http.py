"""One blocking HTTP client per process, for the synchronous control calls to engines (weight pushes, memory
release / resume, fault-tolerance re-releases): `blocking_client()`.

Why one: `httpx.post` / `httpx.get` make a new client for every call, and a new client builds an SSL context
(loading the CA bundle) even for plain http: ~30 ms a call on the 2-core CI machine, against ~1 ms for the same
request on a kept client (measured with the CPU engine server). A colocated step makes about ten such calls
(release, two resumes, one POST per weight bucket), one after another. The client is thread-safe and keeps
connections alive; a connection whose engine died is dropped, and the next call to that URL fails to connect
(httpx.ConnectError) as before. Made lazily, so a forked child never inherits a parent's open connections.
Not the rollout's async HTTP (`slime.utils.http_utils`).
"""

from __future__ import annotations

import threading

import httpx

_lock = threading.Lock()
_client: httpx.Client | None = None


def blocking_client() -> httpx.Client:
    global _client
    with _lock:
        if _client is None:
            _client = httpx.Client(trust_env=False, limits=httpx.Limits(max_connections=None,
                                                                        max_keepalive_connections=64))
        return _client
