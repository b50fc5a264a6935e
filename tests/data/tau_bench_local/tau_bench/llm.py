"""One chat completion from an OpenAI-compatible server (tau-bench calls litellm's `completion` here)."""

from __future__ import annotations

import os

import openai


def completion(*, model: str, provider: str, messages: list[dict], api_base: str | None = None, **kwargs):
    """`api_base` None: the openai client's own `OPENAI_BASE_URL`. The key: `<PROVIDER>_API_KEY`, as litellm reads
    it."""
    api_key = os.environ.get(f"{provider.upper()}_API_KEY", "EMPTY")
    client = openai.OpenAI(base_url=api_base, api_key=api_key, max_retries=0, timeout=600)
    with client:
        return client.chat.completions.create(model=model, messages=messages, **kwargs)
