"""What the trainer asks the engines before a weight push: GET /get_server_info, and the dtype they all run in.

Not the push itself (slime/backends/weight_sender.py).
"""

from __future__ import annotations

import torch

from slime.utils.blocking_http import blocking_client

HTTP_TIMEOUT_S = 600.0


def server_infos(urls: list[str], headers: dict | None = None) -> dict[str, dict | None]:
    """GET /get_server_info of each engine: {url: its answer, or None when it failed; absent when unreachable}."""
    import httpx

    infos = {}
    for url in urls:
        try:
            response = blocking_client().get(url.rstrip("/") + "/get_server_info", headers=headers,
                                             timeout=HTTP_TIMEOUT_S)
        except httpx.TransportError:
            continue  # a lost engine has no say (and the push skips it)
        infos[url] = response.json() if response.status_code == 200 else None
    return infos


def engines_dtype(urls: list[str], headers: dict | None = None,
                  infos: dict[str, dict | None] | None = None) -> torch.dtype | None:
    """The floating dtype every engine reports in /get_server_info ("dtype"), or None when they differ, one does
    not say, or says "auto" (real SGLang reports its --dtype flag)."""
    infos = server_infos(urls, headers) if infos is None else infos
    names = {info.get("dtype") if info else None for info in infos.values()}
    (name,) = names if len(names) == 1 else (None,)
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
