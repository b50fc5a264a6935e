"""The Search-R1 example's tool: `search(query)` asks the retrieval server (`retrieval_server.py`) for the top
documents and returns them as text for `<information>...</information>`.

    --tool-functions-path examples.search_r1.search_tool.search --tool-call-parser xml_tags

The server's URL comes from the SEARCH_R1_URL environment variable (the run script sets it before train.py starts
Ray, whose local workers inherit it; on a cluster joined with --ray-address set it on every node). When the server
is down, answers an error status or the wrong shape, the model reads an error text instead of documents; a server
that is too slow is cut off by --tool-timeout (slime.rollout.tools turns that into an error text as well).
"""

from __future__ import annotations

import os

import aiohttp

URL_ENV = "SEARCH_R1_URL"
DEFAULT_URL = "http://127.0.0.1:8000/retrieve"
TOPK = 2


def format_documents(documents: list[str]) -> str:
    """How retrieved documents are shown to the model (the SFT trajectories use the same function)."""
    if not documents:
        return "No documents found."
    return "\n".join(f"Doc {i}: {text}" for i, text in enumerate(documents, 1))


async def search(query: str) -> str:
    """Search the knowledge base; returns the top documents for the query."""
    url = os.environ.get(URL_ENV, DEFAULT_URL)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"queries": [query], "topk": TOPK}) as response:
                payload = await response.json(content_type=None)
                if response.status != 200:
                    detail = payload.get("error") if isinstance(payload, dict) else payload
                    return f"Error: the retrieval server answered {response.status}: {detail}"
    except aiohttp.ClientConnectionError as error:
        return f"Error: the retrieval server at {url} is unreachable ({type(error).__name__}: {error})"
    except (aiohttp.ContentTypeError, ValueError) as error:
        return f"Error: the retrieval server at {url} did not answer JSON ({error})"
    try:
        documents = [hit["contents"] for hit in payload["result"][0]]
    except (KeyError, IndexError, TypeError):
        return f"Error: the retrieval server at {url} answered an unexpected shape: {str(payload)[:200]}"
    return format_documents(documents)
