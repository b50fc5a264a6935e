"""`--custom-generate-function-path examples.openai_agent.generate.generate`: train an agent written against the
official `openai` client (agent.py) through slime's `OpenAIAdapter`, without changing a line of the agent.

Per process (the RolloutManager's), once: an `OpenAIAdapter` over the run's router (`--sglang-router-ip/port`, its
API key, `--tool-call-parser`, a turn cap of `--max-turns`) is served on 127.0.0.1 on a free port by an aiohttp
AppRunner on the rollout's event loop (`slime.utils.http_utils`); a lock makes the lazy start safe from any
thread and any number of concurrent samples. Episodes run on that loop too (a call from another loop is handed
over to it), so the adapter and the agents' shared connection pool never cross loops. Per sample:

1. `open_session(<fresh uuid>, sampling_defaults=<the rollout's temperature, top_p, top_k, max_new_tokens, stop>)`:
   `--rollout-max-response-len` bounds each model call (a turn), not the whole episode;
2. the agent runs with `AsyncOpenAI(base_url=<adapter>/v1, api_key=<session id>)`, under `episode_timeout_s`;
3. `finish_session(session id, base_sample=sample)` -> the episode's Samples. Usually one; a sibling when the
   client's re-rendered history differs from the sampled ids (`slime.agent.trajectory`); siblings get one
   rollout_id from the rollout and are weighed as one rollout.

Each Sample gets `metadata["final_answer"]` (what reward.py grades) and `metadata["multi_turn"]` in the shape
`slime.rollout.multi_turn` writes (turns, tool_calls, tool_errors, tool_seconds, turn_lengths, cut_by_context), counting
the agent turns trained in that Sample, so `rollout/turns_per_sample` and `rollout/tool_calls_per_sample` appear in
metrics.jsonl as they do for the built-in multi-turn rollout.

An agent that runs past `episode_timeout_s` (a hung tool, a loop that never ends) is cancelled and its session
dropped; the sample comes back ABORTED with no tokens. The rollout does not score or train an aborted group: it
sets the group aside and draws another prompt group in its place (with `--partial-rollout` the group goes back to
the buffer and its episodes start over). An error the agent raises (an engine failure answered 502, a bad
request) drops the session and propagates: it is a bug to see, not a sample to train on.

Not the agent (agent.py), not the reward (reward.py), not the adapter (`slime.agent.adapters`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import openai
from aiohttp import web

from examples.openai_agent.agent import GET_WEATHER, AgentResult, WeatherService, run_agent
from slime.agent.adapters import OpenAIAdapter
from slime.config.flags_lora import request_lora_path
from slime.rollout.dataset import tokenizer_for
from slime.utils.engine_access import router_headers
from slime.utils.http_utils import get_event_loop, router_url
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

DEFAULT_EPISODE_TIMEOUT_S = 300.0
# The rollout's sampling params an API client would set; not skip_special_tokens=False, the rollout's choice for
# its own decoding, which would put the end-of-turn token into every answer the agent reads.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "sampling_seed")
Agent = Callable[[openai.AsyncOpenAI, Sample, int], Awaitable[AgentResult]]


@dataclass
class ServedAdapter:
    adapter: OpenAIAdapter
    url: str  # http://127.0.0.1:<port>
    http_client: openai.DefaultAsyncHttpxClient  # one connection pool for every episode's AsyncOpenAI
    runner: web.AppRunner


async def serve_adapter(args) -> ServedAdapter:
    """An OpenAIAdapter over the run's router, served on 127.0.0.1 on a port the OS picks, on the running loop."""
    max_turns = int(getattr(args, "max_turns", None) or 1)
    if max_turns < 2:
        raise ValueError(f"examples.openai_agent.generate needs --max-turns >= 2 (a tool call and the answer that "
                         f"reads its result), got --max-turns {max_turns}")
    tokenizer = tokenizer_for(args)
    if tokenizer is None:
        raise ValueError("examples.openai_agent.generate needs --hf-checkpoint (its chat template renders the turns)")
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url=router_url(args),
                            tool_parser=getattr(args, "tool_call_parser", None) or "qwen", max_turns=max_turns,
                            headers=router_headers(args), resume_aborted_turns=args.fully_async)
    runner = web.AppRunner(adapter.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    http_client = openai.DefaultAsyncHttpxClient(trust_env=False)  # an http_proxy must not capture loopback calls
    return ServedAdapter(adapter, f"http://127.0.0.1:{port}", http_client, runner)


_served: dict[str, concurrent.futures.Future] = {}  # router URL -> the adapter serving it
_served_lock = threading.Lock()


async def served_adapter(args) -> ServedAdapter:
    """The process's adapter for the run's router, started on the rollout's event loop by the first caller, from
    whatever thread (the others wait for the same start)."""
    with _served_lock:
        future = _served.get(router_url(args))
        if future is None:
            future = asyncio.run_coroutine_threadsafe(serve_adapter(args), get_event_loop())
            _served[router_url(args)] = future
    return await asyncio.wrap_future(future)


def conversation_of(sample: Sample) -> list[dict]:
    """The sample's chat messages: its prompt, or the messages `--apply-chat-template` kept in its metadata."""
    if isinstance(sample.prompt, list):
        return sample.prompt
    messages = sample.metadata.get("messages")
    if isinstance(messages, list):
        return messages
    return [{"role": "user", "content": sample.prompt}]


async def weather_agent(client: openai.AsyncOpenAI, sample: Sample, max_turns: int) -> AgentResult:
    """agent.py's loop with the episode's world: the row's `metadata.conditions` (task.py)."""
    conditions = sample.metadata.get("conditions")
    if not isinstance(conditions, dict):
        raise ValueError(f"sample {sample.index}: metadata.conditions (each city's weather, read by the get_weather "
                         f"tool) is missing; build the prompts with examples/openai_agent/task.py")
    service = WeatherService(conditions)
    return await run_agent(client, conversation_of(sample), [GET_WEATHER], service.execute, max_turns)


def multi_turn_state(result: AgentResult, turn_indices: list[int]) -> dict:
    """What `rollout/turns_per_sample` etc. read, for the agent turns one Sample trains (each turn in one Sample)."""
    turns = [result.turns[i] for i in turn_indices if i < len(result.turns)]
    return {"turns": len(turns), "tool_calls": sum(t.num_tool_calls for t in turns),
            "tool_errors": sum(t.num_tool_errors for t in turns), "tool_seconds": sum(t.tool_seconds for t in turns),
            "turn_lengths": [t.completion_tokens for t in turns], "cut_by_context": False}


def make_generate(agent: Agent = weather_agent, episode_timeout_s: float = DEFAULT_EPISODE_TIMEOUT_S):
    """A generate function running `agent` per sample, cancelled after `episode_timeout_s` (module docstring)."""
    if episode_timeout_s <= 0:
        raise ValueError(f"episode_timeout_s must be > 0, got {episode_timeout_s}")

    async def generate(args, sample: Sample, sampling_params: dict) -> list[Sample] | Sample:
        rollout_loop = get_event_loop()
        if asyncio.get_running_loop() is not rollout_loop:  # the adapter and the shared HTTP pool live there
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                generate(args, sample, sampling_params), rollout_loop))
        served = await served_adapter(args)
        session_id = uuid.uuid4().hex
        defaults = {key: value for key, value in sampling_params.items() if key in SAMPLING_KEYS}
        # LoRA: the turns ask for the sample's adapter, the version last pushed (slime/config/flags_lora.py)
        served.adapter.open_session(session_id, sampling_defaults=defaults,
                                    lora_path=lambda: request_lora_path(args, sample.metadata))
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=session_id, max_retries=0,
                                    timeout=episode_timeout_s, http_client=served.http_client)
        try:
            result = await asyncio.wait_for(agent(client, sample, served.adapter.max_turns), episode_timeout_s)
        except asyncio.TimeoutError:
            served.adapter.drop_session(session_id)
            logger.warning("sample %s: the agent ran past %.0f s; its session is dropped and the sample ABORTED",
                           sample.index, episode_timeout_s)
            sample.status = Sample.Status.ABORTED
            return sample
        except BaseException:
            served.adapter.drop_session(session_id)
            raise
        samples = await served.adapter.finish_session(session_id, base_sample=sample)
        if not samples:  # the agent returned without a model call: nothing was sampled to train on
            sample.status = Sample.Status.ABORTED
            return sample
        for out in samples:
            out.metadata["final_answer"] = result.final_answer
            out.metadata["multi_turn"] = multi_turn_state(result, out.metadata["turn_indices"])
        return samples

    return generate


generate = make_generate()
