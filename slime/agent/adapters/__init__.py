"""HTTP adapters that let unmodified agent clients (OpenAI / Anthropic SDKs) drive the rollout engines and record
every turn's sampled token ids for training (slime's `slime.agent.adapters`).

Lifecycle: `adapter = OpenAIAdapter(tokenizer=..., sglang_url=router_url, tool_parser="qwen", max_turns=...,
headers=router_headers(args))`; serve `adapter.app` (aiohttp); per episode `adapter.open_session(sid,
sampling_defaults=...)`, give the agent client `sid` as its API key and the app's URL as its base URL, run it, then
`samples = await adapter.finish_session(sid, base_sample=sample)` (or `drop_session(sid)` to discard).
"""

from slime.agent.adapters.anthropic import AnthropicAdapter
from slime.agent.adapters.common import BaseAdapter
from slime.agent.adapters.openai import OpenAIAdapter

__all__ = ["AnthropicAdapter", "BaseAdapter", "OpenAIAdapter"]
